"""RULER rows from a local JSONL file (the output of RULER's ``prepare.py``): ``input``, ``outputs`` (list).

``input`` already holds the whole prompt (context and question); an ``answer_prefix`` field, when present, is put
after the chat template's generation prompt. Metric as in RULER: ``string_match_part`` for QA tasks (file or
``task`` field containing "qa"), ``string_match_all`` otherwise. Inputs are not truncated.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from .base import Sample, Task
from .jsonl import ANSWERS, TEXT, read_jsonl, require


class RulerJsonlTask(Task):
    name = "ruler"
    # every line is checked by the CLI before the model loads (jsonl.validate_jsonl), the rows read again here
    fields: ClassVar[dict[str, str]] = {"input": TEXT, "outputs": ANSWERS}
    required_fields = tuple(fields)
    max_new_tokens = 64

    def __init__(self, path: str):
        self.path = path
        self.name = f"ruler:{Path(path).stem}"

    def build(self, tokenizer, settings) -> list[Sample]:
        rows = read_jsonl(self.path, settings.samples)
        samples = []
        for number, row in enumerate(rows, 1):
            require(row, self.required_fields, self.path, number)
            outputs = row["outputs"] if isinstance(row["outputs"], list) else [row["outputs"]]
            task_name = str(row.get("task", Path(self.path).stem)).lower()
            metric = "string_match_part" if "qa" in task_name else "string_match_all"
            samples.append(
                Sample(
                    task=self.name,
                    index=int(row.get("index", number - 1)),
                    prompt=str(row["input"]),
                    answers=[str(o) for o in outputs],
                    metrics=(metric,),
                    max_new_tokens=settings.max_new_tokens or self.max_new_tokens,
                    answer_prefix=str(row.get("answer_prefix", "") or "").strip(),
                    length=row.get("length"),
                    meta={"task": task_name},
                )
            )
        return samples
