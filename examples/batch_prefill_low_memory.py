"""A batch of long prompts with less prefill memory: ``RocketKVConfig(prefill_batch_size=...)``.

    python examples/batch_prefill_low_memory.py

generate() prefills the batch one row at a time, compresses each row to ``prompt_budget`` tokens per KV head, then
decodes all rows together. The tokens are the same as with one prefill forward; the peak memory of prefill is one
row's instead of the batch's (on a GPU this prints torch.cuda.max_memory_allocated for both).
"""

import torch

from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.eval.haystack import haystack_text
from hf_rocketkv.models import load_model_and_tokenizer


def generate(model, batch, config: RocketKVConfig) -> tuple[torch.Tensor, float | None]:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    out = model.generate(**batch, cache=RocketKVCache(config), max_new_tokens=24, do_sample=False)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return out, peak


def main() -> None:
    model, tokenizer = load_model_and_tokenizer()  # attn_implementation="rocketkv"
    if torch.cuda.is_available():
        model = model.cuda()
    chats = [[{"role": "user", "content": haystack_text(chars, seed=seed) + "\n\nWhat is this text about?"}]
             for seed, chars in enumerate((4000, 3000, 5000))]
    tokenizer.padding_side = "left"  # RocketKV needs left padding
    batch = tokenizer.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_tensors="pt",
                                          return_dict=True).to(model.device)

    base = RocketKVConfig(prompt_budget=512, topk=32, page_size=4)
    one_forward, peak_all = generate(model, batch, base)
    by_rows, peak_rows = generate(model, batch, base.replace(prefill_batch_size=1))
    print(f"prompt tokens per row: {batch['attention_mask'].sum(dim=1).tolist()}")
    print(f"same tokens with prefill_batch_size=1: {torch.equal(one_forward, by_rows)}")
    if peak_all is not None:
        print(f"peak memory: {peak_all:.2f} GiB in one forward, {peak_rows:.2f} GiB one row at a time")
    for row in tokenizer.batch_decode(by_rows[:, batch["input_ids"].shape[1]:], skip_special_tokens=True):
        print("->", row.strip()[:100])


if __name__ == "__main__":
    main()
