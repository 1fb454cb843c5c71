"""Every ```python block of README.md and docs/*.md runs as written, on the embedded default model.

The blocks of one file share a namespace, like notebook cells, and run in order in an empty temporary folder, so a
later block may use what an earlier one defined (the Quickstart loads the model once per file). A block that must
not run starts with the visible line ``# docs-test: skip - <reason>``; a skip without a reason fails.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>[^`]*)$")
SKIP = re.compile(r"^#\s*docs-test:\s*skip\b\s*[-:—]*\s*(?P<reason>.*)$")


@dataclass
class Block:
    """One fenced python block: ``line`` is the 1-based line of its first code line in ``path``."""

    path: Path
    line: int
    code: str

    @property
    def skip_reason(self) -> str | None:
        """The reason after ``# docs-test: skip`` on the block's first line ("" when the reason is missing)."""
        first = self.code.lstrip("\n").split("\n", 1)[0].strip()
        match = SKIP.match(first)
        return match.group("reason").strip() if match else None


def python_blocks(path: Path) -> list[Block]:
    """The ```python (or ```py) blocks of a markdown file, de-indented when the fence is indented (lists)."""
    blocks, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        i += 1
        if not fence:
            continue
        indent, language = fence.group("indent"), fence.group("info").strip().split(" ")[0]
        start, body = i, []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        if language in ("python", "py"):
            blocks.append(Block(path, start + 1, "\n".join(body) + "\n"))
    return blocks


DOCS_WITH_CODE = [p for p in DOC_FILES if python_blocks(p)]


def test_block_extraction_and_skip_marker(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n```python\nx = 1\n```\n```bash\nls\n```\n- item\n\n  ```python\n  # docs-test: skip - needs a GPU\n"
        "  y = 2\n  ```\n```py\n# docs-test: skip\n```\n"
    )
    blocks = python_blocks(doc)
    assert [(b.line, b.code) for b in blocks] == [
        (3, "x = 1\n"),
        (11, "# docs-test: skip - needs a GPU\ny = 2\n"),
        (15, "# docs-test: skip\n"),
    ]
    assert [b.skip_reason for b in blocks] == [None, "needs a GPU", ""]


def test_the_readme_has_runnable_python():
    assert ROOT / "README.md" in DOCS_WITH_CODE  # the Quickstart


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS_WITH_CODE, ids=[p.name for p in DOCS_WITH_CODE])
def test_python_blocks_run(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for block in python_blocks(doc):
        reason = block.skip_reason
        if reason is not None:
            assert reason, f"{doc.name}:{block.line}: '# docs-test: skip' needs a reason after it"
            continue
        padded = "\n" * (block.line - 1) + block.code  # tracebacks then give the markdown file's line numbers
        try:
            exec(compile(padded, str(doc), "exec"), namespace)
        except Exception as err:  # noqa: BLE001 - name the block that failed
            raise AssertionError(f"the python block at {doc.relative_to(ROOT)}:{block.line} failed: {err!r}") from err
