"""The call-binding side of the seam (``compat.py`` re-exports every name here): the cache argument's name on the
installed transformers (``cache`` from 5.24 on, ``past_key_values`` before) and the helpers that read or set it, the
signature-bound wrapper ``compat.install`` puts around transformers' generate() steps (``Call``, ``_wrap``), and the
installers that wrap a modeling function or a module class's ``forward`` once, bound by signature, for the fused
paths (``install_rotary``, ``install_forward``; which functions and classes: ``compat.py``'s tables).

Like ``compat.py`` it imports only transformers, and only names transformers exports: no private transformers name
is spelled here (tests/integration/test_private_names.py).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
from transformers import Cache, GenerationMixin

WRAPPED_MARK = "__hf_rocketkv_wrapped__"
FORWARD_TAG = "__hf_rocketkv_forward_tag__"  # install_forward's tag on its wrapper (forward_tag)


def _unwrapped(function):
    """The original function below our own wrapper (so verification reads transformers' signature)."""
    return getattr(function, "__wrapped__", function) if getattr(function, WRAPPED_MARK, False) else function


LEGACY_CACHE_ARG = "past_key_values"


def _cache_argument_name() -> str:
    """The name transformers gives the cache argument of generate(), the model forwards and their outputs:
    ``cache`` from 5.24 on (``past_key_values`` still accepted there, deprecated), ``past_key_values`` before."""
    try:
        parameters = inspect.signature(_unwrapped(GenerationMixin.prepare_inputs_for_generation)).parameters
    except (TypeError, ValueError):
        return LEGACY_CACHE_ARG
    return "cache" if "cache" in parameters else LEGACY_CACHE_ARG


# Computed once at import: the installed transformers does not change while the process runs.
CACHE_ARG: str = _cache_argument_name()
CACHE_ARGS: tuple[str, ...] = tuple(dict.fromkeys((CACHE_ARG, LEGACY_CACHE_ARG)))  # either may reach the hooks


def cache_from(mapping: dict):
    """The cache in a mapping of generate()/forward arguments or a model output, under either name (None if none)."""
    for name in CACHE_ARGS:
        if mapping.get(name) is not None:
            return mapping[name]
    return None


def with_cache(mapping: dict, cache) -> dict:
    """A copy of ``mapping`` whose cache is ``cache``, under the installed transformers' name (the other removed)."""
    changed = {key: value for key, value in mapping.items() if key not in CACHE_ARGS}
    changed[CACHE_ARG] = cache
    return changed


def cache_kwargs(cache) -> dict:
    """``{name: cache}`` to pass a cache to generate() or a model forward under the installed transformers' name."""
    return {CACHE_ARG: cache}


def output_cache(output):
    """The cache a model output carries (``output.cache`` from transformers 5.24 on, ``past_key_values`` before)."""
    return getattr(output, CACHE_ARG)


class Call:
    """One intercepted call: its arguments by name, and the original function to run them (possibly changed)."""

    def __init__(self, original: Callable, bound: inspect.BoundArguments):
        self.original = original
        self.bound = bound

    @property
    def arguments(self) -> dict:
        return self.bound.arguments

    def with_arguments(self, **changes) -> Call:
        """The same call with some arguments replaced by name (not run yet)."""
        bound = inspect.BoundArguments(self.bound.signature, dict(self.bound.arguments))
        bound.arguments.update(changes)
        return Call(self.original, bound)

    def __call__(self, **changes):
        """Run the original with the same arguments, ``changes`` replacing some of them by name."""
        bound = self.with_arguments(**changes).bound if changes else self.bound
        return self.original(*bound.args, **bound.kwargs)


class GenerateHooks(Protocol):
    """What hf_rocketkv does inside generate(); ``involves_*`` decide whether a call is RocketKV's at all."""

    def involves_model(self, model) -> bool: ...

    def involves_cache(self, cache) -> bool: ...

    def generate(self, call: Call) -> Any: ...

    def prepare_cache(self, call: Call) -> Any: ...

    def prefill(self, call: Call) -> Any: ...

    def prepare_inputs(self, call: Call) -> Any: ...

    def compiled_step(self, compiled: Callable, model, cache, args: tuple, kwargs: dict) -> Any: ...

    def deferred_stop_supported(self, call: Call) -> bool: ...


def _wrap(original: Callable, handle: Callable[[Call, tuple, dict], Any], renames_cache: bool = False) -> Callable:
    """A wrapper that binds its arguments by signature and lets ``handle`` decide; marked so it is never wrapped
    twice. ``handle`` gets the original positional and keyword arguments too, to pass them on untouched.
    ``renames_cache`` (generate()): the cache, passed as ``cache=`` or ``past_key_values=``, reaches the original
    under the installed version's name (``_current_cache_name``)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if renames_cache and (LEGACY_CACHE_ARG in kwargs or "cache" in kwargs):
            kwargs = _current_cache_name(kwargs, args)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return handle(Call(original, bound), args, kwargs)

    setattr(wrapper, WRAPPED_MARK, True)
    return wrapper


def _current_cache_name(kwargs: dict, args: tuple) -> dict:
    """``kwargs`` with the cache under the installed transformers' name, so generate() takes either on every
    supported version: ``past_key_values=`` becomes ``cache=`` from 5.24 on, and ``cache=`` (a ``Cache``) becomes
    ``past_key_values=`` before; unchanged when both are given (transformers reports it). From 5.24 on transformers
    deprecates ``past_key_values``; its own warning would name this module (its decorator points one frame up, at the
    wrapper), so the same warning is issued here for the line that called generate()."""
    if LEGACY_CACHE_ARG in kwargs and "cache" in kwargs:
        return kwargs
    renamed = dict(kwargs)
    if CACHE_ARG == LEGACY_CACHE_ARG:
        if isinstance(kwargs.get("cache"), Cache):
            renamed[LEGACY_CACHE_ARG] = renamed.pop("cache")
        return renamed
    if LEGACY_CACHE_ARG in kwargs:
        owner = type(args[0]).__name__ if args else "GenerationMixin"
        warnings.warn(f"`{LEGACY_CACHE_ARG}` is deprecated and will be removed in version 6.0.0 for "
                      f"`{owner}.generate`. Use `{CACHE_ARG}` instead.", FutureWarning, stacklevel=3)  # the caller
        renamed[CACHE_ARG] = renamed.pop(LEGACY_CACHE_ARG)
    return renamed


# --------------------------------------------------------------------------------------------------- rotary embedding
ROTARY_NAME = "apply_rotary_pos_emb"
ROTARY_PARAMS = ("q", "k", "cos", "sin", "unsqueeze_dim")  # exactly these, in this order (Llama-style models)
MODELING_LOCK = threading.Lock()  # rotary functions, norm, MLP and experts classes


def rotary_modules(model) -> list:
    """The modeling modules (``transformers.models.<name>.modeling_<name>``) of ``model``'s layers whose
    ``apply_rotary_pos_emb`` takes exactly ``ROTARY_PARAMS``; others (partial rotary, other signatures) are left out."""
    found = {}
    for module in model.modules():
        owner = sys.modules.get(type(module).__module__)
        if owner is None or owner.__name__ in found or not owner.__name__.startswith("transformers.models."):
            continue
        try:
            names = tuple(inspect.signature(_rotary_function(getattr(owner, ROTARY_NAME))).parameters)
        except (AttributeError, TypeError, ValueError):
            continue
        if names == ROTARY_PARAMS:
            found[owner.__name__] = owner
    return list(found.values())


def _rotary_function(rotary):
    """The function behind a modeling module's ``apply_rotary_pos_emb``: since transformers 5.25 the name holds a
    module built around it (``use_kernel_forward_from_hub``: the function is its ``forward``, and calling the module
    calls it, or a hub kernel the user registered), before that the function itself."""
    return rotary.forward if isinstance(rotary, torch.nn.Module) else rotary


def install_rotary(owner, active: Callable[[], bool], compute: Callable[[Callable, dict], Any]) -> None:
    """Wrap ``owner.apply_rotary_pos_emb`` once (idempotent, thread-safe). The wrapper calls the original with exactly
    the arguments it received unless ``active()`` (checked first: one ContextVar read) says the call is RocketKV's
    and torch.compile is not tracing it; then ``compute(original, arguments)`` decides, arguments bound by name."""
    with MODELING_LOCK:
        original = getattr(owner, ROTARY_NAME)
        if getattr(original, WRAPPED_MARK, False):
            return
        function = _rotary_function(original)
        signature = inspect.signature(function)
        default_dim = signature.parameters[ROTARY_PARAMS[-1]].default

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if torch.compiler.is_compiling() or not active():
                return original(*args, **kwargs)
            if len(args) == 4 and not kwargs:  # the modeling code's call: (q, k, cos, sin), ROTARY_PARAMS' order
                return compute(original, dict(zip(ROTARY_PARAMS, (*args, default_dim))))
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return compute(original, bound.arguments)

        setattr(wrapper, "__signature__", signature)  # the function's own (a 5.25 module's forward reads as a method)
        setattr(wrapper, WRAPPED_MARK, True)
        setattr(owner, ROTARY_NAME, wrapper)


# --------------------------------------------------------------------------------------------------- module forwards
class ArgumentBinder:
    """``signature.bind(*args, **kwargs)`` with the defaults applied, as the tuple of the bound values in parameter
    order (a ``**kwargs`` parameter's dict last), from a table read off the signature once: a decoder layer calls its
    attention and the layer itself is called with keywords at every step, and this binds them in a few dictionary
    reads where ``inspect`` walks the general rules (an eager decode step binds twice per layer). A call the table
    does not cover exactly (more positional values than positional parameters, a name given twice, a required
    argument missing, an unknown keyword without ``**kwargs``; a signature with ``*args`` or positional-only
    parameters) goes through ``signature.bind``, which raises the TypeError Python would."""

    def __init__(self, signature: inspect.Signature):
        kinds = inspect.Parameter
        parameters = list(signature.parameters.values())
        self.signature = signature
        self.table = all(p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY, kinds.VAR_KEYWORD)
                         for p in parameters)
        self.positional = sum(p.kind is kinds.POSITIONAL_OR_KEYWORD for p in parameters)
        self.named = tuple((p.name, p.default) for p in parameters if p.kind is not kinds.VAR_KEYWORD)
        self.var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in parameters)

    def values(self, args: tuple, kwargs: dict) -> tuple:
        """The bound values of a call with ``args`` and ``kwargs``, in parameter order."""
        if self.table and len(args) <= self.positional and not any(name in kwargs for name, _ in
                                                                   self.named[:len(args)]):
            values, rest = list(args), dict(kwargs)
            for name, default in self.named[len(args):]:
                if name in rest:
                    values.append(rest.pop(name))
                elif default is inspect.Parameter.empty:
                    break  # a required argument is missing: bind says so
                else:
                    values.append(default)
            else:
                if self.var_keyword:
                    return (*values, rest)
                if not rest:
                    return tuple(values)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())


def code_key(function):
    code = getattr(_unwrapped(function), "__code__", None)
    return None if code is None else (code.co_code, code.co_consts, code.co_names, code.co_varnames)


def install_forward(owner: type, active: Callable[[], bool], compute: Callable[..., Any], tag: str | None = None
                    ) -> None:
    """Wrap ``owner.forward`` once (thread-safe; a norm, MLP or experts class): the original with its arguments
    untouched unless ``active()`` and torch.compile is not tracing; then ``compute(run_original, self, *arguments)``
    decides, the arguments bound by the original's signature (defaults applied). ``tag`` (a norm's formula) is what
    ``forward_tag`` reads back from the module."""
    with MODELING_LOCK:
        if getattr(original := owner.__dict__["forward"], WRAPPED_MARK, False):
            return
        binder = ArgumentBinder(inspect.signature(original))
        arity = len(binder.signature.parameters)

        @functools.wraps(original)
        def forward(self, *args, **kwargs):
            if torch.compiler.is_compiling() or not active():
                return original(self, *args, **kwargs)
            values = args
            if kwargs or len(args) + 1 != arity:  # not the modeling code's positional call
                values = binder.values((self, *args), kwargs)[1:]
            return compute(lambda: original(self, *args, **kwargs), self, *values)

        setattr(forward, WRAPPED_MARK, True)
        setattr(forward, FORWARD_TAG, tag)
        owner.forward = forward


def forward_tag(module) -> str | None:
    """The ``tag`` ``install_forward`` wrapped the forward that ``module`` runs with (None: not wrapped, or a
    subclass's own forward)."""
    return getattr(type(module).forward, FORWARD_TAG, None)


__all__ = ["ArgumentBinder", "CACHE_ARG", "CACHE_ARGS", "LEGACY_CACHE_ARG", "MODELING_LOCK", "ROTARY_NAME",
           "ROTARY_PARAMS", "WRAPPED_MARK", "Call", "GenerateHooks", "cache_from", "cache_kwargs", "code_key",
           "forward_tag", "install_forward", "install_rotary", "output_cache", "rotary_modules", "with_cache"]
