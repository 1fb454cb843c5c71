"""Registration with transformers as soon as transformers' model code is loaded, without importing it first.

``import hf_rocketkv`` must leave ``attn_implementation="rocketkv"`` and the generate() hooks in place, but importing
``transformers.modeling_utils`` (where ``AttentionInterface``, ``PreTrainedModel`` and ``GenerationMixin`` live) costs
seconds: it imports torch, ``torch._dynamo``, ``torch.distributed.tensor``, sympy and Triton. So the package does not
import it; ``register_when_loaded(register)`` runs ``register`` at the first moment it can:

- at once, when ``transformers.modeling_utils`` is already loaded and no hf_rocketkv module is half imported;
- otherwise right after transformers has executed ``modeling_utils`` (a finder on ``sys.meta_path`` wraps that one
  module's loader), while the import still holds the module's lock: no thread can reach ``from_pretrained``,
  ``AttentionInterface`` or ``generate()`` before the registration is done;
- when an hf_rocketkv module is the one importing transformers (``integration/compat.py`` reads ``GenerationMixin``
  at import), the registration, which needs that module whole, waits until no hf_rocketkv module is being
  imported any more: the finder watches the package's own modules until then.

Then the finder leaves ``sys.meta_path``. Standard library only; the loaders it wraps put the original loader back
on the module before executing it, so nothing of the wrapper stays visible.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

TRIGGER = "transformers.modeling_utils"
PACKAGE = __name__.split(".")[0]

_LOCK = threading.RLock()


def _initializing(module) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _package_busy(finished: str | None = None) -> bool:
    """Whether a module of the package (the package itself aside) is being imported right now; ``finished`` has just
    executed (its import is still marked as running until its loader returns)."""
    prefix = PACKAGE + "."
    return any(_initializing(module) for name, module in list(sys.modules.items())
               if name.startswith(prefix) and name != finished)


class _Loader:
    """A module's own loader, plus a call to the finder once the module has executed."""

    def __init__(self, loader, finder: _Finder):
        self._loader = loader
        self._finder = finder

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self._loader  # the module keeps its own loader
        self._loader.exec_module(module)
        self._finder.loaded(module.__name__)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder:
    """On ``sys.meta_path`` until ``callback`` has run: finds nothing itself, it only wraps the loader of the trigger
    module and of the package's modules found by the finders after it."""

    def __init__(self, callback: Callable[[], None]):
        self.callback = callback
        self.done = False
        self._searching = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if self.done or getattr(self._searching, "active", False):
            return None
        if fullname != TRIGGER and not fullname.startswith(PACKAGE + "."):
            return None
        self._searching.active = True
        try:
            spec = None
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._searching.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, self)
        return spec

    def loaded(self, name: str) -> None:
        """Module ``name`` has executed: run the callback if transformers' model code is in and the package whole."""
        with _LOCK:
            if self.done or TRIGGER not in sys.modules or _package_busy(finished=name):
                return
            self.done = True
            _remove(self)
        self.callback()


def _remove(finder: _Finder) -> None:
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def register_when_loaded(callback: Callable[[], None]) -> None:
    """Run ``callback`` (idempotent) once ``transformers.modeling_utils`` is loaded and the package whole: now if it
    already is, else from the import that completes it."""
    with _LOCK:
        if TRIGGER in sys.modules and not _initializing(sys.modules[TRIGGER]) and not _package_busy():
            ready = True
        else:
            ready = False
            sys.meta_path.insert(0, _Finder(callback))
    if ready:
        callback()
