"""``kernels/launch.TritonLaunch``: eager launches reuse the kernel Triton itself chose, with the same arguments.

CPU: the fast path's logic against a stand-in JITFunction (Triton's binder, cache and launcher replaced by recording
fakes): the first launch of a specialization goes through ``kernel[grid]``, later ones call the stored compiled
kernel's ``run`` with the canonical grid, the current stream and every bound argument in signature order; a new
specialization, a pre-run hook or tracing (wrap_triton enabled) take Triton's own path. GPU: a real kernel over
aligned and misaligned tensors and integers equal to 1, divisible by 16, odd and 64-bit: the output equals Triton's
own launch and the stored kernel ``is`` the one ``kernel[grid](...)`` returns for those arguments.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from torch._library.triton import set_wrap_triton_enabled  # noqa: E402

from hf_rocketkv.kernels import launch as launch_mod  # noqa: E402
from hf_rocketkv.kernels.launch import TritonLaunch  # noqa: E402


# ------------------------------------------------------------------------------------- CPU: logic with stand-ins
class FakeCompiled:
    def __init__(self, name):
        self.name, self.function, self.packed_metadata, self.calls = name, f"fn-{name}", f"meta-{name}", []

    def launch_metadata(self, grid, stream, *args):
        return ("launch-metadata", tuple(grid), stream)

    def run(self, *args):
        self.calls.append(args)


class FakeKernel:
    """A JITFunction stand-in: binder specializes ints like Triton (1 / divisible by 16 / other), a 'tensor' is a
    (dtype, address) tuple specialized on 16-byte alignment; ``kernel[grid](...)`` is Triton's own path."""

    def __init__(self):
        self.pre_run_hooks, self.used_global_vals, self.slow, self.compiled = [], {}, [], {}
        self.device_caches = {0: (None, None, None, None, self._binder)}

    @staticmethod
    def _spec(value):
        if isinstance(value, tuple):
            return ("*" + value[0], "D" if value[1] % 16 == 0 else None)
        return ("constexpr", 1) if value == 1 else ("i32", "D" if value % 16 == 0 else None)

    def _binder(self, x, n, BLOCK=64, **options):
        params = {"x": x, "n": n, "BLOCK": BLOCK}
        return params, [self._spec(x), self._spec(n), ("constexpr", BLOCK)], options

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            params, spec, options = self._binder(*args, **kwargs)
            key = (tuple(spec), tuple(options.items()))
            self.slow.append((grid, params))
            return self.compiled.setdefault(key, FakeCompiled(len(self.compiled)))
        return run


class FakeDriver:
    class active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 1234


class FakeKnobs:
    class runtime:
        debug = False
        launch_enter_hook = "enter-hook"
        launch_exit_hook = "exit-hook"
        add_stages_inspection_hook = None


@pytest.fixture
def fake_triton(monkeypatch):
    monkeypatch.setattr(launch_mod, "_driver", FakeDriver)
    monkeypatch.setattr(launch_mod, "_knobs", FakeKnobs)
    kernel = FakeKernel()
    with set_wrap_triton_enabled(False):
        yield kernel, TritonLaunch(kernel)


def test_first_launch_goes_through_triton_then_the_compiled_kernel_runs_directly(fake_triton):
    kernel, launcher = fake_triton
    first = launcher[(3,)](("bf16", 4096), 100, num_warps=4)
    assert len(kernel.slow) == 1 and first.calls == []
    again = launcher[(5, 2)](("bf16", 8192), 36, num_warps=4)  # same specialization: aligned, int not /16
    assert again is first and len(kernel.slow) == 1
    assert first.calls == [(5, 2, 1, 1234, "fn-0", "meta-0", ("launch-metadata", (5, 2), 1234), "enter-hook",
                            "exit-hook", ("bf16", 8192), 36, 64)]
    assert launcher.compiled_for(("bf16", 16), 7, num_warps=4) is first


@pytest.mark.parametrize("variant", [
    ((("bf16", 4098), 100), {"num_warps": 4}),  # misaligned tensor
    ((("fp16", 4096), 100), {"num_warps": 4}),  # another dtype
    ((("bf16", 4096), 1), {"num_warps": 4}),  # an int equal to 1
    ((("bf16", 4096), 96), {"num_warps": 4}),  # an int divisible by 16
    ((("bf16", 4096), 100), {"num_warps": 8}),  # another launch option
    ((("bf16", 4096), 100), {"num_warps": 4, "BLOCK": 128}),  # another constexpr
])
def test_a_new_specialization_takes_triton_path_and_gets_its_own_kernel(fake_triton, variant):
    kernel, launcher = fake_triton
    base = launcher[(1,)](("bf16", 4096), 100, num_warps=4)
    args, kwargs = variant
    other = launcher[(1,)](*args, **kwargs)
    assert len(kernel.slow) == 2 and other is not base and base.calls == [] and other.calls == []
    assert launcher[(2,)](*args, **kwargs) is other and len(other.calls) == 1 and len(kernel.slow) == 2


def test_pre_run_hooks_and_stage_inspection_take_triton_path(fake_triton, monkeypatch):
    kernel, launcher = fake_triton
    compiled = launcher[(1,)](("bf16", 0), 100)
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    launcher[(1,)](("bf16", 0), 100)
    kernel.pre_run_hooks.clear()
    monkeypatch.setattr(FakeKnobs.runtime, "add_stages_inspection_hook", lambda: ("k", "h"))
    launcher[(1,)](("bf16", 0), 100)
    assert len(kernel.slow) == 3 and compiled.calls == []


def test_a_changed_global_goes_back_to_triton_which_reports_it(fake_triton):
    kernel, launcher = fake_triton
    compiled = launcher[(1,)](("bf16", 0), 100)
    scope = {"CONST": 1}
    kernel.used_global_vals = {("CONST", 0): (2, scope)}
    launcher[(1,)](("bf16", 0), 100)
    assert len(kernel.slow) == 2 and compiled.calls == []


def test_tracing_uses_wrap_triton(monkeypatch):
    seen = []
    monkeypatch.setattr(launch_mod, "wrap_triton", lambda k: seen.append(k) or {(1,): "traceable"})
    kernel = FakeKernel()
    with set_wrap_triton_enabled(True):
        assert TritonLaunch(kernel)[(1,)] == "traceable"
    assert seen == [kernel]


def test_a_kernel_without_triton_internals_launches_through_triton():
    class Interpreted:  # what @triton.jit returns under TRITON_INTERPRET=1: no device_caches
        def __getitem__(self, grid):
            return lambda *args: ("interpreted", grid, args)

    with set_wrap_triton_enabled(False):
        assert TritonLaunch(Interpreted())[(2,)](1, 2) == ("interpreted", (2,), (1, 2))


# ------------------------------------------------------------------------------------------- GPU: a real kernel
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="the fast path runs on a GPU (the CPU interprets)")


def gpu(test):
    """A GPU-only test: marked ``gpu`` (pytest -m gpu) and skipped without CUDA."""
    return pytest.mark.gpu(requires_cuda(test))


if torch.cuda.is_available():
    import triton.language as tl

    @triton.jit
    def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, extra, alpha, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + i, mask=i < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, (alpha * x + y + (extra % 7)).to(out_ptr.dtype.element_ty), mask=i < n)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fast_launch_matches_triton_over_specializations(dtype):
    launcher = TritonLaunch(_axpy_kernel)
    base = torch.randn(4096 + 64, device="cuda", dtype=torch.float32).to(dtype)
    cases = []
    for offset in (0, 1, 8):  # 1 element: misaligned for both dtypes; 8: aligned for bf16 only (16 bytes)
        for n in (1, 16, 17, 1000, 4096):
            for extra in (1, 16, 33, 2**40 + 3):  # constexpr 1, divisible by 16, odd, 64-bit
                cases.append((offset, n, extra))
    for offset, n, extra in cases:
        x = base[offset:offset + n]
        y = base[offset + 1:offset + 1 + n]
        grid = (triton.cdiv(n, 128),)
        expected = torch.empty_like(x)
        theirs = _axpy_kernel[grid](x, y, expected, n, extra, 0.5, BLOCK=128)
        for _ in range(2):  # the first launch stores Triton's kernel, the second reuses it
            out = torch.full_like(x, float("nan"))
            with set_wrap_triton_enabled(False):
                launcher[grid](x, y, out, n, extra, 0.5, BLOCK=128)
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert launcher.compiled_for(x, y, out, n, extra, 0.5, BLOCK=128) is theirs, (offset, n, extra)
    assert len({id(k) for k in launcher._compiled.values()}) == len(launcher._compiled) >= 4


@gpu
def test_gpu_hit_does_not_call_triton_run():
    launcher = TritonLaunch(_axpy_kernel)
    x = torch.randn(256, device="cuda")
    out = torch.empty_like(x)
    with set_wrap_triton_enabled(False):
        launcher[(2,)](x, x, out, 256, 3, 2.0, BLOCK=128)

        def refuse(*args, **kwargs):
            raise AssertionError("JITFunction.run called on a stored specialization")

        _axpy_kernel.run = refuse
        try:
            out.zero_()
            launcher[(2,)](x, x, out, 256, 3, 2.0, BLOCK=128)
        finally:
            del _axpy_kernel.run
    torch.testing.assert_close(out, 3 * x + 3)
