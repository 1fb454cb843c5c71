"""The compat module (hf_rocketkv/integration/compat.py): the only place that touches private transformers names.

- every private symbol is listed, exists in the installed transformers and has the parameters we bind by name;
- a changed signature becomes one clear error naming the transformers version and the symbol, at first use;
- the wrappers act only on RocketKV calls: an sdpa model with DynamicCache/StaticCache gives exactly the tokens of a
  process that never imported hf_rocketkv, and the compiled static-cache forward accepts the same calls;
- import direction: cache/ never imports integration/, nothing outside compat.py imports a private transformers
  module, kernels/ has no import cycle, selection/ and kernels/ are pure tensor code.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from transformers import CompileConfig, DynamicCache, GenerationMixin, PreTrainedModel, StaticCache

import hf_rocketkv
from hf_rocketkv.integration import compat
from tests.support.tiny_models import make_models, random_ids

PACKAGE = Path(hf_rocketkv.__file__).parent
ROOT = PACKAGE.parent


# ------------------------------------------------------------------------------------------------ the symbol table
def test_cache_argument_name_is_the_models_own():
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (generate, forwards, outputs); compat follows the
    installed version. Oracle: the parameters of a model's forward, read here independently."""
    import inspect

    from transformers import LlamaForCausalLM

    forward = inspect.signature(LlamaForCausalLM.forward).parameters
    expected = "cache" if "cache" in forward else "past_key_values"
    assert compat.CACHE_ARG == expected and expected in forward
    assert compat.CACHE_ARGS[0] == expected and "past_key_values" in compat.CACHE_ARGS
    assert compat.cache_kwargs(7) == {expected: 7}
    assert compat.cache_from({"past_key_values": 1}) == 1 and compat.cache_from({expected: 2}) == 2
    assert compat.cache_from({"attention_mask": 3}) is None
    assert compat.with_cache({"past_key_values": 1, "attention_mask": 3}, 5) == {expected: 5, "attention_mask": 3}


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_generate_takes_the_cache_under_either_name(name, recwarn):
    """``cache=`` and ``past_key_values=`` both reach RocketKV on every supported version (the generate() wrapper
    passes the cache under the installed name: ``cache`` from 5.24 on, where ``past_key_values`` is deprecated;
    ``past_key_values`` before); the tokens equal a run without a cache argument (a fresh cache per call), and
    hf_rocketkv's own forwards never use the deprecated name."""
    rocket, _ = make_models("llama")
    ids = random_ids(2, 40)
    config = hf_rocketkv.RocketKVConfig(prompt_budget=16, topk=2, page_size=4, window_size=4, kernel_size=3)
    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids), disable_compile=True)
    hf_rocketkv.set_config(rocket, config)
    cache = hf_rocketkv.RocketKVCache(config)
    with torch.no_grad():
        named = rocket.generate(ids, **{name: cache}, **kwargs)
        default = rocket.generate(ids, **kwargs)
    assert cache.get_seq_length() == 40 + 5  # this very cache served the call
    assert torch.equal(named, default)
    deprecated = [w for w in recwarn if "past_key_values" in str(w.message)]
    if name != "past_key_values" or compat.CACHE_ARG == "past_key_values":
        assert not deprecated, deprecated  # nothing inside hf_rocketkv uses the old name
    else:  # the caller's own deprecated generate() argument, and nothing else (no forward inside), told at its line
        assert deprecated and all(".generate" in str(w.message) for w in deprecated), deprecated
        assert {w.filename for w in deprecated} == {__file__}
    inside = [(w.filename, str(w.message)) for w in recwarn if w.filename.startswith(str(PACKAGE))]
    assert not inside, inside  # no warning comes from inside the package


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_other_models_get_the_cache_under_either_name_without_a_warning_from_the_package(name, recwarn):
    """An sdpa model with a DynamicCache passes through the same generate() wrapper: it takes the cache under either
    name too, and transformers' deprecation of ``past_key_values`` (5.24 on) names the caller's line, as it does
    without hf_rocketkv, not the wrapper's."""
    _, sdpa = make_models("llama")
    ids = random_ids(1, 12)
    cache = DynamicCache()
    with torch.no_grad():
        sdpa.generate(ids, **{name: cache}, max_new_tokens=3, do_sample=False)
    assert cache.get_seq_length() == 12 + 2
    assert not [w for w in recwarn if w.filename.startswith(str(PACKAGE))], [str(w.message) for w in recwarn]
    told = {w.filename for w in recwarn if "past_key_values" in str(w.message)}
    assert told == ({__file__} if name == "past_key_values" != compat.CACHE_ARG else set())


def test_every_private_symbol_is_present_with_the_parameters_we_bind():
    assert compat.PROBLEMS == ()
    for symbol in compat.SYMBOLS:
        assert compat.check_symbol(symbol) is None, symbol.qualname
    assert transformers.__version__ in compat.VERIFIED_VERSIONS, (
        f"transformers {transformers.__version__} is tested but not listed in compat.VERIFIED_VERSIONS"
    )


def test_wrappers_are_installed_once_and_keep_the_signatures():
    import inspect

    from transformers.generation.utils import DeferredStopCheck

    for function in (
        GenerationMixin.generate,
        GenerationMixin._prepare_cache_for_generation,
        GenerationMixin._prefill,
        GenerationMixin.prepare_inputs_for_generation,
        PreTrainedModel.get_compiled_call,
        DeferredStopCheck.is_supported,
    ):
        assert getattr(function, compat.WRAPPED_MARK, False), function
        assert inspect.signature(function) == inspect.signature(function.__wrapped__)
        assert not getattr(function.__wrapped__, compat.WRAPPED_MARK, False), "wrapped twice"
    hf_rocketkv.register()  # idempotent
    assert not getattr(GenerationMixin._prefill.__wrapped__, compat.WRAPPED_MARK, False)


def test_changed_signature_gives_one_clear_error_naming_version_and_symbol():
    def prefill_of_a_future_transformers(self, inputs, config, kwargs):
        return None

    symbol = compat.PrivateSymbol(
        "GenerationMixin._prefill", lambda: prefill_of_a_future_transformers, compat.PREFILL.params, "test"
    )
    problem = compat.check_symbol(symbol)
    assert "GenerationMixin._prefill" in problem and "input_ids" in problem
    with pytest.raises(compat.CompatError) as info:
        compat.require((problem,))
    message = str(info.value)
    assert f"transformers {transformers.__version__}" in message and "GenerationMixin._prefill" in message
    assert "verified" in message and "\n" not in message

    gone = compat.PrivateSymbol("generation.utils.Nothing", lambda: transformers.generation.utils.Nothing, (), "x")
    assert "is gone" in compat.check_symbol(gone)


def test_a_changed_symbol_is_not_wrapped():
    class FutureMixin:
        def _prefill(self, inputs):
            return "original"

    symbol = compat.PrivateSymbol("FutureMixin._prefill", lambda: FutureMixin._prefill, compat.PREFILL.params, "t")
    compat._install_method(FutureMixin, "_prefill", symbol, lambda *a: "wrapped")
    assert FutureMixin()._prefill(1) == "original"


def test_rocketkv_use_raises_when_transformers_changed(monkeypatch):
    monkeypatch.setattr(compat, "PROBLEMS", ("GenerationMixin._prefill lost parameter(s) ['model_kwargs']",))
    monkeypatch.setattr(compat.require, "__defaults__", (compat.PROBLEMS,))
    with pytest.raises(compat.CompatError, match="GenerationMixin._prefill"):
        hf_rocketkv.RocketKVCache()


# ------------------------------------------------------------------------------------------------ no leaks
REFERENCE_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {root!r})
    if {import_rocketkv}:
        import hf_rocketkv  # noqa: F401
    from transformers import CompileConfig, DynamicCache, StaticCache
    from tests.support.tiny_models import make_models, random_ids, left_pad

    _, sdpa = make_models("llama")
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (30, 22)])
    out = {{}}
    with torch.no_grad():
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=8, attention_mask=mask)
        out["dynamic"] = sdpa.generate(ids, past_key_values=DynamicCache(), **kw).tolist()
        out["default"] = sdpa.generate(ids, **kw).tolist()
        config = CompileConfig(fullgraph=True, mode="default", dynamic=False, backend="eager")
        config._compile_all_devices = True
        out["static_compiled"] = sdpa.generate(ids, cache_implementation="static", compile_config=config, **kw).tolist()
        compiled = sdpa.get_compiled_call(config)
        one = torch.tensor([[5]])
        out["positional"] = compiled(one).logits[0, -1].tolist()  # input_ids passed positionally
    print(json.dumps(out))
    """
)


def _run_reference(import_rocketkv: bool) -> dict:
    script = REFERENCE_SCRIPT.format(root=str(ROOT), import_rocketkv=import_rocketkv)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_other_models_behave_exactly_as_without_hf_rocketkv():
    """sdpa + DynamicCache, the default cache and the compiled StaticCache generate give the same tokens with and
    without `import hf_rocketkv`; the compiled forward takes positional arguments in both."""
    without = _run_reference(import_rocketkv=False)
    with_rocketkv = _run_reference(import_rocketkv=True)
    assert with_rocketkv == without


def test_compiled_call_gate_passes_other_calls_through_untouched():
    _, sdpa = make_models("llama")
    config = CompileConfig(fullgraph=True, mode="default", dynamic=False, backend="eager")
    gate = sdpa.get_compiled_call(config)
    assert isinstance(gate, compat.CompiledCallGate)
    ids = random_ids(1, 6)
    with torch.no_grad():
        positional = gate(ids).logits
        keyword = gate(input_ids=ids, **compat.cache_kwargs(StaticCache(config=sdpa.config, max_cache_len=16))).logits
        direct = sdpa(input_ids=ids, **compat.cache_kwargs(StaticCache(config=sdpa.config, max_cache_len=16))).logits
        # each call against the same call without the gate (a StaticCache and a DynamicCache differ by rounding)
        assert torch.allclose(positional, sdpa(ids).logits, atol=1e-6)
        assert torch.allclose(keyword, direct, atol=1e-6)


def test_deferred_stop_check_unchanged_for_other_caches():
    from transformers.generation.utils import DeferredStopCheck

    for device in (torch.device("cuda"), torch.device("cpu"), torch.device("mps")):
        for cache in (DynamicCache(), None):
            got = DeferredStopCheck.is_supported(device, cache, True, False)
            want = DeferredStopCheck.is_supported.__wrapped__(device, cache, True, False)
            assert got == want


# ------------------------------------------------------------------------------------------------ import direction
def _imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in a package file, relative imports resolved."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.append((module, node.lineno))
            found += [(f"{module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _package_files(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py")) if folder else sorted(PACKAGE.glob("*.py"))


PRIVATE_TRANSFORMERS = (
    "transformers.generation.utils",
    "transformers.integrations",
    "transformers.masking_utils",
    "transformers.cache_utils",
    "transformers.modeling_utils",
)


def test_only_compat_touches_private_transformers_modules():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py" and path.parent == PACKAGE / "integration":
            continue
        for module, line in _imports(path):
            if module and module.startswith(PRIVATE_TRANSFORMERS):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not offenders, offenders


@pytest.mark.parametrize(
    "folder, forbidden",
    [
        ("cache", ("hf_rocketkv.integration", "hf_rocketkv.eval", "hf_rocketkv.cli", "hf_rocketkv.bench")),
        ("memory", ("hf_rocketkv.cache", "hf_rocketkv.integration", "hf_rocketkv.serving")),
        ("selection", ("hf_rocketkv.cache", "hf_rocketkv.integration", "hf_rocketkv.kernels", "hf_rocketkv.memory",
                       "transformers")),
        ("kernels", ("hf_rocketkv.cache", "hf_rocketkv.integration", "hf_rocketkv.memory", "transformers")),
    ],
)
def test_arrows_point_down(folder, forbidden):
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _package_files(folder)
        for module, line in _imports(path)
        if module and module.startswith(forbidden)
    ]
    assert not offenders, offenders


def test_kernels_have_no_import_cycle():
    graph = {}
    for path in _package_files("kernels"):
        name = f"hf_rocketkv.kernels.{path.stem}"
        graph[name] = {m for m, _ in _imports(path) if m and m.startswith("hf_rocketkv.kernels.") and m in _modules()}

    def visit(node, trail):
        if node in trail:
            raise AssertionError(f"import cycle: {' -> '.join(trail + [node])}")
        for nxt in graph.get(node, ()):
            visit(nxt, trail + [node])

    for node in graph:
        visit(node, [])


def _modules() -> set[str]:
    return {f"hf_rocketkv.kernels.{p.stem}" for p in _package_files("kernels")}
