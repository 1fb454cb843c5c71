"""serving/: many requests on one model. The floor above integration/ (uses only the public API below it).

    GenerationManager   add_request / stream / astream / result / cancel / stop / metrics
    SamplingParams      per-request max_tokens, temperature, top_p, top_k, stop, stop_token_ids, seed, ignore_eos
    GenerationOutput    one streamed event; GenerationResult: a finished request; FinishReason
    Engine              the interface an engine implements (engine.py); SequentialEngine: one request at a time;
                        BatchingEngine: continuous batching over a KVBlockPool (BatchingConfig: rows, buckets)
    Lockstep            tensor parallel serving: rank 0's engine takes requests, every rank steps with it
    generate_batch      prompts in, results in input order
    create_app          the OpenAI-compatible FastAPI app (optional extra: pip install hf_rocketkv[serve])

FastAPI, uvicorn and prometheus-client are imported only by ``create_app`` / ``ServerThread``. The ``hf-rocketkv serve``
command is the face floor's (``hf_rocketkv/cli/serve.py``).
"""

from .batch import generate_batch
from .batching import BatchingEngine
from .engine import Engine, EngineEvent, EngineLoad, EngineRequest
from .errors import EngineStopped, InvalidRequest, Overloaded, ServeDependencyError, UnknownRequest
from .lockstep import Lockstep
from .manager import GenerationManager
from .metrics import HistogramSnapshot, ManagerMetrics
from .outputs import FinishReason, GenerationOutput, GenerationResult, RequestTimings
from .sampling import SamplingParams
from .scheduler import BatchingConfig
from .sequential import SequentialEngine

__all__ = [
    "BatchingConfig",
    "BatchingEngine",
    "Engine",
    "EngineEvent",
    "EngineLoad",
    "EngineRequest",
    "EngineStopped",
    "FinishReason",
    "GenerationManager",
    "GenerationOutput",
    "GenerationResult",
    "HistogramSnapshot",
    "InvalidRequest",
    "Lockstep",
    "ManagerMetrics",
    "Overloaded",
    "RequestTimings",
    "SamplingParams",
    "SequentialEngine",
    "ServeDependencyError",
    "UnknownRequest",
    "create_app",
    "generate_batch",
]


def __getattr__(name: str):
    """``create_app`` loads lazily: its module needs the optional serve extra."""
    if name == "create_app":
        from .server import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
