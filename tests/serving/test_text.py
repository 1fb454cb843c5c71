"""Text of streamed outputs: incremental detokenization, stop strings, the request queue."""

from __future__ import annotations

import pytest

from hf_rocketkv.serving import EngineStopped, FinishReason, Overloaded, SamplingParams
from hf_rocketkv.serving.detokenizer import IncrementalDetokenizer
from hf_rocketkv.serving.engines.interface import EngineRequest
from hf_rocketkv.serving.engines.request_queue import RequestQueue
from hf_rocketkv.serving.output_processor import RequestOutputProcessor
from hf_rocketkv.serving.stop_strings import StopStringMatcher

TEXT = "Café ☕ costs 3€ — naïve 東京 test 🚀🚀 done.\nNew line  two  spaces."


def test_incremental_detokenization_equals_full_decode(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok("The answer:").input_ids
    ids = tok(TEXT, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)  # split multi-byte characters are held until complete
    assert sum(1 for p in pieces if p) > len(TEXT) // 4  # and it really streams


def test_an_incomplete_character_at_the_end_is_dropped(smollm2_tokenizer):
    """max_tokens can cut a character in two: the text ends before it instead of in U+FFFD (half its bytes)."""
    tok = smollm2_tokenizer
    ids = tok("🚀", add_special_tokens=False).input_ids
    assert len(ids) > 1 and tok.decode(ids[:-1]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:-1]) == ""
    assert detok.flush() == ""
    whole = tok("Café 🚀", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([t]) for t in whole[:-1]] + [detok.flush()]
    assert "".join(pieces) == "Café "


def test_stop_string_matcher():
    matcher = StopStringMatcher(["END", "\n\n"])
    assert matcher.find("abc END", 0) == 4
    assert matcher.find("abcEN", 0) is None
    assert matcher.find("xxEND", 4) == 2  # an occurrence completed by the new text
    assert matcher.held_back("hello E") == 1 and matcher.held_back("hello EN") == 2
    assert matcher.held_back("hello\n") == 1 and matcher.held_back("hello") == 0
    assert StopStringMatcher([]).held_back("abc") == 0


def feed(processor, tokenizer, text):
    outputs = []
    for t in tokenizer(text, add_special_tokens=False).input_ids:
        outputs.append(processor.on_tokens([t]))
        if outputs[-1].finished:
            break
    return outputs


@pytest.mark.parametrize("stop, expected", [
    (["costs"], "Café ☕ "), (["🚀"], "Café ☕ costs 3€ — naïve 東京 test "), (["\n"], TEXT.split("\n")[0]),
    (["zzz", "naï"], "Café ☕ costs 3€ — "),
])
def test_stop_strings_cut_the_text_and_never_leak(smollm2_tokenizer, stop, expected):
    processor = RequestOutputProcessor("r", [1, 2], stop, frozenset(), smollm2_tokenizer)
    outputs = feed(processor, smollm2_tokenizer, TEXT)
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert "".join(o.text for o in outputs) == expected
    for i in range(len(outputs)):  # no prefix of the stream contains the beginning of the stop string past the cut
        assert "".join(o.text for o in outputs[: i + 1]) == expected[: len("".join(o.text for o in outputs[: i + 1]))]
    with pytest.raises(RuntimeError):
        processor.on_tokens([5])


def test_without_stop_the_text_is_complete(smollm2_tokenizer):
    processor = RequestOutputProcessor("r", [1], ["NOPE"], frozenset([0]), smollm2_tokenizer)
    outputs = feed(processor, smollm2_tokenizer, TEXT)
    outputs.append(processor.on_tokens([0]))  # a stop token id: counted, no text
    outputs.append(processor.on_finish(FinishReason.STOP))
    assert "".join(o.text for o in outputs) == TEXT
    assert outputs[-1].completion_tokens == len(processor.token_ids) and processor.token_ids[-1] == 0
    assert processor.result().text == TEXT


# ------------------------------------------------------------------------------------------------ queue
def request(i: int) -> EngineRequest:
    return EngineRequest(f"r{i}", (1, 2), SamplingParams(), frozenset())


def test_request_queue_bound_order_removal_and_close():
    queue = RequestQueue(2)
    queue.put(request(0))
    queue.put(request(1))
    with pytest.raises(Overloaded):
        queue.put(request(2))
    assert queue.remove("r0").request_id == "r0" and queue.remove("r0") is None
    with pytest.raises(ValueError, match="already waiting"):
        queue.put(request(1))
    queue.put(request(3))
    assert [queue.get(0).request_id, queue.get(0).request_id] == ["r1", "r3"]
    assert queue.get(0) is None
    queue.put(request(4))
    queue.close()
    with pytest.raises(EngineStopped):
        queue.put(request(5))
    assert queue.get(0).request_id == "r4"  # admitted requests still come out after close
    assert queue.get() is None  # closed and empty: no blocking
    with pytest.raises(ValueError, match="max_queue"):
        RequestQueue(0)


@pytest.mark.parametrize("text", ["a\ud800b", "\udfff", "ok \ud83d"])
def test_a_lone_surrogate_is_an_invalid_prompt(text):
    """Found by fuzzing the server (tests/serving/test_fuzz.py): JSON's "\\ud800" escape is a lone surrogate in
    Python, which the tokenizer refused with a TypeError (the server answered 500). Now a 400 naming the field."""
    from hf_rocketkv.serving import InvalidRequest
    from hf_rocketkv.serving.prompts import encode_chat, encode_text
    from tests.support.tiny_models import char_tokenizer

    tokenizer = char_tokenizer()
    with pytest.raises(InvalidRequest, match="lone surrogate") as err:
        encode_text(tokenizer, text)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequest, match="lone surrogate") as err:
        encode_chat(tokenizer, [{"role": "user", "content": text}])
    assert err.value.param == "messages"
    assert encode_text(tokenizer, "a\U0001f680b") == tokenizer("a\U0001f680b").input_ids  # a real pair is fine
