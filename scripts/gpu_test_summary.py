"""The results file of one GPU test run (scripts/gpu_tests.sh): pytest's JUnit XML turned into a small JSON record.

    python scripts/gpu_test_summary.py --junit run.xml --out-dir results/gpu_tests --commit abc1234 \
        --command "python -m pytest -m gpu tests ..." --exit-status 0

The record holds the machine (GPU name and count), the UTC date, the commit, the torch / transformers / triton
versions, the command, pytest's exit status, the passed / failed / skipped / error counts and the ids of the tests
that failed or errored (with the first line of each message). It is written to
``<out-dir>/<device-slug>_<UTC date>_<commit>.json`` and its path printed. Only the standard library reads the XML.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUTCOMES = ("passed", "failed", "skipped", "error")


def test_id(classname: str, name: str, root: Path | None = None) -> str:
    """pytest's node id from a JUnit test case: ``tests.gpu.test_x.TestY`` + ``test_z[1]`` becomes
    ``tests/gpu/test_x.py::TestY::test_z[1]`` when ``root/tests/gpu/test_x.py`` exists (the longest dotted prefix
    that names a file under ``root``), else ``classname::name``."""
    parts = classname.split(".") if classname else []
    if root is not None:
        for cut in range(len(parts), 0, -1):
            module = Path(*parts[:cut]).with_suffix(".py")
            if (root / module).is_file():
                return "::".join([module.as_posix(), *parts[cut:], name])
    return f"{classname}::{name}" if classname else name


def outcome(case: ET.Element) -> str:
    """One test case's outcome: an error (setup / teardown / collection) outranks a failure, a failure a skip."""
    tags = {child.tag for child in case}
    if "error" in tags:
        return "error"
    if "failure" in tags:
        return "failed"
    if "skipped" in tags:
        return "skipped"
    return "passed"


def summarize_junit(xml_text: str, root: Path | None = None) -> dict:
    """Counts per outcome, and the failed and errored tests' ids with the first line of their messages."""
    tree = ET.fromstring(xml_text)
    counts = dict.fromkeys(OUTCOMES, 0)
    problems: dict[str, str] = {}
    for case in tree.iter("testcase"):
        result = outcome(case)
        counts[result] += 1
        if result in ("failed", "error"):
            detail = next(child for child in case if child.tag in ("error", "failure"))
            message = (detail.get("message") or detail.text or "").strip().splitlines()
            problems[test_id(case.get("classname", ""), case.get("name", ""), root)] = message[0][:300] if message else ""
    return {**counts, "total": sum(counts.values()), "failing_tests": sorted(problems), "failure_messages": problems}


def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3`` (file-name safe)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def result_path(out_dir: Path, device: str, when: datetime.datetime, commit: str) -> Path:
    return out_dir / f"{device_slug(device)}_{when.strftime('%Y-%m-%d')}_{device_slug(commit)}.json"


def machine() -> dict:
    """This machine's GPU (name of GPU 0, count) and the versions of the libraries the tests exercise."""
    def version(module: str) -> str | None:
        try:
            return __import__(module).__version__
        except Exception:  # noqa: BLE001 - a missing library is recorded as None
            return None

    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device = torch.cuda.get_device_name(0) if count else "cpu"
    except ImportError:
        count, device = 0, "cpu"
    return {"device": device, "gpu_count": count, "python": platform.python_version(), "torch": version("torch"),
            "transformers": version("transformers"), "triton": version("triton")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--junit", type=Path, required=True, help="pytest --junitxml file")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--command", default="", help="the pytest command that ran")
    parser.add_argument("--exit-status", type=int, default=None, help="pytest's exit status")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository root (test ids as file paths)")
    args = parser.parse_args(argv)
    when = datetime.datetime.now(datetime.timezone.utc)
    if args.junit.is_file():
        summary = summarize_junit(args.junit.read_text(encoding="utf-8"), args.root)
    else:  # pytest died before writing it: the record says so rather than counting nothing as a pass
        summary = {**dict.fromkeys(OUTCOMES, 0), "total": 0, "failing_tests": [],
                   "failure_messages": {}, "junit_missing": str(args.junit)}
    record = {**machine(), "date": when.isoformat(timespec="seconds"), "commit": args.commit,
              "command": args.command, "exit_status": args.exit_status, **summary}
    path = result_path(args.out_dir, record["device"], when, args.commit)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{record['device']} x{record['gpu_count']}: {summary['passed']} passed, {summary['failed']} failed, "
          f"{summary['skipped']} skipped, {summary['error']} errors -> {path}")
    for test in summary["failing_tests"]:
        print(f"  FAILED {test}: {summary['failure_messages'][test]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
