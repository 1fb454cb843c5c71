"""``TritonLaunch``: how every RocketKV kernel is launched. Under torch.compile / make_fx it is ``wrap_triton``'s
traceable wrapper (unchanged); in eager mode on a GPU it reuses the compiled kernel that Triton itself chose for the
same argument specialization, skipping the rest of Triton's per-launch Python.

Why: an eager decode step launches 6 kernels per layer, and Triton's ``JITFunction.run`` costs ~37 us of host time
per launch with ~28 arguments on an H200 (``benchmarks/probes/launch_overhead.py``, 2026-11-26) against ~11 us for the
compiled kernel's own ``run``: at batch 1 the eager step is bound by the host, so that difference is ~5 ms per token
of a 32-layer model.

What is reused and what is not replicated: Triton's per-device ``binder`` (the generated function that binds the
arguments, applies defaults and computes each argument's specialization: dtype, 16-byte alignment, integer equal to
1 / divisible by 16 / width) runs on every launch exactly as in ``JITFunction.run``; only its result is looked up
in this object's own table instead of Triton's (whose key also stringifies the options on every call). A miss
launches through ``kernel[grid](...)``, Triton's normal path, which compiles if needed and returns the kernel it
launched; that kernel is stored under the specialization. So the fast path launches exactly the kernel Triton would
have launched for those arguments, with the same argument values, grid and launch hooks
(``tests/kernels/test_launch.py`` checks both on CPU with a stand-in kernel, and on a GPU that the kernel picked
``is`` Triton's over aligned and misaligned tensors, integers equal to 1, divisible by 16, odd and 64-bit).

Falls back to ``kernel[grid](...)`` on every call where the fast path cannot be exact: under Triton's interpreter
(CPU tests), with pre-run hooks on the kernel, a stage-inspection hook, or a Triton whose ``JITFunction`` lacks the
internals used here (``device_caches`` with a binder; checked when the object is made). Triton's debug knob is
part of the key. The table holds compiled kernels only (immutable, like Triton's own cache), filled at most once per
specialization; concurrent misses both go through Triton's own (thread-safe) path and store the same kernel.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from torch.library import wrap_triton

try:
    from torch._library.triton import is_wrap_triton_enabled
except ImportError:  # pragma: no cover - an older torch: always take wrap_triton's path
    def is_wrap_triton_enabled() -> bool:
        return True

try:  # what a triton_op's eager implementation uses to launch kernels directly (``direct_launches``)
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - an older torch: the launch goes through wrap_triton
    set_wrap_triton_enabled = None

try:
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
except ImportError:  # pragma: no cover - a Triton without knobs: the fast path stays off
    _knobs = _driver = None


class TritonLaunch:
    """``TritonLaunch(kernel)[grid](*args, **kwargs)``: a drop-in for ``wrap_triton(kernel)[grid](...)``.

    ``kernel`` is a ``@triton.jit`` function. One object per kernel, made at import next to it."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, Any] = {}
        # a JITFunction with the internals used here (an InterpretedFunction under TRITON_INTERPRET=1 has none)
        self._usable = (_knobs is not None and hasattr(kernel, "device_caches") and hasattr(kernel, "pre_run_hooks")
                        and hasattr(kernel, "used_global_vals"))

    def __getitem__(self, grid) -> Callable[..., Any]:
        if is_wrap_triton_enabled():  # torch.compile / make_fx tracing, or a plain call outside our ops
            return wrap_triton(self.kernel)[grid]
        if not self._usable:
            return self.kernel[grid]
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args: tuple, kwargs: dict) -> Any:
        kernel = self.kernel
        if kernel.pre_run_hooks or getattr(_knobs.runtime, "add_stages_inspection_hook", None) is not None:
            return kernel[grid](*args, **kwargs)
        device = _driver.active.get_current_device()
        bound_args, key = self._bind(device, args, kwargs)
        try:
            compiled = self._compiled.get(key)
        except TypeError:  # an unhashable specialization (not made by our kernels): Triton's path
            return kernel[grid](*args, **kwargs)
        if compiled is None:
            compiled = kernel[grid](*args, **kwargs)  # Triton's own path: compiles if needed, launches
            if compiled is not None and not hasattr(compiled, "result"):
                self._compiled[key] = compiled
            return compiled
        for (name, _), (value, globals_dict) in kernel.used_global_vals.items():
            if globals_dict.get(name, _MISSING) != value:  # as JITFunction.run: let Triton raise its error
                return kernel[grid](*args, **kwargs)
        if callable(grid):
            grid = grid(bound_args)
        size = len(grid)
        grid_1 = grid[1] if size > 1 else 1
        grid_2 = grid[2] if size > 2 else 1
        stream = _driver.active.get_current_stream(device)
        values = bound_args.values()
        runtime = _knobs.runtime
        metadata = compiled.launch_metadata(grid, stream, *values)
        compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, metadata,
                     runtime.launch_enter_hook, runtime.launch_exit_hook, *values)
        return compiled

    def compiled_for(self, *args, **kwargs) -> Any:
        """The compiled kernel an eager launch with these arguments on the current device reuses, or None before
        the first such launch (tests compare it with what ``kernel[grid](...)`` returns)."""
        device = _driver.active.get_current_device()
        return self._compiled.get(self._bind(device, args, kwargs)[1])

    def _bind(self, device: int, args: tuple, kwargs: dict) -> tuple[dict, tuple]:
        """Triton's binder for ``device`` (the arguments by name, defaults applied; each argument's specialization;
        the launch options) and the table key made of its result."""
        bound_args, specialization, options = self.kernel.device_caches[device][4](*args, **kwargs)
        return bound_args, (device, _knobs.runtime.debug, tuple(specialization), tuple(options.items()))


_MISSING = object()


def direct_launches():
    """Within the block, ``TritonLaunch`` launches eagerly without torch's ``wrap_triton`` higher-order op (~300 us
    of host time per call on an H200, measured), which is what a registered triton_op's own eager implementation
    does. For launchers only ever called eagerly (the fused RoPE and RMSNorm, the prefill attention merge: their
    callers leave traced calls to transformers' code)."""
    return contextlib.nullcontext() if set_wrap_triton_enabled is None else set_wrap_triton_enabled(False)
