"""Fixtures of the tests of the hf-rocketkv command: tiny random Llamas saved with the SmolLM2 tokenizer (so chat
templates and real text work), and the process state the command changes put back after every test."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def save_tiny_llama(folder, tokenizer, max_position_embeddings: int):
    """A tiny random Llama (seed 0) with ``tokenizer``'s vocabulary, saved with the tokenizer in ``folder``."""
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer):
    """The tiny Llama with 4096 positions."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_smollm2_vocab"), smollm2_tokenizer, 4096)


@pytest.fixture(scope="module")
def short_model_dir(tmp_path_factory, smollm2_tokenizer):
    """The tiny Llama with only 64 positions."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_64_positions"), smollm2_tokenizer, 64)


@pytest.fixture(autouse=True)
def restore_process_state(monkeypatch):
    """main() sets torch's thread count for the whole process (with OMP_NUM_THREADS set it leaves it alone, so the
    pytest worker keeps its own setting; tests that pass --threads still set it), and use_compile_cache() sets two
    environment variables: all of it is put back."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    for key in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])
        else:
            monkeypatch.delenv(key, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
