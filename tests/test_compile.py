"""Static-shape decode under torch.compile (inductor on CPU; generate compiles decode steps by itself).

transformers compiles decode steps for caches whose ``is_compileable`` is True: on CUDA by default, elsewhere only
with ``compile_config._compile_all_devices``. These tests force that path on CPU so CI guards it: same tokens as
eager, one graph, no recompile across decode steps, none for a second request of the same shapes.
"""

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils
from transformers import CompileConfig

from hf_rocketkv import RocketKVCache

from .helpers import compressing_config, greedy, left_pad, make_models, random_ids


def _compile_config() -> CompileConfig:
    config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
    config._compile_all_devices = True
    return config


@pytest.mark.slow
def test_compiled_decode_matches_eager_without_recompiles():
    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    rows = [random_ids(1, 40, seed=3)[0], random_ids(1, 33, seed=4)[0]]
    ids, mask = left_pad(rows)
    # float32 KT: inductor fuses the reference's "round q to the KT dtype" cast away (it does not emulate
    # precision casts by default), so bf16/fp8 KT scores differ from eager by that rounding and can flip a page tie.
    config = compressing_config(kt_cache_dtype="float32")
    eager_cache = RocketKVCache(config)
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, past_key_values=eager_cache,
                   disable_compile=True)
    assert eager_cache.kept_tokens(0).max() > 0 and eager_cache.is_compressed

    dynamo_utils.counters.clear()
    compiled = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6,
                      past_key_values=RocketKVCache(config), compile_config=_compile_config())
    assert torch.equal(compiled, eager)
    graphs_after_first = dynamo_utils.counters["stats"]["unique_graphs"]
    assert graphs_after_first == 1, dict(dynamo_utils.counters["stats"])  # fullgraph, no recompile per step

    again = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6,
                   past_key_values=RocketKVCache(config), compile_config=_compile_config())
    assert torch.equal(again, eager)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs_after_first  # second request: no recompile
    assert not dynamo_utils.counters["recompiles"]


def test_cache_is_compileable_unless_prefill_is_chunked():
    cache = RocketKVCache(compressing_config())
    assert cache.is_compileable
    cache.hints.defer_compression = True
    assert not cache.is_compileable
