"""The house rules, checked rather than hoped for: small files and classes, and docs that describe the project as it
is (no chronicle of how the work went). The import floors are checked by import-linter (pyproject.toml, .ci/run).

- every module of the package is under ``MAX_FILE_LINES`` lines and every class under ``MAX_CLASS_LINES``: when one
  grows past that, it is split by concept before anything is added to it;
- README.md, CHANGELOG.md, docs/*.md and the package's code never speak of sessions of work or issue numbers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_rocketkv"
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 450

# "the fifteenth session", "session 14", "issue 28", "issue #12", "(#31)": how the work went, not what the project is
CHRONICLE = re.compile(
    r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
    r"fifteenth|sixteenth|\d+(?:st|nd|rd|th))\s+session\b|\bsession\s+\d+\b|\bissues?\s+#?\d+\b|\(#\d+\)",
    re.IGNORECASE,
)


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def class_lengths(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def chronicle_lines(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
            for number, line in enumerate(path.read_text().splitlines(), 1) if CHRONICLE.search(line)]


def test_every_package_file_is_small():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in package_files()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"split these by concept (limit {MAX_FILE_LINES} lines): {long}"


def test_every_class_is_small():
    long = [f"{p.relative_to(ROOT)}: class {name} {n} lines" for p in package_files()
            for name, n in class_lengths(p) if n > MAX_CLASS_LINES]
    assert not long, f"split these by concept (limit {MAX_CLASS_LINES} lines): {long}"


def test_docs_and_code_tell_no_chronicle():
    texts = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")), *package_files()]
    found = [line for path in texts for line in chronicle_lines(path)]
    assert not found, found


@pytest.mark.parametrize("text, chronicle", [
    ("measured in the fifteenth session", True),
    ("see issue 28 for the plan", True),
    ("fixed in #31 (#31)", True),
    ("session 14 refused it", True),
    ("a 3rd session of tuning", True),
    ("one session per request; the issue is that pages are shared", False),
    ("pytest's session fixture", False),
])
def test_the_chronicle_pattern_tells_history_from_words(text, chronicle):
    assert bool(CHRONICLE.search(text)) == chronicle


def test_the_size_checks_can_fail(tmp_path):
    big = tmp_path / "big.py"
    big.write_text("class Big:\n" + "    x = 1\n" * (MAX_CLASS_LINES + 1))
    assert class_lengths(big) == [("Big", MAX_CLASS_LINES + 2)]


def test_design_doc_names_every_module():
    """docs/design.md draws the floors with one sentence per module: a new module gets its sentence there."""
    text = (ROOT / "docs" / "design.md").read_text()
    missing = []
    for path in package_files():
        relative = path.relative_to(PACKAGE).as_posix()
        folders = [f"`{'/'.join(relative.split('/')[:depth])}/`" for depth in range(1, relative.count("/") + 1)]
        named = f"`{relative}`" in text or any(folder in text for folder in folders[1:])
        if relative.endswith("__init__.py") and relative != "__init__.py":
            named = named or f"`{relative.rsplit('/', 2)[0]}/`" in text or relative.count("/") == 1
        if not named:
            missing.append(relative)
    assert not missing, f"name these in docs/design.md's module list: {missing}"
