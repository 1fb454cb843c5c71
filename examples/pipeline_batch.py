"""pipeline() with RocketKV: each call gets a fresh cache built from the model's RocketKV config.

    python examples/pipeline_batch.py
"""

from transformers import pipeline

import hf_rocketkv
from hf_rocketkv import RocketKVConfig
from hf_rocketkv.models import load_model_and_tokenizer


def main() -> None:
    model, tokenizer = load_model_and_tokenizer()
    hf_rocketkv.enable(model, RocketKVConfig(prompt_budget=128, topk=8, page_size=4))
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    prompts = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Name three primary colours."}],
    ]
    for result in pipe(prompts, max_new_tokens=24, do_sample=False):
        print(result[0]["generated_text"][-1]["content"])


if __name__ == "__main__":
    main()
