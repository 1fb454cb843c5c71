"""benchmarks/serve_streams.py without a server: its bounds, the commit it records for a tree, and the summary it
writes over several runs (the fields scripts/index_results.py reads, and whether the runs' texts agree)."""

from __future__ import annotations

import subprocess

import pytest

from benchmarks.serve_streams import commit_of, parse_args, summarise


def run(commit: str, texts: list[str], wall: float) -> dict:
    return {"date": "2026-11-27T10:00:00+00:00", "commit": commit, "command": "hf-rocketkv serve --port 0",
            "wall_s": wall, "last_first_token_s": wall / 2, "first_token_s_median": wall / 4,
            "completion_tokens": 3 * len(texts), "errors": 0, "records": [{"text": t} for t in texts]}


def test_summary_names_every_run_and_compares_their_texts():
    machine = {"cpu": "AMD EPYC", "cpus": 2}
    data = summarise({"machine": machine, "runs": {"before": run("aaa1111", ["x", "y"], 200.0),
                                                    "after": run("bbb2222", ["x", "y"], 10.0)}})
    assert data["device"] == "CPU (AMD EPYC, 2 CPUs)" and data["date"] == "2026-11-27"
    assert data["commit"] == "before: aaa1111, after: bbb2222"
    assert data["summary"]["after"]["wall_s"] == 10.0 and data["texts_identical"] is True
    assert list(data)[-1] == "runs"  # the records come last
    data["runs"]["other"] = run("ccc3333", ["x", "z"], 5.0)
    assert summarise(data)["texts_identical"] is False
    one = summarise({"machine": machine, "runs": {"after": run("bbb2222", ["x"], 1.0)}})
    assert "texts_identical" not in one


def test_stream_count_is_bounded(capsys):
    assert parse_args(["--label", "a", "--output", "o.json"]).streams == 8
    with pytest.raises(SystemExit):
        parse_args(["--label", "a", "--output", "o.json", "--streams", "100"])


@pytest.mark.parametrize("argv", [["--max-tokens", "0"], ["--time-limit", "0"], ["--start-timeout", "-1"]])
def test_other_bounds_are_checked(argv):
    with pytest.raises(SystemExit):
        parse_args(["--label", "a", "--output", "o.json", *argv])


def test_a_tree_with_package_changes_is_marked(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    (tmp_path / "hf_rocketkv").mkdir()
    (tmp_path / "hf_rocketkv" / "a.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    clean = commit_of(str(tmp_path))
    assert len(clean) >= 7 and "uncommitted" not in clean
    (tmp_path / "notes.txt").write_text("outside the package\n")
    assert commit_of(str(tmp_path)) == clean
    (tmp_path / "hf_rocketkv" / "a.py").write_text("x = 2\n")
    assert commit_of(str(tmp_path)) == f"{clean} with uncommitted changes to hf_rocketkv/"
    assert commit_of(str(tmp_path / "nowhere")).startswith("unknown")
