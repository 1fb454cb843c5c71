"""memory/ stays below the cache floors (no transformers, no cache classes, no config, not even for type hints; from
the kernels only the fp8 arithmetic, kernels/fp8.py, which imports nothing of the package), knows no RocketKV field,
and one pool serves several threads."""

import ast
import threading
from pathlib import Path

from hf_rocketkv.memory import PoolExhaustedError
from tests.memory.helpers import make_pool, rocket_config

MEMORY = Path(__file__).resolve().parents[2] / "hf_rocketkv" / "memory"
FORBIDDEN = ("transformers", "hf_rocketkv.cache", "hf_rocketkv.integration", "hf_rocketkv.config",
             "hf_rocketkv.runtime_settings")
# RocketKVConfig's fields and policies: their arithmetic belongs to cache/page_budget.py
ROCKETKV_NAMES = {"RocketKVConfig", "prompt_budget", "window_size", "kt_cache_dtype", "multi_turn",
                  "per_head_budgets", "decode_headroom", "check_pool_policy", "stage1"}


def _imports(tree):
    """(module, inside `if TYPE_CHECKING:`) for every import in a module."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            guarded.update(id(child) for child in ast.walk(node))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in guarded
        elif isinstance(node, ast.ImportFrom):
            module = ("hf_rocketkv." if node.level == 2 else "") + (node.module or "")
            if node.level == 1:
                module = "hf_rocketkv.memory." + (node.module or "")
            yield module, id(node) in guarded


def test_memory_imports_nothing_from_the_floors_above():
    files = sorted(MEMORY.glob("*.py"))
    assert len(files) > 5
    for path in files:
        for module, type_only in _imports(ast.parse(path.read_text())):
            assert not module.startswith(FORBIDDEN), f"{path.name} imports {module}"
            if module == "hf_rocketkv.kernels.fp8":  # the fp8 arithmetic, a leaf below both memory and the kernels
                continue
            if module.startswith("hf_rocketkv.") and not module.startswith("hf_rocketkv.memory"):
                raise AssertionError(f"{path.name} imports {module} ({'type hints' if type_only else 'run time'})")


def test_memory_code_names_no_rocketkv_field():
    """Names, attributes and non-docstring strings of memory/'s code (docstrings may say what a caller passes)."""
    for path in sorted(MEMORY.glob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                name = node.id
            elif isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                name = next((field for field in ROCKETKV_NAMES if field in node.value), None)
            else:
                continue
            assert name not in ROCKETKV_NAMES, f"{path.name}:{node.lineno} names {name}"


def test_the_fp8_arithmetic_imports_nothing_of_the_package():
    path = MEMORY.parent / "kernels" / "fp8.py"
    assert not [m for m, _ in _imports(ast.parse(path.read_text())) if m.startswith("hf_rocketkv")]


def test_threads_share_one_pool():
    pool = make_pool(40, host_pages=6)
    cfg = rocket_config(prompt_budget=16, window_size=4)
    errors = []

    def worker(seed):
        try:
            for step in range(25):
                ids = [seed % 2 * 1000 + i for i in range(36)] + [step % 3]
                try:
                    adm = pool.admit(len(ids), 4, cfg, token_ids=ids)
                except PoolExhaustedError:
                    continue
                pool.commit_prompt(adm)
                pool.release(adm.prompt)
                if step % 5 == 0:
                    pool.evict(2)
                pool.release(adm)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert pool.free_pages() == pool.total_pages() and pool.stats().hit_pages > 0
