"""The server on the embedded SmolLM2-135M-Instruct (real weights, real tokenizer and chat template) with the real
``openai`` client: chat (streaming) and completions (not streaming) at the same time, each equal to model.generate
alone with the same RocketKV config (greedy), prompts long enough that stage 1 evicts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hf_rocketkv import RocketKVCache, RocketKVConfig

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

CONFIG = RocketKVConfig(prompt_budget=64, window_size=16, kernel_size=7, topk=8, topr=64, page_size=4)
STORY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his father had "
         "taught him, and lit the great lamp so that ships passing the rocky point would know where the danger lay. ")
N = 8


def alone(model, ids) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, cache=RocketKVCache(CONFIG), max_new_tokens=N, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_chat_and_completions_on_smollm2(smollm2):
    from hf_rocketkv.serving import GenerationManager, create_app
    from hf_rocketkv.serving.http.background import ServerThread

    model, tokenizer = smollm2
    messages = [{"role": "user", "content": STORY * 2 + "What did the keeper do every evening?"}]
    prompt = STORY * 2 + "Every evening, the keeper"
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                             return_tensors="pt")["input_ids"]
    text_ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert chat_ids.shape[1] > CONFIG.prompt_budget and text_ids.shape[1] > CONFIG.prompt_budget
    expected_chat = tokenizer.decode(alone(model, chat_ids), skip_special_tokens=True)
    expected_text = tokenizer.decode(alone(model, text_ids), skip_special_tokens=True)

    manager = GenerationManager(model, tokenizer, CONFIG)
    try:
        with ServerThread(create_app(manager, "smollm2")) as server:
            api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

            def chat():
                stream = api.chat.completions.create(model="smollm2", messages=messages, max_tokens=N,
                                                     temperature=0, stream=True)
                return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

            def completion():
                return api.completions.create(model="smollm2", prompt=prompt, max_tokens=N,
                                              temperature=0).choices[0].text

            with ThreadPoolExecutor(2) as pool:
                got_chat, got_text = pool.submit(chat), pool.submit(completion)
                assert got_chat.result() == expected_chat
                assert got_text.result() == expected_text
    finally:
        manager.stop(drain=False)
