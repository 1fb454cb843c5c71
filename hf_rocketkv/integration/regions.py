"""``compile_regions(model)``: torch.compile the cache-free repeated modules (RMSNorm, MLP) of a model, in place.

The CUDA-graph decode runner (decode_graphs.py) replays the eager kernels of a step: every GEMM, but also every small
elementwise op of the norms, the SiLU-gated MLP and the residuals, unfused. Compiling the modules that never touch the
cache fuses those: one compiled graph per module class and input shape, shared by all layers (their parameters are
graph inputs), so the compile takes seconds, not the minutes of a whole-model compile. Attention and the cache stay
eager, so nothing depends on the prompt length. An explicit call, because it changes the model for every later use.

    hf_rocketkv.compile_regions(model)       # then generate() as usual; its decode graphs capture the fused kernels
"""

from __future__ import annotations

import torch

REGION_SUFFIXES = ("RMSNorm", "MLP")


def region_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules compile_regions compiles: those whose class name ends with RMSNorm or MLP."""
    return [module for module in model.modules() if type(module).__name__.endswith(REGION_SUFFIXES)]


def compile_regions(model: torch.nn.Module, **compile_kwargs) -> torch.nn.Module:
    """Compile every RMSNorm and MLP submodule in place (``nn.Module.compile``); returns the model.

    ``compile_kwargs`` go to torch.compile (default ``mode="default"``: no CUDA graphs of inductor's own; the decode
    runner captures the whole step). Idempotent.
    """
    compile_kwargs.setdefault("mode", "default")
    modules = region_modules(model)
    if not modules:
        raise ValueError(
            f"compile_regions found no RMSNorm or MLP submodules in {type(model).__name__}: nothing to compile"
        )
    for module in modules:
        if getattr(module, "_compiled_call_impl", None) is None:
            module.compile(**compile_kwargs)
    return model
