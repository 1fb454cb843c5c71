"""Every private torch and Triton name hf_rocketkv relies on, in one table: the symbol, where it is used, and why.

transformers' private names sit behind one module (``compat.py``, whose docstring lists them). torch's and Triton's
cannot: a kernel launcher needs its launch internals where it launches, and the cache marks its buffers where it
owns them. So each use stays where it is needed and ``TORCH_AND_TRITON`` lists them all, so that a torch or Triton
upgrade is checked against one list. Where torch has a public spelling it is used instead (``torch.compiler.reset``,
``torch.compiler.is_compiling``, ``torch.library.triton_op`` / ``wrap_triton``).

tests/integration/test_private_names.py reads the package's source: every ``torch._x`` / ``triton._x`` name it spells (an
attribute chain or an import) must have a row here naming its file, and every row must still be used where it says.
``attribute`` rows are attributes of objects (looked up by their last name, as an attribute or a ``getattr``
string), not importable paths. Nothing imports this module; it is data for that test and for readers.

``where`` holds package paths relative to ``hf_rocketkv/``: a file, or a folder ending in ``/`` (any file in it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrivateName:
    """One private torch or Triton name: the symbol as the code reaches it, the files using it, and why."""

    symbol: str
    where: tuple[str, ...]
    why: str
    attribute: bool = False  # an attribute of an object (checked by its last name), not an importable path


TORCH_AND_TRITON: tuple[PrivateName, ...] = (
    PrivateName(
        "torch._library.triton.set_wrap_triton_enabled",
        ("kernels/triton_ops.py", "kernels/launch.py"),
        "eager calls of a triton_op launch their kernels directly instead of through wrap_triton's traceable "
        "wrapper (what triton_op's own eager path does); optional: without it the registered op is called",
    ),
    PrivateName(
        "torch.ops.aten._scaled_dot_product_cudnn_attention",
        ("integration/causal_prefill.py",),
        "cuDNN's attention with each row's log-sum-exp, which F.scaled_dot_product_attention does not return: a "
        "prefill chunk's two parts are merged by it; optional: without it the chunk runs flash's lower-right mode",
        attribute=True,
    ),
    PrivateName(
        "torch.ops.aten._flash_attention_forward",
        ("integration/window_prefill.py",),
        "flash attention with a window (window_size_left / window_size_right), which F.scaled_dot_product_attention "
        "does not take: a sliding layer's prefill in one call where its mask is the window's band, each row's "
        "log-sum-exp for the sinks; optional: without it the layer runs under transformers' mask",
        attribute=True,
    ),
    PrivateName(
        "torch._library.triton.is_wrap_triton_enabled",
        ("kernels/launch.py",),
        "TritonLaunch takes the traceable wrap_triton path exactly when torch would (compile, make_fx); optional: "
        "without it every launch takes that path",
    ),
    PrivateName(
        "torch._dynamo.mark_static_address",
        ("cache/",),
        "a layer's buffers keep their addresses across compiled decode steps, so torch.compile's CUDA graphs read "
        "them in place instead of copying them in (no public spelling)",
    ),
    PrivateName(
        "torch._dynamo.utils.counters",
        ("bench/workload.py",),
        "the workload benchmark counts the graphs torch.compile built (recompilations after warm-up)",
    ),
    PrivateName(
        "torch.nn.Module._compiled_call_impl",
        ("integration/regions.py",),
        "compile_regions leaves a module that nn.Module.compile already compiled (idempotent)",
        attribute=True,
    ),
    PrivateName(
        "torch.nn.Module._forward_hooks",
        ("integration/mlp.py",),
        "the fused gated MLP reads the projections' weights and computes the activation itself, so it steps aside "
        "when those modules have forward hooks it would skip (no public way to ask whether a module has hooks)",
        attribute=True,
    ),
    PrivateName(
        "torch.nn.Module._forward_pre_hooks",
        ("integration/mlp.py",),
        "as ``_forward_hooks``: forward pre-hooks on a projection or the activation keep transformers' module",
        attribute=True,
    ),
    PrivateName(
        "triton.runtime.jit.JITFunction.device_caches",
        ("kernels/launch.py",),
        "TritonLaunch calls Triton's own per-device binder to key its table of compiled kernels (checked when the "
        "launcher is made; without it every launch takes kernel[grid](...))",
        attribute=True,
    ),
    PrivateName(
        "triton.compiler.CompiledKernel.packed_metadata",
        ("kernels/launch.py",),
        "TritonLaunch's fast path launches the compiled kernel as JITFunction.run does (with launch_metadata, run "
        "and function)",
        attribute=True,
    ),
)
