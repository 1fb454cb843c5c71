"""Helpers of the serving tests: the plain model.generate oracle, the batching engine's request builders and event
sink, small CPU pools, gates and slow-downs hooked on a model's forward. The fixtures built on them (tiny models,
engines, managers, servers) live in tests/serving/conftest.py.
"""

from __future__ import annotations

import threading
import time

import torch

from hf_rocketkv import KVBlockPool, RocketKVCache
from hf_rocketkv.cache import PackedStepCache
from hf_rocketkv.serving import FinishReason, SamplingParams
from hf_rocketkv.serving.engines.interface import EngineRequest
from tests.support.tiny_models import compressing_config, cpu_pool, greedy, random_ids


class ForwardGate:
    """A forward pre-hook: every forward waits until ``open()``; optionally sleeps ``delay`` s and counts calls.

    Used to hold the engine inside a request (queue / overload tests) and to slow decoding down so a disconnect or a
    cancel lands mid-generation.
    """

    def __init__(self, model, delay: float = 0.0, closed: bool = False):
        self.delay = delay
        self.calls = 0
        self.entered = threading.Event()  # set when a forward has started
        self._open = threading.Event()
        if not closed:
            self._open.set()
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1
        self.entered.set()
        self._open.wait(30)
        if self.delay:
            time.sleep(self.delay)

    def open(self) -> None:
        self._open.set()

    def remove(self) -> None:
        self._open.set()
        self._handle.remove()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def oracle_tokens(model, prompt_ids, config, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """What model.generate produces alone for one prompt with a fresh RocketKVCache (greedy)."""
    ids = torch.tensor([list(prompt_ids)])
    out = greedy(model, ids, max_new_tokens, cache=RocketKVCache(config), eos_token_id=eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def prompts(count: int, base: int = 28) -> list[list[int]]:
    """Prompts of different lengths, all over the compression budget (24)."""
    return [random_ids(1, base + 3 * i, seed=10 + i)[0].tolist() for i in range(count)]


# the batching engine's config: prompts over 24 tokens are compressed; decode reads 3 pages
CFG = compressing_config(kt_cache_dtype="float32")


class Events:
    """A thread-safe sink: every event, and a condition to wait for final events."""

    def __init__(self):
        self.events = []
        self.cond = threading.Condition()

    def __call__(self, event) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def finals(self, request_id=None):
        with self.cond:
            return [e for e in self.events if e.finish_reason is not None
                    and (request_id is None or e.request_id == request_id)]

    def tokens(self, request_id) -> list[int]:
        with self.cond:
            return [t for e in self.events if e.request_id == request_id for t in e.token_ids]

    def wait_finals(self, count: int, timeout: float = 60) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len([e for e in self.events if e.finish_reason]) >= count, timeout)


def make_pool(model, page_size: int = 8, mib: float = 1.0, config=CFG) -> KVBlockPool:
    """A float32 pool of ``mib`` MiB for the served model (its weights in the prefix fingerprint)."""
    return cpu_pool(model, config, int(mib * 2**20), page_size)


def request(rid: str, prompt, max_tokens: int, **params) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, **params) if params else SamplingParams.greedy(max_tokens)
    return EngineRequest(rid, tuple(prompt), sampling, frozenset(sampling.stop_token_ids))


def prompt_of(length: int, seed: int) -> list[int]:
    return random_ids(1, length, seed=seed)[0].tolist()


PROMPTS = [(30, 9), (17, 3), (45, 12), (5, 6), (26, 1), (33, 8)]  # (prompt length, max_tokens): some under the budget


def submit_arriving(engine, lengths: list[tuple[int, int]], seed: int, prefix: str) -> list[tuple[str, list, int]]:
    """Requests of ``(prompt length, max_tokens)``, the first four at once, the rest once the engine has run three
    decode steps (they arrive while the first ones decode); returns ``(rid, prompt, max_tokens)`` in order."""
    sent = []
    for i, (length, n) in enumerate(lengths):
        prompt = prompt_of(length, seed=seed + i)
        engine.submit(request(f"{prefix}{i}", prompt, n))
        sent.append((f"{prefix}{i}", prompt, n))
        if i == 3:
            assert wait_until(lambda: engine.steps >= 3, timeout=30)
    return sent


def assert_each_alone(events, sent, oracle) -> None:
    """Every request of ``sent`` ended at its max_tokens with its tokens alone (``oracle(prompt, n)``)."""
    events.wait_finals(len(sent))
    for rid, prompt, n in sent:
        assert events.tokens(rid) == oracle(prompt, n), rid
        assert [e.finish_reason for e in events.finals(rid)] == [FinishReason.LENGTH], rid


class PackedLog:
    """A forward pre-hook: every forward as ``("packed", rows, chunk)``, ``("prefill", 0, chunk)`` or
    ``("decode", rows, 0)``, in order; ``on_forward(entry)`` runs inside the hook, before the forward."""

    def __init__(self, model, on_forward=None):
        self.entries: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()
        self.on_forward = on_forward
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs["input_ids"]
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if isinstance(cache, PackedStepCache):
            entry = ("packed", cache.rows, ids.shape[1] - cache.rows)
        elif "logits_to_keep" in kwargs:
            entry = ("prefill", 0, ids.shape[1])
        else:
            entry = ("decode", ids.shape[0], 0)
        with self.lock:
            self.entries.append(entry)
        if self.on_forward is not None:
            self.on_forward(entry)

    def kinds(self) -> list[tuple[str, int, int]]:
        with self.lock:
            return list(self.entries)

    def remove(self) -> None:
        self._handle.remove()
