"""One timed greedy ``model.generate`` call as the CLI runs it: a prefill progress bar, streamed text, step times.

    result = timed_generate(model, tokenizer, input_ids, cache, attn_implementation="rocketkv",
                            max_new_tokens=32, prefill_chunk_size=512, label="RocketKV", progress=True)
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TextStreamer

from ..integration import compat


@dataclass
class TimedRun:
    """What one generate call produced and how long it took.

    new_ids:      generated token ids of the single row (EOS included when generation stopped on it)
    prefill_s:    from the call to the first token's logits (stage 1 included for RocketKV)
    step_times:   perf_counter() right after each new token's forward, one per token
    """

    label: str
    new_ids: list[int]
    start: float
    step_times: list[float] = field(default_factory=list)

    @property
    def prefill_s(self) -> float:
        return self.step_times[0] - self.start if self.step_times else float("nan")

    @property
    def decode_steps(self) -> int:
        return max(len(self.step_times) - 1, 0)

    @property
    def ms_per_token(self) -> float | None:
        """Mean time of the decode steps after the first token (None when only one token was generated)."""
        if self.decode_steps == 0:
            return None
        return 1000 * (self.step_times[-1] - self.step_times[0]) / self.decode_steps


class StepClock(LogitsProcessor):
    """generate() calls a logits processor once per new token, right after that token's forward."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


class PrefillProgress:
    """A tqdm bar over the prompt's tokens, advanced after each prefill forward (one per chunk).

    A forward hook on the model sees the forwards generate() makes; it removes itself once the prompt is done, so
    decode steps (which generate() may compile) never run it. ``when_done`` runs once, right after the bar closes
    (the CLI prints the answer's label there, so the bar on stderr and the streamed answer on stdout never share a
    line).
    """

    def __init__(self, model: torch.nn.Module, total: int, desc: str, enabled: bool, when_done=None):
        self.model, self.total, self.desc, self.enabled = model, total, desc, enabled
        self.when_done = when_done
        self.done = 0

    def __enter__(self) -> "PrefillProgress":
        from tqdm import tqdm

        self.bar = tqdm(
            total=self.total, desc=self.desc, unit="tok", disable=not self.enabled, file=sys.stderr, dynamic_ncols=True
        )
        self.handle = self.model.register_forward_hook(self.after_forward, with_kwargs=True)
        return self

    def after_forward(self, module, args, kwargs, output) -> None:
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None and args:
            tokens = args[0]
        step = min(tokens.shape[1] if tokens is not None else self.total, self.total - self.done)
        self.done += step
        self.bar.update(step)
        if self.done >= self.total:
            self.finish()

    def finish(self, announce: bool = True) -> None:
        if self.bar is None:
            return
        self.handle.remove()
        self.bar.close()
        self.bar = None
        if announce and self.when_done is not None:
            self.when_done()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(announce=exc_type is None)


def timed_generate(
    model,
    tokenizer,
    input_ids: torch.Tensor,  # [1, prompt_tokens]
    cache,
    *,
    attn_implementation: str,
    max_new_tokens: int,
    prefill_chunk_size: int,
    label: str,
    progress: bool,
    stream: bool = True,
) -> TimedRun:
    """Greedy generate on ``cache`` with ``attn_implementation``; prints ``label:`` and the streamed answer."""
    model.set_attn_implementation(attn_implementation)
    device = input_ids.device
    clock = StepClock(device)
    prompt_tokens = input_ids.shape[1]
    chunk = prefill_chunk_size if 0 < prefill_chunk_size < prompt_tokens else None
    # clean_up_tokenization_spaces=False: BPE tokenizers ignore the clean-up anyway, and 5.17 warns when it is asked
    decode = dict(skip_special_tokens=True, clean_up_tokenization_spaces=False)
    streamer = TextStreamer(tokenizer, skip_prompt=True, **decode) if stream else None
    def print_label():
        print(f"{label}:", end=" ", flush=True)

    with PrefillProgress(model, prompt_tokens, f"prefill, {label}", progress, when_done=print_label):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                **compat.cache_kwargs(cache),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                prefill_chunk_size=chunk,
                logits_processor=LogitsProcessorList([clock]),
                pad_token_id=tokenizer.pad_token_id,
                streamer=streamer,
            )
    if streamer is None:
        print(tokenizer.decode(out[0, prompt_tokens:], **decode), flush=True)
    return TimedRun(label, out[0, prompt_tokens:].tolist(), start, clock.times)
