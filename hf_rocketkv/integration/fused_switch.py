"""FusedSwitch: a transformers function that RocketKV's decode steps replace by a fused kernel, switched per call.

The fused RoPE (``rope.py``) and the fused RMSNorm (``norm.py``) work the same way: ``compat`` wraps the transformers
function (a modeling module's ``apply_rotary_pos_emb``, a norm class's ``forward``) once, and the wrapper takes the
fused path only while this switch is on. ``switch.enabled(model, on)`` turns it on for the duration of a RocketKV
call through a ContextVar, so per thread and per asyncio task, never process-wide; every other call runs
transformers' own function.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable


class FusedSwitch:
    """``owners(model)``: what to wrap in ``model`` (modeling modules, norm classes); ``install(owner, active,
    compute)``: compat's wrapper installer; ``compute``: the wrapper's choice between the kernel and the original."""

    def __init__(self, name: str, installed_attribute: str, owners: Callable[[Any], list],
                 install: Callable[[Any, Callable[[], bool], Callable], None], compute: Callable):
        self._active: contextvars.ContextVar[bool] = contextvars.ContextVar(name, default=False)
        self._installed_attribute = installed_attribute
        self._owners, self._install, self._compute = owners, install, compute

    def install_for(self, model) -> None:
        """Wrap every owner ``model`` is made of (idempotent)."""
        if getattr(model, self._installed_attribute, False):
            return
        for owner in self._owners(model):
            self._install(owner, self._active.get, self._compute)
        object.__setattr__(model, self._installed_attribute, True)  # a plain attribute, not a submodule or buffer

    @contextlib.contextmanager
    def enabled(self, model, on: bool):
        """Within the block, this thread's (task's) decode steps of ``model`` take the fused path (when ``on``)."""
        if not on:
            yield
            return
        self.install_for(model)
        token = self._active.set(True)
        try:
            yield
        finally:
            self._active.reset(token)

    def active(self) -> bool:
        return self._active.get()


@contextlib.contextmanager
def all_enabled(switches: tuple[FusedSwitch, ...], model, on: bool):
    """Within the block, every switch of ``switches`` is on for ``model`` (when ``on``): the forms of one fused path
    (a norm formula, an attention or decoder-layer form) switched together."""
    with contextlib.ExitStack() as stack:
        for switch in switches:
            stack.enter_context(switch.enabled(model, on))
        yield
