"""Text shipped with the package: the long document the README's main job and Quickstart ask about.

``python_reference.txt`` holds two chapters of the Python Language Reference ("Objects, values and types" and
"Execution model", about 3,300 SmolLM2 tokens), as CPython 3.11 ships them in ``pydoc_data``, with one sentence
inserted at 75% of the text: the archive number the question asks for. So the answer lies deep in the text and only
a cache that kept those tokens can give it. Licence: PSF License Agreement v2 (``LICENSE-PSF.txt``; what was changed
is in ``NOTICE.txt``). Made by ``scripts/make_long_document.py``.

    from hf_rocketkv.data import LONG_DOCUMENT
    prompt = LONG_DOCUMENT.text + "\\n\\n" + LONG_DOCUMENT.question
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class LongDocument:
    """A document, a question whose answer lies deep in it, and that answer."""

    path: Path
    question: str
    answer: str

    @property
    def text(self) -> str:
        return self.path.read_text(encoding="utf-8")


LONG_DOCUMENT = LongDocument(
    path=DATA_DIR / "python_reference.txt",
    question="What is the archive number of this chapter? Answer with the number only.",
    answer="71432",
)

__all__ = ["DATA_DIR", "LONG_DOCUMENT", "LongDocument"]
