"""One owner per piece of state, checked: no module assigns attributes of objects other than ``self`` / ``cls``.

A write like ``layer.lengths = ...`` or ``self.cache.hints.prefilling = True`` in a module that does not define the
object's class puts the object's state in the hands of another module: its invariants can no longer be read in one
place. The rule is that an object's attributes are assigned by its own methods (``self.x = ...``); other modules ask
the owner (a method, a constructor argument, a returned value).

The package still has such writes (the cache's layer state is set from modules that hold its jobs). They are listed,
one ``path: target`` per line, in ``tests/support/attribute_writes.txt``: the list may only shrink. A new write fails
``test_no_new_attribute_writes``; a listed write that is gone fails ``test_the_list_only_holds_writes_that_remain``
until its line is removed. ``python -m tests.test_ownership`` prints the writes the package holds now.

What counts (AST, ``hf_rocketkv/``): an assignment, augmented assignment or annotated assignment whose target is an
attribute of anything but the bare names ``self`` and ``cls`` (``obj.x``, ``self.part.x``, ``f().x``), and
``setattr`` / ``delattr`` / ``object.__setattr__`` on anything but ``self`` / ``cls``.

Private names are checked the same way: a module that uses a private name (``x._name``) of an object other than
``self`` / ``cls`` / ``super()`` reaches into that object's internals. The uses the package still makes are listed in
``tests/support/private_reads.txt`` (``python -m tests.test_ownership --reads`` prints them), which may only shrink.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_rocketkv"
LISTED = Path(__file__).resolve().parent / "support" / "attribute_writes.txt"
LISTED_READS = Path(__file__).resolve().parent / "support" / "private_reads.txt"
OWNERS = ("self", "cls")


def _own(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in OWNERS


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def _flatten(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [leaf for element in target.elts for leaf in _flatten(element)]
    if isinstance(target, ast.Starred):
        return _flatten(target.value)
    return [target]


def foreign_writes(source: str) -> list[str]:
    """The attribute writes of ``source`` whose object is not ``self`` / ``cls``, as source text (``obj.x``,
    ``setattr(obj)``), one entry per occurrence."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for target in (leaf for t in _targets(node) for leaf in _flatten(t)):
            if isinstance(target, ast.Attribute) and not _own(target.value):
                found.append(ast.unparse(target))
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.id if isinstance(func, ast.Name) else ast.unparse(func)
            if name in ("setattr", "delattr", "object.__setattr__") and not _own(node.args[0]):
                found.append(f"{name}({ast.unparse(node.args[0])})")
    return found


def foreign_private_reads(source: str) -> list[str]:
    """The uses of private names (one leading underscore, not dunders) of objects other than ``self`` / ``cls`` /
    ``super()`` in ``source``, as source text (``engine._lock``, ``torch._dynamo``), one entry per occurrence."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        if _own(owner) or (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                           and owner.func.id == "super"):
            continue
        found.append(ast.unparse(node))
    return found


def _over_package(detector) -> Counter:
    """``path: finding`` -> occurrences of ``detector(source)``'s findings, over every module of the package."""
    found = Counter()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for finding in detector(path.read_text()):
            found[f"{relative}: {finding}"] += 1
    return found


def package_writes() -> Counter:
    """``path: target`` -> occurrences of foreign attribute writes."""
    return _over_package(foreign_writes)


def package_private_reads() -> Counter:
    """``path: expression`` -> occurrences of foreign private-name uses."""
    return _over_package(foreign_private_reads)


def _listed(path: Path) -> set[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def listed_writes() -> set[str]:
    return _listed(LISTED)


def test_no_new_private_reads():
    new = sorted(set(package_private_reads()) - _listed(LISTED_READS))
    assert not new, ("these modules use private names of objects other than self / cls; give the owner a public "
                     f"method or property instead: {new}")


def test_the_private_read_list_only_holds_reads_that_remain():
    gone = sorted(_listed(LISTED_READS) - set(package_private_reads()))
    assert not gone, f"these reads are gone: remove their lines from {LISTED_READS.relative_to(ROOT)}: {gone}"


def test_the_check_sees_foreign_private_reads_and_leaves_own_ones():
    """The private-read detector on hand-written source (the expected list is written out)."""
    source = (
        "class B(A):\n"
        "    def f(self, engine, other):\n"
        "        self._lock.acquire()\n"             # own
        "        super()._index_rows(1)\n"           # the class's own base
        "        engine._lock.acquire()\n"           # foreign
        "        n = other.layer._count + 1\n"       # foreign, through another object
        "        torch._dynamo.mark_static(n)\n"     # a library's private module
        "        x = engine.__class__\n"             # a dunder: not private
        "        y = engine.public\n"                # public
    )
    assert sorted(foreign_private_reads(source)) == sorted(["engine._lock", "other.layer._count", "torch._dynamo"])


def test_no_new_attribute_writes():
    new = sorted(set(package_writes()) - listed_writes())
    assert not new, ("these modules assign attributes of objects they do not own; give the owner a method (or a "
                     f"constructor argument) instead: {new}")


def test_the_list_only_holds_writes_that_remain():
    gone = sorted(listed_writes() - set(package_writes()))
    assert not gone, f"these writes are gone: remove their lines from {LISTED.relative_to(ROOT)}: {gone}"


def test_the_check_sees_foreign_writes_and_leaves_own_ones():
    """The detector itself, on hand-written source (an independent oracle: the expected lists are written out)."""
    source = (
        "class A:\n"
        "    def f(self, layer, other):\n"
        "        self.x = 1\n"                         # own: allowed
        "        self.x += 1\n"                        # own
        "        layer.lengths = None\n"               # foreign
        "        self.store.table = None\n"            # foreign (an attribute of another object)
        "        a, other.b = 1, 2\n"                  # foreign inside a tuple
        "        layer.seen += 1\n"                    # foreign augmented
        "        setattr(layer, 'k', 1)\n"             # foreign setattr
        "        setattr(self, 'k', 1)\n"              # own
        "        object.__setattr__(cfg, 'n', 1)\n"    # foreign
        "        local = 3\n"                          # a name, not an attribute
        "        items[0] = 1\n"                       # a subscript of a local: not an attribute write
        "    @classmethod\n"
        "    def g(cls):\n"
        "        cls.count = 0\n"                      # own
    )
    assert sorted(foreign_writes(source)) == sorted(["layer.lengths", "self.store.table", "other.b", "layer.seen",
                                                     "setattr(layer)", "object.__setattr__(cfg)"])


if __name__ == "__main__":
    import sys

    found = package_private_reads() if sys.argv[1:] == ["--reads"] else package_writes()
    for entry, count in sorted(found.items()):
        print(entry)
