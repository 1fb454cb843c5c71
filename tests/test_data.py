"""The main job's long document (hf_rocketkv/data): its answer sits once, deep inside, its licence files are there,
and scripts/make_long_document.py rebuilds it exactly (on the CPython whose pydoc_data it came from)."""

from __future__ import annotations

import sys

import pytest

from tests.support.repo import ROOT


def test_long_document_has_its_answer_deep_inside():
    from hf_rocketkv.data import DATA_DIR, LONG_DOCUMENT

    text = LONG_DOCUMENT.text
    assert text.count(LONG_DOCUMENT.answer) == 1
    assert 0.6 < text.index(LONG_DOCUMENT.answer) / len(text) < 0.9
    assert "Execution model" in text and "Objects, values and types" in text
    assert (DATA_DIR / "LICENSE-PSF.txt").read_text().startswith("PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2")
    assert "Changes made" in (DATA_DIR / "NOTICE.txt").read_text()


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the committed text came from CPython 3.11's pydoc_data")
def test_long_document_is_reproducible():
    import importlib.util

    from hf_rocketkv.data import LONG_DOCUMENT

    spec = importlib.util.spec_from_file_location("make_long_document", ROOT / "scripts" / "make_long_document.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.with_sentence(script.chapters_text()) == LONG_DOCUMENT.text
    assert LONG_DOCUMENT.answer in script.SENTENCE
