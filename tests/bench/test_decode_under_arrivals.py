"""benchmarks.decode_under_arrivals --quick on the CPU: the script's logic (settings, windows, the report's fields),
not its timings. Every setting's engine serves the running requests and the arriving long prompts, prefills them in
one forward or in the chunks its setting names, and gives every page back."""

from __future__ import annotations

import json
import math

from benchmarks import decode_under_arrivals


def test_quick_run_measures_every_setting(tmp_path):
    rc = decode_under_arrivals.main(["--quick", "--settings", "one,128:32", "--alone-s", "0.5", "--out",
                                     str(tmp_path)])
    report = json.loads((tmp_path / "decode_under_arrivals.json").read_text())
    assert rc == 0, report
    for field in ("device", "date", "commit", "command"):
        assert report[field], field
    assert report["command"].startswith("python -m benchmarks.decode_under_arrivals --quick")
    args = report["args"]
    settings = report["settings"]
    assert list(settings) == ["one", "chunk128_budget32"]
    for label, chunks in (("one", args["arrivals"]),
                          ("chunk128_budget32", args["arrivals"] * math.ceil(args["long_prompt"] / 128))):
        result = settings[label]
        assert "error" not in result and not result["errors"], result
        assert result["pages_back"], label
        assert result["arrivals"]["prefill_chunks"] == chunks, label
        for window in ("alone", "arrivals"):  # a request gets at most one token per decode step of the window
            steps, rate = result[window]["decode_steps"], result[window]["per_user_tokens_per_s_p50"]
            assert steps > 0 and 0 < rate * result[window]["window_s"] <= steps + 1, (label, window)
        assert result["rate_ratio"] == (result["arrivals"]["per_user_tokens_per_s_p50"]
                                        / result["alone"]["per_user_tokens_per_s_p50"]), label
        # the arrivals window ends when the last long prompt has its first token: every TTFT lies inside it
        assert all(0 < t <= result["arrivals"]["window_s"] for t in result["arrivals"]["long_ttft_s"]), label
    assert settings["one"]["prefill_chunk_tokens"] == args["long_prompt"]
    assert settings["chunk128_budget32"]["prefill_token_budget"] == 32


def test_settings_are_parsed_or_refused_naming_the_flag():
    assert decode_under_arrivals.parse_settings("one, 2048:512, 512:512:packed") == [
        ("one", None, None, False), ("chunk2048_budget512", 2048, 512, False),
        ("chunk512_budget512_packed", 512, 512, True)]
    for bad in ("", "2048", "a:b", "512:512:pack"):
        try:
            decode_under_arrivals.parse_settings(bad)
        except SystemExit as err:
            assert "--settings" in str(err)
        else:
            raise AssertionError(f"{bad!r} was accepted")
