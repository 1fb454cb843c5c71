"""Write hf_rocketkv/data/python_reference.txt, the long document of the README's main job, and its licence files.

    python scripts/make_long_document.py          # rewrites the three files under hf_rocketkv/data/

The document is two chapters of the Python Language Reference as CPython ships them in ``pydoc_data.topics`` (the
text behind ``help("objects")``): "Objects, values and types" (section 3.1) and "Execution model" (chapter 4),
unchanged and in that order, with one sentence inserted between two paragraphs at 75% of the text. The question
of the main job asks for that sentence's number, so only a cache that kept it can answer.

Licence: the Python documentation is under the PSF License Agreement version 2, which allows redistribution and
derivative works provided the agreement and PSF's copyright notice are kept and the changes are summarised:
LICENSE-PSF.txt and NOTICE.txt are written beside the document. Deterministic for a given CPython release; the
committed files came from CPython 3.11.7 (the text of these chapters differs slightly between releases).
"""

from __future__ import annotations

import platform
import re
import sysconfig
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "hf_rocketkv" / "data"
CHAPTERS = ("objects", "execmodel")
INSERT_AT = 0.75  # fraction of the paragraphs before the inserted sentence
SENTENCE = "Note from the editor of this copy: the archive number of this chapter is 71432."


def chapters_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n\n".join(topics[name].strip() for name in CHAPTERS)


def with_sentence(text: str) -> str:
    paragraphs = text.split("\n\n")
    at = int(len(paragraphs) * INSERT_AT)
    return "\n\n".join(paragraphs[:at] + [SENTENCE] + paragraphs[at:]) + "\n"


def psf_license() -> str:
    """The "PSF LICENSE AGREEMENT FOR PYTHON" section of this CPython's LICENSE.txt."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(encoding="utf-8")
    match = re.search(r"PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2\n.*?(?=\n\n\nBEOPEN)", text, re.S)
    if match is None:
        raise SystemExit("could not find the PSF License Agreement in LICENSE.txt")
    return match.group(0).strip() + "\n"


def notice() -> str:
    return (
        "python_reference.txt: from the Python Language Reference (CPython "
        f"{platform.python_version()}, pydoc_data.topics):\n"
        '  section 3.1 "Objects, values and types" and chapter 4 "Execution model".\n'
        "Copyright (c) 2001-2023 Python Software Foundation; All Rights Reserved.\n"
        "Licensed under the PSF License Agreement version 2 (LICENSE-PSF.txt).\n"
        "Changes made: only these two chapters are kept, as plain text; one sentence was inserted at 75% of the\n"
        f'text: "{SENTENCE}"\n'
        "Produced by scripts/make_long_document.py in the hf_rocketkv repository.\n"
    )


def main() -> None:
    DATA.mkdir(exist_ok=True)
    (DATA / "python_reference.txt").write_text(with_sentence(chapters_text()), encoding="utf-8")
    (DATA / "LICENSE-PSF.txt").write_text(psf_license(), encoding="utf-8")
    (DATA / "NOTICE.txt").write_text(notice(), encoding="utf-8")
    print(f"wrote {DATA}/python_reference.txt, LICENSE-PSF.txt, NOTICE.txt")


if __name__ == "__main__":
    main()
