"""LongBench (v1) rows from a local JSONL file: ``context``, ``input`` (the question), ``answers`` (list).

Prompt: the context, then the question with a generic instruction (LongBench's per-dataset templates are not
reproduced). Contexts longer than ``max(lengths)`` prompt tokens are truncated in the middle, as LongBench does.
Scores: substring match (any answer in the prediction) as the headline, LongBench's token F1 beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from .base import Sample, Task, encode_prompt
from .jsonl import ANSWERS, TEXT, read_jsonl, require

TEMPLATE = "{context}\n\nAnswer the question based on the text above. Be concise.\n\nQuestion: {input}"


def truncate_middle(tokenizer, text: str, max_tokens: int) -> str:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return tokenizer.decode(ids[:half]) + tokenizer.decode(ids[len(ids) - (max_tokens - half) :])


class LongBenchTask(Task):
    name = "longbench"
    # every line is checked by the CLI before the model loads (jsonl.validate_jsonl), the rows read again here
    fields: ClassVar[dict[str, str]] = {"context": TEXT, "input": TEXT, "answers": ANSWERS}
    required_fields = tuple(fields)
    max_new_tokens = 32

    def __init__(self, path: str):
        self.path = path
        self.name = f"longbench:{Path(path).stem}"

    def build(self, tokenizer, settings) -> list[Sample]:
        rows = read_jsonl(self.path, settings.samples)
        max_len = max(settings.lengths)
        samples = []
        for number, row in enumerate(rows, 1):
            require(row, self.required_fields, self.path, number)
            answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
            overhead = len(encode_prompt(tokenizer, TEMPLATE.format(context="", input=row["input"]), settings.chat))
            context = truncate_middle(tokenizer, str(row["context"]), max(max_len - overhead, 16))
            samples.append(
                Sample(
                    task=self.name,
                    index=number - 1,
                    prompt=TEMPLATE.format(context=context, input=row["input"]),
                    answers=[str(a) for a in answers],
                    metrics=("substring", "qa_f1"),
                    max_new_tokens=settings.max_new_tokens or self.max_new_tokens,
                    meta={"id": row.get("_id"), "dataset": row.get("dataset")},
                )
            )
        return samples
