"""Task registry. A task spec is a registered name (``passkey``) or ``loader:path`` for user files.

generated locally (seeded):  passkey, niah_multikey, niah_multivalue, variable_tracking, common_words, fidelity
from a JSONL file:           longbench:PATH, ruler:PATH
"""

from __future__ import annotations

from .base import FidelitySample, Sample, Task
from .common_words import CommonWordsTask
from .fidelity import FidelityTask
from .longbench import LongBenchTask
from .niah_multikey import NiahMultiKeyTask
from .niah_multivalue import NiahMultiValueTask
from .passkey import PasskeyTask
from .ruler_jsonl import RulerJsonlTask
from .variable_tracking import VariableTrackingTask

TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (PasskeyTask, NiahMultiKeyTask, NiahMultiValueTask, VariableTrackingTask, CommonWordsTask, FidelityTask)
}
LOADERS: dict[str, type[Task]] = {"longbench": LongBenchTask, "ruler": RulerJsonlTask}


def get_task(spec: str) -> Task:
    """``passkey`` -> PasskeyTask(); ``longbench:data/qasper.jsonl`` -> LongBenchTask(path)."""
    name, _, path = spec.partition(":")
    if name in LOADERS:
        if not path:
            raise ValueError(f"task {spec!r}: the {name} loader needs a file, e.g. '{name}:path/to/file.jsonl'")
        return LOADERS[name](path)
    if name in TASKS and not path:
        return TASKS[name]()
    raise ValueError(f"unknown task {spec!r}; known: {sorted(TASKS)} or {[f'{k}:PATH' for k in LOADERS]}")


__all__ = ["LOADERS", "TASKS", "FidelitySample", "Sample", "Task", "get_task"]
