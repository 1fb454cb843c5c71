"""Shared reader for user-supplied JSONL files (nothing is downloaded), and the check of a whole file.

``validate_jsonl`` reads every line before anything loads (the command line calls it for ``longbench:PATH`` and
``ruler:PATH``): a line that is not UTF-8, not JSON, not an object, or lacks a field the task reads fails the run
with its line number and the reason, wherever it is in the file, not only among the rows a run would read.
"""

from __future__ import annotations

import json
from pathlib import Path

TEXT = "text"  # a string
ANSWERS = "answers"  # a string or number, or a non-empty list of them


def read_jsonl(path: str | Path, limit: int = 0) -> list[dict]:
    """Rows of a JSON-lines file (blank lines skipped); ``limit`` > 0 keeps the first ``limit`` rows."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such JSONL file: {path}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON: {err}") from err
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: each line must be a JSON object")
            rows.append(row)
            if limit and len(rows) >= limit:
                break
    return rows


def require(row: dict, keys: tuple[str, ...], path, number: int) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"{path}: row {number} lacks field(s) {missing}; it has {sorted(row)}")


def line_problem(line: bytes, fields: dict[str, str]) -> str | None:
    """Why one non-blank line cannot be a row with ``fields`` (name -> TEXT or ANSWERS), or None."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 text (byte {err.start} of the line cannot be decoded)"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        return f"not valid JSON: {err}"
    if not isinstance(row, dict):
        return f"not a JSON object (a {type(row).__name__}); each line must be one object"
    missing = [name for name in fields if name not in row]
    if missing:
        return f"lacks field(s) {missing}; it has {sorted(row)}"
    for name, kind in fields.items():
        value = row[name]
        if kind == TEXT and not isinstance(value, str):
            return f"field {name!r} must be text, got {json.dumps(value)[:40]}"
        if kind == ANSWERS:
            items = value if isinstance(value, list) else [value]
            if not items or not all(isinstance(item, (str, int, float)) and not isinstance(item, bool)
                                    for item in items):
                return f"field {name!r} must be text or a non-empty list of texts, got {json.dumps(value)[:40]}"
    return None


def validate_jsonl(path: str | Path, fields: dict[str, str], shown: int = 5) -> int:
    """Check every line of ``path`` (blank lines aside); returns the number of rows. ValueError names the first bad
    line (``FILE:LINE: reason``) and the line numbers of the next few bad ones."""
    path = Path(path)
    bad: list[tuple[int, str]] = []
    rows = 0
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            problem = line_problem(line, fields)
            if problem is None:
                rows += 1
            else:
                bad.append((number, problem))
    if bad:
        number, problem = bad[0]
        more = ""
        if len(bad) > 1:
            others = ", ".join(str(n) for n, _ in bad[1:shown + 1]) + (", ..." if len(bad) > shown + 1 else "")
            more = f" ({len(bad) - 1} more bad line(s): {others})"
        raise ValueError(f"{path}:{number}: {problem}{more}")
    if rows == 0:
        raise ValueError(f"{path}: no rows: the file is empty")
    return rows
