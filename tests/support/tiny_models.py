"""Tiny random models (Llama, Mistral, Qwen2, Qwen3) on both attentions, RocketKV configs, generate helpers, CPU
pools sized for the models and a character tokenizer matching their 128-token vocabulary (so HTTP and CLI tests run
on a model that takes milliseconds per token).

Everything runs on CPU with the PyTorch reference backend (``backend="torch"``). Models are built from configs with
random weights (a fixed seed), so nothing is downloaded. The fixtures built on them (``model``, ``llama_pair``) live
in tests/conftest.py.
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import hf_rocketkv
from hf_rocketkv import KVBlockPool, RocketKVCache, RocketKVConfig
from hf_rocketkv.integration.compat import cache_kwargs

PAD, BOS, EOS = 0, 1, 2
VOCAB = 128

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),  # per-head q/k RMSNorm
}

BASE_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
)


def tiny_config(arch: str = "llama", **overrides):
    config_cls, _ = ARCHS[arch]
    kwargs = {**BASE_CONFIG, **overrides}
    if arch == "mistral":
        kwargs.setdefault("sliding_window", None)
    return config_cls(**kwargs)


def paired_models(model_cls, config, oracle_attention: str, seed: int = 0, prepare_oracle=None):
    """``(rocket, oracle)``: one random ``model_cls(config)`` on ``oracle_attention`` (``prepare_oracle(oracle)`` may
    reinitialise some of its weights first) and the same weights on ``rocketkv`` attention, each with its own copy
    of the config (``set_attn_implementation`` writes to it)."""
    torch.manual_seed(seed)
    oracle = model_cls(copy.deepcopy(config)).eval()
    oracle.set_attn_implementation(oracle_attention)
    if prepare_oracle is not None:
        prepare_oracle(oracle)
    rocket = model_cls(copy.deepcopy(config)).eval()
    rocket.load_state_dict(oracle.state_dict())
    hf_rocketkv.enable(rocket)
    return rocket, oracle


def make_models(arch: str = "llama", seed: int = 0, **overrides):
    """``(rocket, sdpa)``: two copies of one random tiny model, one on ``rocketkv`` attention, one on ``sdpa``.

    Each model gets its own config object (``set_attn_implementation`` writes to the config, which would otherwise be
    shared).
    """
    _, model_cls = ARCHS[arch]
    rocket, sdpa = paired_models(model_cls, tiny_config(arch, **overrides), "sdpa", seed)
    assert rocket.config._attn_implementation == hf_rocketkv.ATTN_NAME
    assert sdpa.config._attn_implementation == "sdpa"
    return rocket, sdpa


def random_ids(batch: int, length: int, seed: int = 1, low: int = 3) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (batch, length), generator=generator)


def left_pad(rows: list[torch.LongTensor]) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Left-pad 1-D id tensors into a batch; returns ``(input_ids, attention_mask)``."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, length - len(r) :] = r
        mask[i, length - len(r) :] = 1
    return ids, mask


def greedy(model, input_ids, max_new_tokens: int = 12, **kwargs):
    """Greedy generate with no early stop (eos disabled), so every run produces exactly ``max_new_tokens``."""
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("eos_token_id", None)
    kwargs.setdefault("pad_token_id", PAD)
    with torch.no_grad():
        return model.generate(input_ids, max_new_tokens=max_new_tokens, **kwargs)


def greedy_with_logits(model, ids, mask, cache, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy`` of a padded batch into ``cache``: (sequences, every step's logits as fp32 ``[steps, B, vocab]``)."""
    out = greedy(model, ids, max_new_tokens=new_tokens, attention_mask=mask, **cache_kwargs(cache),
                 output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits).float()


def padded_batch(lengths, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows of ``lengths`` tokens (seeds 3, 4, ...) left-padded into ``(input_ids, attention_mask)`` on
    ``device``."""
    rows = [random_ids(1, n, seed=3 + i)[0] for i, n in enumerate(lengths)]
    return tuple(t.to(device) for t in left_pad(rows))


def keep_all_config(**overrides) -> RocketKVConfig:
    """Nothing is evicted (budget above any test prompt) and every KT page is attended: RocketKV == dense."""
    kwargs = dict(
        prompt_budget=512, window_size=8, kernel_size=5, topk=4096, topr=16, page_size=4,
        kt_cache_dtype="float32", backend="torch",
    )
    kwargs.update(overrides)
    return RocketKVConfig(**kwargs)


def compressing_config(**overrides) -> RocketKVConfig:
    """Prompts longer than 24 tokens are evicted down to 24; decode attends 3 pages of 4 tokens."""
    kwargs = dict(
        prompt_budget=24, window_size=8, kernel_size=5, topk=3, topr=8, page_size=4,
        kt_cache_dtype="bfloat16", backend="torch",
    )
    kwargs.update(overrides)
    return RocketKVConfig(**kwargs)


def check_padded_batch_and_chunked_prefill(rocket, oracle) -> None:
    """A left-padded batch of 37- and 21-token prompts, in one forward and in chunks of 6, gives ``oracle``'s
    greedy tokens (nothing evicted: ``keep_all_config``)."""
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (37, 21)])
    expected = greedy(oracle, ids, attention_mask=mask, max_new_tokens=10)
    batch = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(keep_all_config()),
                   max_new_tokens=10)
    assert torch.equal(batch, expected)
    chunked = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(keep_all_config()),
                     max_new_tokens=10, prefill_chunk_size=6)
    assert torch.equal(chunked, expected)


def compressed_padded_batch(rocket, new_tokens: int = 8):
    """``(rows, ids, mask, cache, out)``: prompts of 50 and 33 tokens, left-padded, greedy on a compressing cache."""
    rows = [random_ids(1, n, seed=n)[0] for n in (50, 33)]
    ids, mask = left_pad(rows)
    cache = RocketKVCache(compressing_config())
    out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens)
    return rows, ids, mask, cache, out


def cpu_pool(model_or_config, config: RocketKVConfig, max_bytes: int = 4 << 20, page_size: int = 8,
             dtype=torch.float32, **kwargs) -> KVBlockPool:
    """A KVBlockPool on the CPU for a tiny model: ``max_bytes`` of ``dtype`` pages of ``page_size`` tokens, its KT slab
    matching ``config`` (KT page size and dtype). ``model_or_config`` as KVBlockPool takes it: a model's weights
    enter the prefix fingerprint, a config's do not."""
    kwargs.setdefault("device", "cpu")
    return KVBlockPool(model_or_config, max_gpu_bytes=max_bytes, page_size=page_size, dtype=dtype,
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, **kwargs)


def dynamic_cache_bytes(cache) -> int:
    """Bytes of the K/V tensors of a transformers DynamicCache."""
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def teacher_forced_logits(model, ids, tokens, config):
    """Independent replay: prefill ``ids`` with a fresh RocketKVCache, then feed ``tokens`` [B, n] one at a time with
    plain forwards; returns the logits before each token, [B, n, V] (the last entry predicts nothing we check)."""
    cache = RocketKVCache(config)
    steps = []
    with torch.no_grad():
        logits = model(ids, **cache_kwargs(cache)).logits[:, -1]
        for i in range(tokens.shape[1]):
            steps.append(logits)
            logits = model(tokens[:, i : i + 1], **cache_kwargs(cache)).logits[:, -1]
    return torch.stack(steps, dim=1)


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def char_tokenizer():
    """One token per ASCII character (ids 3..127), <pad>=0, <s>=1, </s>=2, with a tiny chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": 1, "</s>": EOS}
    vocab.update({chr(i): i for i in range(3, VOCAB)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
