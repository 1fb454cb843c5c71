"""Measured numbers in README.md and docs/*.md name their source: a results/ file that exists.

Two rules, kept robust to rewording:

- every ``results/...`` path the docs cite matches a file (``{a,b}`` alternatives and ``*`` globs expanded, each
  alternative on its own, so a cited pattern with one missing member fails);
- every section (from one heading to the next) that quotes a measured quantity (a number followed by ms, us,
  tokens/s, tok/s, GiB or GB/s, or a ratio such as ``1.2x``) outside code blocks cites a results/ file, or the line
  links to another doc (``benchmarks.md``, ``accuracy.md#...``) where the number is sourced. The few quantities that
  are no measurement (a configured bound, arithmetic on sizes) are listed in ``NOT_MEASURED`` with the reason.

Device, date, commit and metric are asked of every number too (docs/benchmarks.md, "Method"); those are prose and
stay a review matter.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = re.compile(r"results/[A-Za-z0-9_./*{},\-]+")
# a number with a unit of time, throughput or memory, or a ratio "1.2x" (no space: "2 x 64" is a shape)
MEASURED = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:\s*(?:ms|us|µs|tokens/s|tok/s|GiB|GB/s)|x)(?![A-Za-z0-9])")
DOC_LINK = re.compile(r"\b[a-z_]+\.md\b")
HEADING = re.compile(r"#{1,6} ")
FENCE = "```"

# (file, text on the line) -> why the quantity is no measurement, or why a measurement has no results file yet
NOT_MEASURED = {
    ("docs/configuration.md", "holds at most 1.5x the slots needed"): "the capacity ladder's configured bound",
    ("docs/memory.md", "`min(0.25 x available, 2 GiB)`"): "the CPU pool's configured cap",
    ("docs/memory.md", "70.2 GiB free on cuda:0`), None when bytes"): "an example of pool.sizing.describe()'s text",
    ("docs/pool-cache.md", "i.e. 4 GiB for a 32k prompt"): "arithmetic on the dense prompt store's shape",
    ("docs/models.md", "(about 1 GiB of fp32 logits"): "the query block's configured size",
}


def expand(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``[abd, acd]``, nested left to right."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [alt for option in match.group(1).split(",")
            for alt in expand(pattern[: match.start()] + option + pattern[match.end():])]


def cited_paths() -> list[tuple[str, int, str]]:
    """(doc, line, cited pattern) for every results/ citation."""
    found = []
    for doc in DOC_FILES:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for match in CITED.finditer(line):
                found.append((str(doc.relative_to(ROOT)), number, match.group(0).rstrip(".,;:)")))
    return found


def sections(doc: Path) -> list[list[tuple[int, str, bool]]]:
    """The doc's lines cut at headings outside code blocks: [(line number, text, inside a code block)]."""
    out: list[list[tuple[int, str, bool]]] = [[]]
    in_code = False
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip().startswith(FENCE):
            in_code = not in_code
        if not in_code and HEADING.match(line) and out[-1]:
            out.append([])
        out[-1].append((number, line, in_code))
    return out


def unsourced(doc: Path) -> list[str]:
    """Lines quoting a measured quantity in a section of ``doc`` that cites no results/ file."""
    name = str(doc.relative_to(ROOT))
    bad = []
    for section in sections(doc):
        if any("results/" in line for _, line, _ in section):
            continue
        for number, line, in_code in section:
            if in_code or not MEASURED.search(line) or DOC_LINK.search(line):
                continue
            if any(doc_name == name and text in line for doc_name, text in NOT_MEASURED):
                continue
            bad.append(f"{name}:{number}: {line.strip()[:120]}")
    return bad


def test_expand_braces_and_globs():
    assert expand("results/a_{x,y}_{1,2}.json") == ["results/a_x_1.json", "results/a_x_2.json",
                                                    "results/a_y_1.json", "results/a_y_2.json"]
    assert expand("results/plain.json") == ["results/plain.json"]


def test_measured_quantity_pattern():
    for text in ("8.36 ms", "3,135 tokens/s", "34.4 GiB", "(1.81x)", "2292 GB/s", "~600 us", "1.2x"):
        assert MEASURED.search(text), text
    for text in ("2 x 64 vectors", "Llama-3.1-8B", "p50/p99, tokens/s per user", "b32", "fp8", "0x1f"):
        assert not MEASURED.search(text), text


def test_docs_cite_results():
    assert len(cited_paths()) > 50  # the docs do cite their sources: the check below is not vacuous


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.name)
def test_every_cited_results_file_exists(doc):
    missing = []
    for name, number, pattern in cited_paths():
        if name != str(doc.relative_to(ROOT)):
            continue
        for alternative in expand(pattern):
            path = ROOT / alternative
            if not (path.exists() if alternative.endswith("/") else glob.glob(str(path))):
                missing.append(f"{name}:{number}: {alternative} (cited as {pattern})")
    assert not missing, "cited results files that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.name)
def test_measured_numbers_name_a_results_file(doc):
    bad = unsourced(doc)
    assert not bad, "measured numbers in a section that cites no results/ file:\n" + "\n".join(bad)


def test_not_measured_entries_still_match():
    """An exception whose line is gone is removed, so the list stays the short list of real exceptions."""
    for doc_name, text in NOT_MEASURED:
        assert text in (ROOT / doc_name).read_text(encoding="utf-8"), (doc_name, text)
