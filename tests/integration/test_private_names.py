"""Private names of transformers, torch and Triton: where the package may spell them (integration/private_names.py
holds the table of torch and Triton names).

- transformers: only ``integration/compat.py`` (listed in its docstring's table; the rest of the package calls its
  accessors). Any other package file that reads a private attribute of transformers' classes
  (``model.config._attn_implementation``, ``Model._from_config``), imports a private transformers module, or imports
  a name transformers does not export (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) fails here, naming file and line.
- torch and Triton: every ``torch._x`` / ``triton._x`` the package spells, and every private attribute of
  ``torch.nn.Module`` it reads, is a row of ``integration/private_names.py`` naming its file; every row is still used
  where it says.

The scanners read the source with ``ast`` (comments and docstrings do not count). Their own tests plant names in
temporary files, so a scanner that finds nothing cannot pass for a clean package.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import torch
import transformers

import hf_rocketkv
from hf_rocketkv.integration import compat
from hf_rocketkv.integration.private_names import TORCH_AND_TRITON, PrivateName

PACKAGE = Path(hf_rocketkv.__file__).parent
COMPAT = PACKAGE / "integration" / "compat.py"

# transformers modules that are implementation, not API (whatever they export)
PRIVATE_TRANSFORMERS_MODULES = (
    "transformers.generation.utils",
    "transformers.integrations",
    "transformers.masking_utils",
    "transformers.cache_utils",
    "transformers.modeling_utils",
    "transformers.models",
    "transformers.utils",
)
# submodules whose names are API though transformers does not export them at its top level
PUBLIC_TRANSFORMERS_SUBMODULES = (
    "transformers.distributed",  # DistributedConfig: the documented tensor-parallel argument of from_pretrained
    "transformers.generation.streamers",  # BaseStreamer: the documented base class of generate()'s streamer
)
PRIVATE_CONSTANT = re.compile(r"^MODEL_\w*MAPPING_NAMES$")
GETATTR_FAMILY = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


# ------------------------------------------------------------------------------------------------ names of our own
def own_names(files: list[Path]) -> frozenset[str]:
    """Names the package defines itself: functions and methods, class attributes, and ``self.x`` / ``cls.x``
    assignments. A private name of ours may match a private name of transformers (``_prefill``) by chance."""
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    targets = statement.targets if isinstance(statement, ast.Assign) else (
                        [statement.target] if isinstance(statement, ast.AnnAssign) else [])
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                            target.value.id in ("self", "cls"):
                        names.add(target.attr)
    return frozenset(names)


# ------------------------------------------------------------------------------------------------ transformers
def compat_table_names() -> frozenset[str]:
    """The private attribute names compat.py's table lists (``GenerationMixin._prefill`` -> ``_prefill``)."""
    return frozenset(re.findall(r"\.(_[A-Za-z]\w*)", compat.__doc__))


def transformers_private_attributes() -> frozenset[str]:
    """Single-underscore names that transformers' own classes define (torch's ``nn.Module`` and ``object`` left out),
    on the classes the package meets: models, configs, generation, caches, tokenizers; plus compat's table."""
    class_names = ("PreTrainedModel", "GenerationMixin", "PreTrainedConfig", "PretrainedConfig", "GenerationConfig",
                   "CompileConfig", "PreTrainedTokenizerBase", "Cache", "CacheLayerMixin", "DynamicCache",
                   "DynamicLayer", "StaticCache", "LlamaConfig", "LlamaForCausalLM")
    classes = [getattr(transformers, name) for name in class_names if hasattr(transformers, name)]  # any 5.x
    names = set()
    for cls in classes:
        for klass in cls.__mro__:
            if klass.__module__.startswith("transformers"):
                names.update(name for name in vars(klass) if _private(name))
    for instance in (transformers.LlamaConfig(), transformers.GenerationConfig(), transformers.CompileConfig()):
        names.update(name for name in vars(instance) if _private(name))
    return frozenset(names | compat_table_names())


def _private_transformers_import(module: str, name: str | None) -> str | None:
    """Why ``from module import name`` (or ``import module``) reaches private transformers code, or None."""
    if module != "transformers" and not module.startswith("transformers."):
        return None
    if module.startswith(PRIVATE_TRANSFORMERS_MODULES) or any(_private(part) for part in module.split(".")):
        return f"imports the private transformers module {module}"
    if name is None:
        return None
    if _private(name) or PRIVATE_CONSTANT.match(name):
        return f"imports the private transformers name {module}.{name}"
    if module != "transformers" and not module.startswith(PUBLIC_TRANSFORMERS_SUBMODULES) and \
            not hasattr(transformers, name):
        return f"imports {module}.{name}, which transformers does not export"
    return None


def scan_transformers(files: list[Path], root: Path, private: frozenset[str], ours: frozenset[str]) -> list[str]:
    """``path:line: what`` for every private transformers name a file spells (see the module docstring)."""
    always = compat_table_names()  # private names we know we use: flagged on any receiver but ``self``
    found = []
    for path in files:
        where = _rel(path, root)
        for node in ast.walk(ast.parse(path.read_text())):
            problem = None
            if isinstance(node, ast.Import):
                problem = next(filter(None, (_private_transformers_import(a.name, None) for a in node.names)), None)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                problem = next(filter(None, (_private_transformers_import(node.module, a.name) for a in node.names)),
                               None)
            elif isinstance(node, ast.Attribute) and node.attr in private:
                receiver = node.value.id if isinstance(node.value, ast.Name) else None
                ours_here = node.attr in ours and (receiver in ("self", "cls") or node.attr not in always)
                if not ours_here:
                    problem = f"reads the private transformers attribute {ast.unparse(node)}"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in GETATTR_FAMILY \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                name = node.args[1].value
                if name in private and (name in always or name not in ours):
                    problem = f"{node.func.id}(..., {name!r}) reaches a private transformers attribute"
            elif isinstance(node, (ast.Name, ast.Attribute)):
                name = node.id if isinstance(node, ast.Name) else node.attr
                if PRIVATE_CONSTANT.match(name):
                    problem = f"uses transformers' private table {name}"
            if problem:
                found.append(f"{where}:{node.lineno}: {problem}")
    return found


def test_no_private_transformers_name_outside_compat():
    files = [path for path in _package_files(PACKAGE) if path != COMPAT]
    offenders = scan_transformers(files, PACKAGE.parent, transformers_private_attributes(),
                                  own_names(_package_files(PACKAGE)))
    assert not offenders, "private transformers names outside integration/compat.py (add an accessor there):\n" + \
        "\n".join(offenders)


def test_compat_itself_spells_the_names_its_accessors_hide():
    """The accessors' names are really read in compat.py: the scan of compat.py alone finds them."""
    found = "\n".join(scan_transformers([COMPAT], PACKAGE.parent, transformers_private_attributes(), frozenset()))
    for name in ("_attn_implementation", "_from_config", "_compile_all_devices", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
                 "transformers.masking_utils"):
        assert name in found, name


def test_the_transformers_scanner_finds_planted_names(tmp_path):
    planted = tmp_path / "pkg" / "leaky.py"
    planted.parent.mkdir()
    planted.write_text(textwrap.dedent("""\
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        kind = model.config._attn_implementation
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
        everywhere = getattr(compile_config, "_compile_all_devices", False)
        from transformers.generation.utils import DeferredStopCheck
        from transformers import _hidden_helper
        from transformers.generation.configuration_utils import GenerationMode
        import transformers.masking_utils
        GenerationMixin._prefill(model, ids)


        class Own:
            def _prefill(self):
                self._attn_implementation_seen = 1
                return self._prefill()
        size = model.config.vocab_size  # public: not reported
        from transformers import DynamicCache, TextStreamer
        from transformers.distributed import DistributedConfig
        """))
    ours = own_names([planted])
    found = scan_transformers([planted], tmp_path, transformers_private_attributes(), ours)
    lines = sorted({int(entry.split(":")[1]) for entry in found})
    assert lines == [1, 2, 3, 4, 5, 6, 7, 8, 9], found
    assert all(entry.startswith("pkg/leaky.py:") for entry in found)
    assert any("_from_config" in entry for entry in found) and any("_attn_implementation" in entry for entry in found)


# ------------------------------------------------------------------------------------------------ torch and Triton
def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _private_path(path: str) -> bool:
    return any(_private(part) for part in path.split(".")[1:])


def torch_private_uses(path: Path, module_private: frozenset[str], ours: frozenset[str]) -> list[tuple[str, int]]:
    """``(symbol, line)`` of every private torch / Triton name the file spells: imports, attribute chains resolved
    through the file's imports (``du.counters`` after ``import torch._dynamo.utils as du``), and private attributes
    of ``torch.nn.Module`` (as ``_name``, found as an attribute or a getattr string)."""
    tree = ast.parse(path.read_text())
    aliases, uses = {}, []
    for node in ast.walk(tree):  # imports first: an alias may be bound inside a function
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root in ("torch", "triton"):
                    aliases[alias.asname or root] = alias.name if alias.asname else root
                    if _private_path(alias.name):
                        uses.append((alias.name, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] in ("torch", "triton"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                aliases[alias.asname or alias.name] = full
                if _private_path(full):
                    uses.append((full, node.lineno))
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts = _dotted(node)
            if parts and parts[0] in aliases:
                full = ".".join([aliases[parts[0]], *parts[1:]])
                if _private_path(full):
                    uses.append((full, node.lineno))
        if isinstance(node, ast.Attribute) and node.attr in module_private and node.attr not in ours:
            uses.append((node.attr, node.lineno))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in GETATTR_FAMILY and \
                len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in module_private:
            uses.append((node.args[1].value, node.lineno))
    return uses


def _attribute_names(path: Path) -> set[str]:
    """Every attribute name a file reads or writes, and every getattr-family string: where attribute rows live."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in GETATTR_FAMILY and \
                len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            names.add(node.args[1].value)
    return names


def _in(where: tuple[str, ...], relative: str) -> bool:
    return any(relative == place or (place.endswith("/") and relative.startswith(place)) for place in where)


def _covers(row: PrivateName, symbol: str) -> bool:
    if row.attribute:
        return row.symbol.rsplit(".", 1)[-1] == symbol.rsplit(".", 1)[-1]
    return row.symbol == symbol or row.symbol.startswith(symbol + ".")  # an import of the module a row's name is in


def torch_module_private() -> frozenset[str]:
    return frozenset(name for name in (*vars(torch.nn.Module), *vars(torch.nn.Module())) if _private(name))


def check_torch_table(files: list[Path], root: Path, table: tuple[PrivateName, ...], ours: frozenset[str]):
    """(uses missing from the table, rows not used where they say), each as readable lines."""
    module_private = torch_module_private()
    missing, used = [], set()
    for path in files:
        relative = _rel(path, root)
        for symbol, line in torch_private_uses(path, module_private, ours):
            rows = [row for row in table if _covers(row, symbol) and _in(row.where, relative)]
            if not rows:
                missing.append(f"{relative}:{line}: {symbol}")
            used.update((row.symbol, place) for row in rows for place in row.where if _in((place,), relative))
    stale = []
    for row in table:
        for place in row.where:
            users = [path for path in files if _in((place,), _rel(path, root))]
            if row.attribute:
                present = any(row.symbol.rsplit(".", 1)[-1] in _attribute_names(path) for path in users)
            else:
                present = (row.symbol, place) in used
            if not present:
                stale.append(f"{row.symbol} is listed for {place} but not used there")
    return missing, stale


def test_every_private_torch_and_triton_name_is_in_the_table_and_every_row_is_used():
    files = _package_files(PACKAGE)
    missing, stale = check_torch_table(files, PACKAGE, TORCH_AND_TRITON, own_names(files))
    assert not missing, "private torch/Triton names missing from integration/private_names.py:\n" + "\n".join(missing)
    assert not stale, "rows of integration/private_names.py no longer used where they say:\n" + "\n".join(stale)


def test_the_torch_scanner_finds_planted_names_and_stale_rows(tmp_path):
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "planted.py").write_text(textwrap.dedent("""\
        import torch
        import torch._dynamo.utils as dynamo_utils
        from torch._inductor import config as inductor_config


        def f(module, tensor):
            torch._dynamo.mark_static_address(tensor)
            graphs = dynamo_utils.counters["stats"]
            compiled = getattr(module, "_compiled_call_impl", None)
            import triton
            return triton._internal_thing, torch.compiler.is_compiling(), torch._C._get_tracing_state()
        """))
    table = (
        PrivateName("torch._dynamo.mark_static_address", ("kernels/",), "planted"),
        PrivateName("torch._dynamo.utils.counters", ("bench/workload.py",), "listed for another file"),
        PrivateName("torch._library.triton.is_wrap_triton_enabled", ("kernels/planted.py",), "not used there"),
    )
    files = _package_files(tmp_path)
    missing, stale = check_torch_table(files, tmp_path, table, frozenset())
    found = {entry.split(": ", 1)[1]: int(entry.split(":")[1]) for entry in missing}
    assert found == {
        "torch._dynamo.utils": 2,  # the import (its row names another file)
        "torch._inductor.config": 3,
        "torch._dynamo.utils.counters": 8,
        "_compiled_call_impl": 9,
        "triton._internal_thing": 11,
        "torch._C._get_tracing_state": 11,
    }, missing
    assert stale == ["torch._dynamo.utils.counters is listed for bench/workload.py but not used there",
                     "torch._library.triton.is_wrap_triton_enabled is listed for kernels/planted.py but not used there"]
