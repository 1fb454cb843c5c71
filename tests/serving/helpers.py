"""Helpers of the serving tests: a character-level tokenizer matching the tiny random models' 128-token vocabulary
(so HTTP tests run on a model that takes milliseconds per token), gates and slow-downs hooked on a model's forward,
and the openai client against a server on 127.0.0.1.
"""

from __future__ import annotations

import threading
import time

from tests.support.tiny_models import EOS, PAD, VOCAB

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
