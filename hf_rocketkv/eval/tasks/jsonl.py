"""Shared reader for user-supplied JSONL files (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: str | Path, limit: int = 0) -> list[dict]:
    """Rows of a JSON-lines file (blank lines skipped); ``limit`` > 0 keeps the first ``limit`` rows."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such JSONL file: {path}")
    rows = []
    with path.open() as f:
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
