"""Recording a kernel's calls in a test: the kernel still runs, each call's first argument's shape is kept."""

from __future__ import annotations


def record_calls(monkeypatch, module, name: str) -> list[tuple[int, ...]]:
    """Replace ``module.name`` (a kernel entry point whose first argument is a tensor) for the test's duration by a
    wrapper that appends that tensor's shape to the returned list and calls the kernel."""
    calls: list[tuple[int, ...]] = []
    kernel = getattr(module, name)

    def recording(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return kernel(x, *args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return calls
