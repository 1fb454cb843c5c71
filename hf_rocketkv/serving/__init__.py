"""serving/: many requests on one model. The floor above integration/ (uses only the public API below it).

    GenerationManager   add_request / stream / astream / result / cancel / stop / metrics
    SamplingParams      per-request max_tokens, temperature, top_p, top_k, stop, stop_token_ids, seed, ignore_eos
    GenerationOutput    one streamed event; GenerationResult: a finished request; FinishReason
    Engine              the interface an engine implements (engine.py); SequentialEngine: one request at a time;
                        BatchingEngine: continuous batching over a KVBlockPool (BatchingConfig: rows, buckets)
    build_engine        the one builder of an engine (the manager, generate_batch, warm_up_engine and serve use it)
    Lockstep            tensor parallel serving: rank 0's engine takes requests, every rank steps with it
    generate_batch      prompts in, results in input order (offline_batching_config: its engine settings)
    create_app          the OpenAI-compatible FastAPI app (optional extra: pip install hf_rocketkv[serve])

Every name loads its module on first use; FastAPI, uvicorn and prometheus-client are imported only by
``create_app`` / ``ServerThread``. The ``hf-rocketkv serve`` command is the face floor's (``hf_rocketkv/cli/serve.py``).
"""

import importlib

# public name -> the module that defines it: imported on first use, so that ``hf_rocketkv.serving.http.deps`` (the serve
# command's first check) and the errors load without torch or transformers
_PUBLIC = {
    "BatchingConfig": ".batching.scheduler",
    "BatchingEngine": ".batching.engine",
    "Engine": ".engines.interface",
    "EngineEvent": ".engines.interface",
    "EngineLoad": ".engines.interface",
    "EngineRequest": ".engines.interface",
    "EngineStopped": ".errors",
    "FinishReason": ".outputs",
    "GenerationManager": ".manager",
    "GenerationOutput": ".outputs",
    "GenerationResult": ".outputs",
    "HistogramSnapshot": ".metrics",
    "InvalidRequest": ".errors",
    "Lockstep": ".parallel.lockstep",
    "ManagerMetrics": ".metrics",
    "Overloaded": ".errors",
    "RequestTimings": ".outputs",
    "SamplingParams": ".sampling",
    "SequentialEngine": ".engines.sequential",
    "build_engine": ".builder",
    "ServeDependencyError": ".errors",
    "UnknownRequest": ".errors",
    "create_app": ".http.server",  # needs the optional serve extra
    "generate_batch": ".batch",
    "offline_batching_config": ".batch",
    "warm_up_engine": ".warm_start",
}

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
    "build_engine",
    "create_app",
    "generate_batch",
    "offline_batching_config",
    "warm_up_engine",
]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
