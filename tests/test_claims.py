"""Measured numbers in README.md and docs/*.md name their source: a results/ file that exists.

Two rules, kept robust to rewording:

- every ``results/...`` path the docs cite matches a file (``{a,b}`` alternatives and ``*`` globs expanded, each
  alternative on its own, so a cited pattern with one missing member fails);
- every section (from one heading to the next) that quotes a measured quantity (a number followed by ms, us,
  tokens/s, tok/s, GiB or GB/s, or a ratio such as ``1.2x``) outside code blocks cites a results/ file, or the line
  links to another doc (``benchmarks.md``, ``accuracy.md#...``) where the number is sourced. The few quantities that
  are no measurement (a configured bound, arithmetic on sizes) are listed in ``NOT_MEASURED`` with the reason.

And the other way round: every file under ``results/`` that git tracks is cited, by a doc, the CHANGELOG, the code
(a docstring, ``benchmarks/perf_floors.json``) or a cited results file (a summary naming its raw rows): results stay
in git only where something cites them (``results/index.md`` lists them all and counts for none).

Device, date, commit and metric are asked of every number too (docs/benchmarks.md, "Method"); those are prose and
stay a review matter.
"""

from __future__ import annotations

import fnmatch
import glob
import re
import subprocess
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


CITING_FOLDERS = ("hf_rocketkv", "benchmarks", "scripts")
ABBREVIATED = re.compile(r"\.\.\.(_[A-Za-z0-9_.*{},\-]+)")
TEXT_SUFFIXES = {".md", ".json", ".jsonl", ".log", ".txt", ".csv", ".py", ".sh", ".yaml"}


def tracked_results() -> list[str] | None:
    """The files under results/ that git tracks (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return [line for line in out.stdout.splitlines() if line and line != "results/index.md"]


def _names_in(text: str, names: set[str]) -> set[str]:
    """The results files of ``names`` that ``text`` cites (by path, pattern or bare file name)."""
    found = set()
    for match in CITED.finditer(text):
        for alternative in expand(match.group(0).rstrip(".,;:)")):
            if alternative.rstrip("/") == "results":  # the folder itself names no file
                continue
            found.update(name for name in names if fnmatch.fnmatch(name, alternative)
                         or (alternative.endswith("/") and name.startswith(alternative)))
    for match in ABBREVIATED.finditer(text):  # "..._run{1,2}.json": a file named like the citation before it
        for tail in expand(match.group(1).rstrip(".,;:)")):
            found.update(name for name in names if fnmatch.fnmatch(Path(name).name, "*" + tail))
    found.update(name for name in names if Path(name).name in text)
    return found


def uncited_results(names: list[str]) -> list[str]:
    """``names`` (results files) that nothing cites: docs, CHANGELOG, code, or (transitively) a cited results file."""
    pending = set(names)
    sources = [*DOC_FILES, ROOT / "CHANGELOG.md"]
    sources += [path for folder in CITING_FOLDERS for path in (ROOT / folder).rglob("*")
                if path.suffix in TEXT_SUFFIXES and path.is_file() and "__pycache__" not in path.parts]
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in sources]
    cited = set().union(*(_names_in(text, pending) for text in texts))
    frontier = cited
    while frontier:  # a cited summary cites its raw files
        pending -= frontier
        texts = [(ROOT / name).read_text(encoding="utf-8", errors="replace") for name in frontier
                 if Path(name).suffix in TEXT_SUFFIXES and (ROOT / name).is_file()]
        frontier = set().union(set(), *(_names_in(text, pending) for text in texts))
    return sorted(pending)


def test_uncited_results_are_found():
    """The check can fail: a results name nobody mentions is reported, a cited one is not."""
    cited = cited_paths()[0][2]
    name = next(alt for alt in expand(cited) if "*" not in alt)
    assert uncited_results([name, "results/never_cited_2000-01-01.json"]) == ["results/never_cited_2000-01-01.json"]


def test_every_results_file_is_cited():
    names = tracked_results()
    if names is None:
        pytest.skip("not a git checkout: which results files are committed is unknown")
    bad = uncited_results(names)
    assert not bad, ("results files that no doc, code or cited results file cites (cite them where their numbers are "
                     "used, or delete them):\n" + "\n".join(bad))
