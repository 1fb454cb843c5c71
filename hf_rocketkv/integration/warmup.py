"""Warm starts: compile once, save the artifacts, start the next process with them.

The first generate() of a process compiles: Triton JITs hf_rocketkv's kernels for the shapes it meets, and
torch.compile (``compile_regions`` or ``decode_runner="torch_compile"``) builds inductor graphs. Both can be kept:

    # once, on the machine type you deploy to (same torch, Triton and GPU)
    hf-rocketkv warmup --config default --cache-dir ~/.cache/hf_rocketkv/compile --batch 1 4 --context 4096
    # every process, before loading the model
    hf_rocketkv.use_compile_cache("~/.cache/hf_rocketkv/compile")

``use_compile_cache`` points Triton's and inductor's on-disk caches at the folder (environment variables, read when
they first compile: so call it at start-up, before the first generate()) and loads torch's mega-cache
(``torch.compiler.load_cache_artifacts``) written by ``warmup``. These are start-up settings of the process, never
touched on a request path. ``warmup`` runs generate(); the batching engine's kernels (``generate_batch``,
``hf-rocketkv serve``) are warmed by ``hf_rocketkv.warm_up_engine`` (serving/warm_start.py; ``hf-rocketkv warmup
--engine``) into the same folder.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from . import compat

ARTIFACTS_FILE = "torch_compile_artifacts.bin"


def use_compile_cache(cache_dir: str | os.PathLike) -> dict:
    """Use ``cache_dir`` for Triton's and inductor's caches and load the saved torch.compile artifacts, if any.

    Returns what was found: ``{"cache_dir", "artifacts_loaded"}``. Call before the first compile of the process.
    """
    folder = Path(cache_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    artifacts = folder / ARTIFACTS_FILE
    loaded = False
    if artifacts.is_file():
        loaded = torch.compiler.load_cache_artifacts(artifacts.read_bytes()) is not None
    return {"cache_dir": str(folder), "artifacts_loaded": loaded}


def warmup(model, config=None, *, cache_dir: str | os.PathLike, batch_sizes=(1,), prompt_tokens: int = 4096,
           new_tokens: int = 8, regions: bool = False) -> dict:
    """Run one short generate() per batch size (JIT every kernel, capture or compile decode), then save the
    artifacts into ``cache_dir``. ``use_compile_cache(cache_dir)`` must have been called before anything compiled
    in this process (``hf-rocketkv warmup`` does it). Returns timings per batch size and the artifact size."""
    from ..cache.cache import RocketKVCache
    from .generate import get_config
    from .regions import compile_regions

    batch_sizes = _checked_warmup_args(model, batch_sizes, prompt_tokens, new_tokens)
    if regions:
        compile_regions(model)
    config = config if config is not None else get_config(model)
    device = next(model.parameters()).device
    timings = []
    for batch in batch_sizes:
        ids = torch.randint(3, model.config.vocab_size, (batch, prompt_tokens), device=device,
                            generator=torch.Generator(device=device).manual_seed(batch))
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), **compat.cache_kwargs(RocketKVCache(config)),
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append({"batch": batch, "seconds": time.perf_counter() - start})
    Path(cache_dir).expanduser().mkdir(parents=True, exist_ok=True)  # also when use_compile_cache was not called
    saved = torch.compiler.save_cache_artifacts()
    size = 0
    if saved is not None:
        blob, _ = saved
        (Path(cache_dir).expanduser() / ARTIFACTS_FILE).write_bytes(blob)
        size = len(blob)
    return {"timings": timings, "artifact_bytes": size, "cache_dir": str(Path(cache_dir).expanduser())}


def _checked_warmup_args(model, batch_sizes, prompt_tokens, new_tokens) -> tuple[int, ...]:
    """The batch sizes as a tuple; a clear ValueError naming the argument for anything that cannot run."""
    if isinstance(batch_sizes, int) and not isinstance(batch_sizes, bool):
        batch_sizes = (batch_sizes,)
    try:
        sizes = tuple(batch_sizes)
    except TypeError:
        raise ValueError(f"warmup: batch_sizes must be an integer or a sequence of integers >= 1, got "
                         f"{batch_sizes!r}") from None
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise ValueError(f"warmup: batch_sizes must be integers >= 1, got {batch_sizes!r}")
    for name, value in (("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"warmup: {name} must be an integer >= 1, got {value!r}")
    limit = positions_exceeded(model, prompt_tokens + new_tokens)
    if limit is not None:
        raise ValueError(f"warmup: prompt_tokens ({prompt_tokens}) + new_tokens ({new_tokens}) exceeds the model's "
                         f"max_position_embeddings ({limit})")
    return sizes


def positions_exceeded(model, tokens: int) -> int | None:
    """The model's ``max_position_embeddings`` when ``tokens`` positions exceed it, else None (also the CLI's check,
    which names its own flags)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return limit if limit is not None and tokens > limit else None
