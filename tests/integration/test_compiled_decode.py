"""Static-shape decode under torch.compile (integration/compiled_decode.py, its batch and capacity buckets; inductor
on CPU; generate compiles decode steps by itself).

transformers compiles decode steps for caches whose ``is_compileable`` is True: on CUDA by default, elsewhere only
with ``compile_config._compile_all_devices``. These tests force that path on CPU so CI guards it: same tokens as
eager, one graph, no recompile across decode steps, none for a second request of the same shapes.
"""

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils
from transformers import CompileConfig

import hf_rocketkv
from hf_rocketkv import RocketKVCache
from hf_rocketkv.integration.call_state import call_state
from tests.support.decode_runners import eager_compile_config, skip_launches_on_fake_tensors, unique_graphs
from tests.support.tiny_models import compressing_config, greedy, left_pad, make_models, random_ids
from hf_rocketkv.integration.compat import output_cache


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
    config = compressing_config(kt_cache_dtype="float32")  # every KT dtype: the test below
    eager_cache = RocketKVCache(config)
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, cache=eager_cache,
                   disable_compile=True)
    assert eager_cache.kept_tokens(0).max() > 0 and eager_cache.is_compressed

    dynamo_utils.counters.clear()
    compiled = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6,
                      cache=RocketKVCache(config), compile_config=_compile_config())
    assert torch.equal(compiled, eager)
    graphs_after_first = unique_graphs()
    assert graphs_after_first == 1, dict(dynamo_utils.counters["stats"])  # fullgraph, no recompile per step

    again = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6,
                   cache=RocketKVCache(config), compile_config=_compile_config())
    assert torch.equal(again, eager)
    assert unique_graphs() == graphs_after_first  # second request: no recompile
    assert not dynamo_utils.counters["recompiles"]


@pytest.mark.slow
@pytest.mark.parametrize("kt_dtype", ["bfloat16", "float16", "float8_e5m2"])
def test_compiled_decode_with_every_kt_dtype_matches_eager(kt_dtype):
    """Narrow KT caches (fp8 is the default) compile with inductor: the missing fp8 pages are zeroed on their byte
    view (inductor's CPU code cannot promote a bool with float8), and the query is rounded to the KT dtype by
    integer arithmetic inductor keeps (it drops a plain cast's rounding), so pages score as in eager. One graph."""
    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    ids, mask = left_pad([random_ids(1, 40, seed=3)[0], random_ids(1, 33, seed=4)[0]])
    config = compressing_config(kt_cache_dtype=kt_dtype)
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, cache=RocketKVCache(config),
                   disable_compile=True)
    dynamo_utils.counters.clear()
    compiled = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, cache=RocketKVCache(config),
                      compile_config=_compile_config())
    assert torch.equal(compiled, eager)
    assert unique_graphs() == 1, dict(dynamo_utils.counters["stats"])


def test_cache_is_compileable_except_while_prefilling():
    cache = RocketKVCache(compressing_config())
    assert cache.is_compileable
    cache.hints.prefilling = True
    assert not cache.is_compileable


@pytest.mark.slow
def test_chunked_prefill_then_compiled_decode_equals_eager():
    """Chunks run eagerly (no graph per chunk shape), decode is compiled: one graph, the same tokens as eager."""
    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32")
    ids, mask = left_pad([random_ids(1, 50, seed=5)[0], random_ids(1, 37, seed=6)[0]])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, prefill_chunk_size=16)
    eager = greedy(rocket, ids, cache=RocketKVCache(config), disable_compile=True, **kwargs)
    dynamo_utils.counters.clear()
    compiled = greedy(rocket, ids, cache=RocketKVCache(config), compile_config=_compile_config(), **kwargs)
    assert torch.equal(compiled, eager)
    assert unique_graphs() == 1, dict(dynamo_utils.counters["stats"])


@pytest.mark.slow
def test_later_decode_steps_skip_guards_new_buckets_compile_and_new_prompt_lengths_do_not(monkeypatch):
    """decode_guard_checks="first_step" (opt-in): after each request's first compiled step only differentiating
    guards run. A request of another batch bucket must still get its own graph (a skipped guard would replay the
    batch-1 graph on batch-2 inputs); a new prompt length in the same buckets replays the graph it has (capacity
    and batch buckets keep every shape). The default, "every_step", never touches torch's (process-global) stance."""
    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32", decode_guard_checks="first_step",
                                decode_runner="torch_compile")
    stances = []
    original = torch.compiler.set_stance

    def spy(*args, **kwargs):
        stances.append(kwargs.get("skip_guard_eval_unsafe"))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    dynamo_utils.counters.clear()
    graphs = []
    for batch, length in ((1, 40), (2, 40), (1, 57), (2, 31)):
        ids = random_ids(batch, length, seed=batch)
        eager = greedy(rocket, ids, max_new_tokens=6, cache=RocketKVCache(config), disable_compile=True)
        stances.clear()
        cache = RocketKVCache(config)
        compiled = greedy(rocket, ids, max_new_tokens=6, cache=cache, compile_config=_compile_config())
        assert torch.equal(compiled, eager), f"batch {batch}, prompt {length}"
        assert stances == [True] * 4  # 5 decode steps: the first runs every guard
        assert call_state(cache).guards_checked
        graphs.append(unique_graphs())
    assert graphs == [1, 2, 2, 2], graphs  # batch 2 compiled its own graph; new prompt lengths compiled nothing

    stances.clear()
    every = RocketKVCache(config.replace(decode_guard_checks="every_step"))
    greedy(rocket, ids, max_new_tokens=6, cache=every, compile_config=_compile_config())
    assert stances == []
    assert compressing_config().decode_guard_checks == "every_step"  # the default


def test_compiled_step_counter_raises_when_the_store_is_full():
    from hf_rocketkv.integration.compiled_decode import count_decode_step

    rocket, _ = make_models("llama", num_hidden_layers=2)
    cache = RocketKVCache(compressing_config())
    greedy(rocket, random_ids(1, 40), max_new_tokens=3, cache=cache, disable_compile=True)
    step = {"input_ids": torch.ones(1, 1, dtype=torch.long)}
    before = [layer.host_max_length for layer in cache.layers]
    count_decode_step(cache, (), step)
    assert [layer.host_max_length for layer in cache.layers] == [n + 1 for n in before]
    count_decode_step(cache, (step["input_ids"],), {})  # input_ids passed positionally
    assert [layer.host_max_length for layer in cache.layers] == [n + 2 for n in before]
    cache.layers[1].host_max_length = cache.layers[1].capacity
    cache.layers[0].host_max_length = cache.layers[0].capacity - 1
    with pytest.raises(RuntimeError, match="layer 1 is full.*max_new_tokens"):
        count_decode_step(cache, (), step)


@pytest.mark.slow
def test_next_turn_after_compiled_decode_equals_eager():
    """The compiled steps keep the host length mirror exact, so the next (eager) turn grows the store correctly."""
    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32")
    ids = random_ids(1, 40)
    follow_up = random_ids(1, 1, seed=7)  # short: only the exact length shows the store is full
    outputs = []
    for compile_kwargs in (dict(disable_compile=True), dict(compile_config=_compile_config())):
        cache = RocketKVCache(config)
        first = greedy(rocket, ids, max_new_tokens=8, cache=cache, **compile_kwargs)
        second = greedy(rocket, torch.cat([first, follow_up], dim=1), max_new_tokens=8, cache=cache,
                        disable_compile=True)
        outputs.append(second)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.slow
def test_compiled_decode_with_a_pool_equals_eager_without_recompiles():
    """Pool pages: the decode step reads the pool's tensors through each request's table; a second request (new
    tables, a prefix hit) replays the same graph."""
    from hf_rocketkv import KVBlockPool

    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32")
    pool = KVBlockPool(rocket.config, max_gpu_bytes=1 << 20, page_size=8, dtype=torch.float32, device="cpu",
                       kt_page_size=4, kt_dtype="float32")
    ids, mask = left_pad([random_ids(1, 40, seed=3)[0], random_ids(1, 33, seed=4)[0]])
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, cache=RocketKVCache(config),
                   disable_compile=True)
    dynamo_utils.counters.clear()
    for _ in range(2):
        cache = RocketKVCache(config, pool=pool)
        compiled = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, cache=cache,
                          compile_config=_compile_config())
        assert torch.equal(compiled, eager)
        cache.close()
    assert cache.stats.reused_tokens > 0  # the second request hit the first one's prefix
    assert unique_graphs() == 1, dict(dynamo_utils.counters["stats"])
    assert not dynamo_utils.counters["recompiles"]


@pytest.mark.slow
def test_triton_backend_decode_step_traces_as_one_graph(monkeypatch):
    """backend="triton" under torch.compile on CPU: the decode step's registered ops (paged_append_token,
    paged_top_pages, paged_sparse_decode_attention) trace as one fullgraph, without a graph break, and give eager's
    tokens. Triton's interpreter cannot run on fake tensors, so while dynamo propagates them the launches are
    skipped (the ops' outputs are allocated by their launchers); the compiled graph (backend "eager") then calls the
    registered ops on real tensors, which run the kernels in the interpreter. What this covers is the Python side of
    the traced step (op schemas, the launchers' host logic, the cache's checks), not inductor's code generation."""
    from transformers import CompileConfig

    skip_launches_on_fake_tensors(monkeypatch)
    rocket, _ = make_models("llama", num_hidden_layers=1)
    ids, mask = left_pad([random_ids(1, 40, seed=3)[0], random_ids(1, 33, seed=4)[0]])
    config = compressing_config(kt_cache_dtype="float32", backend="triton", decode_runner="torch_compile")
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=4, cache=RocketKVCache(config),
                   disable_compile=True)
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend="eager")
    compile_config._compile_all_devices = True
    dynamo_utils.counters.clear()
    cache = RocketKVCache(config)
    compiled = greedy(rocket, ids, attention_mask=mask, max_new_tokens=4, cache=cache,
                      compile_config=compile_config)
    assert cache.layers[0].ops.name == "triton"
    assert torch.equal(compiled, eager)
    assert unique_graphs() == 1, dict(dynamo_utils.counters["stats"])
    assert not dynamo_utils.counters["graph_break"]


# ------------------------------------------------------------------------------------------------ buckets


def _unbucketed(config):
    """The oracle: eager decode, exact capacities, no batch padding."""
    return config.replace(decode_runner="cuda_graphs", capacity_buckets=(), batch_buckets=())


@pytest.mark.slow
def test_prompt_lengths_and_max_new_tokens_in_one_capacity_bucket_compile_nothing_new():
    """After a first call, two other prompt lengths (one shorter than prompt_budget: rows kept whole) and two other
    max_new_tokens build no graph: the store is sized prompt_budget + capacity_headroom for all of them. Tokens
    equal the eager, unbucketed run."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32", decode_runner="torch_compile", capacity_headroom=40)
    capacities = set()
    for step, (length, new) in enumerate(((40, 6), (57, 6), (13, 6), (40, 11), (40, 3))):
        ids = random_ids(1, length, seed=length)
        eager = greedy(rocket, ids, max_new_tokens=new, cache=RocketKVCache(_unbucketed(config)),
                       disable_compile=True)
        cache = RocketKVCache(config)
        out = greedy(rocket, ids, max_new_tokens=new, cache=cache, compile_config=eager_compile_config())
        assert torch.equal(out, eager), (length, new)
        capacities.add(cache.layers[0].capacity)
        assert unique_graphs() == 1, (step, length, new, dict(dynamo_utils.counters["stats"]))
    assert capacities == {24 + 40}  # prompt_budget + capacity_headroom


@pytest.mark.slow
def test_a_request_above_the_largest_capacity_bucket_gets_a_ladder_size():
    """capacity_buckets=(32,) is one configured maximum; a longer request is sized by the ladder (256), which
    compiles one more graph, and gives the tokens of the unbucketed run."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32", decode_runner="torch_compile", capacity_buckets=(32,))
    ids = random_ids(1, 40)
    for new, capacity, graphs in ((6, 32, 1), (9, 32, 1), (12, 256, 2)):
        eager = greedy(rocket, ids, max_new_tokens=new, cache=RocketKVCache(_unbucketed(config)),
                       disable_compile=True)
        cache = RocketKVCache(config)
        out = greedy(rocket, ids, max_new_tokens=new, cache=cache, compile_config=eager_compile_config())
        assert torch.equal(out, eager)
        assert cache.layers[0].capacity == capacity and unique_graphs() == graphs, (new, cache.layers[0].capacity)


def _batch(batch: int):
    return left_pad([random_ids(1, 30 + 7 * row, seed=row)[0] for row in range(batch)])


@pytest.mark.slow
def test_batch_sizes_of_one_bucket_share_a_graph_and_padding_changes_no_token():
    """Batches of 3 then 4 rows run as the bucket 4 (one graph); 5 rows as the bucket 8 (one more). Each real row's
    tokens equal the unpadded eager batch and that row alone; the caller sees its own batch in the output and in
    the cache."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32", decode_runner="torch_compile")
    for batch, graphs in ((3, 1), (4, 1), (5, 2)):
        ids, mask = _batch(batch)
        eager_cache = RocketKVCache(_unbucketed(config))
        eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=7, cache=eager_cache,
                       disable_compile=True)
        cache = RocketKVCache(config)
        out = greedy(rocket, ids, attention_mask=mask, max_new_tokens=7, cache=cache,
                     compile_config=eager_compile_config())
        assert torch.equal(out, eager), batch
        assert unique_graphs() == graphs, (batch, dict(dynamo_utils.counters["stats"]))
        assert cache.batch_size == batch and call_state(cache).token_ids.shape[0] == batch
        assert torch.equal(cache.kept_tokens(0), eager_cache.kept_tokens(0))
        assert torch.equal(cache.layers[0].lengths, eager_cache.layers[0].lengths)
    for row in range(batch):  # each row alone (no padding, no batch)
        alone_ids = ids[row : row + 1, mask[row].bool()]
        alone = greedy(rocket, alone_ids, max_new_tokens=7, cache=RocketKVCache(_unbucketed(config)),
                       disable_compile=True)
        assert torch.equal(out[row, -7:], alone[0, -7:]), row


@pytest.mark.slow
def test_padded_generate_output_and_returned_cache_hold_the_callers_rows():
    """return_dict_in_generate: sequences, scores and the returned cache are stripped to the caller's rows; a
    cache made by generate() (none passed) is padded too; the next turn continues the stripped cache."""
    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32", decode_runner="torch_compile")
    hf_rocketkv.set_config(rocket, config)
    ids, mask = _batch(3)
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=5, disable_compile=True,
                   cache=RocketKVCache(_unbucketed(config)), return_dict_in_generate=True,
                   output_scores=True)
    out = greedy(rocket, ids, attention_mask=mask, max_new_tokens=5, compile_config=eager_compile_config(),
                 return_dict_in_generate=True, output_scores=True)
    assert torch.equal(out.sequences, eager.sequences)
    assert len(out.scores) == 5 and all(s.shape[0] == 3 for s in out.scores)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out.scores, eager.scores))
    assert output_cache(out).batch_size == 3 and call_state(output_cache(out)).batch_padding is None

    follow = torch.cat([out.sequences, random_ids(3, 4, seed=9)], dim=1)
    follow_mask = torch.cat([mask, torch.ones(3, 9, dtype=mask.dtype)], dim=1)
    again = greedy(rocket, follow, attention_mask=follow_mask, max_new_tokens=4, disable_compile=True,
                   cache=output_cache(out))
    oracle = greedy(rocket, follow, attention_mask=follow_mask, max_new_tokens=4, disable_compile=True,
                    cache=output_cache(eager))
    assert torch.equal(again, oracle)


def test_batch_padding_only_where_decode_compiles_and_never_for_other_caches():
    """No padding for eager decode (disable_compile) or the cuda_graphs runner's default; explicit buckets pad; an sdpa
    model's generate() is not touched (tests/integration/test_compat.py compares whole processes)."""
    from hf_rocketkv.integration import batch_buckets

    rocket, sdpa = make_models("llama", num_hidden_layers=1)
    ids, mask = _batch(3)
    seen = []
    original = batch_buckets.prefill_real_rows

    def spy(call, cache, run):
        seen.append(call_state(cache).batch_padding)
        return original(call, cache, run)

    config = compressing_config(kt_cache_dtype="float32", decode_runner="torch_compile")
    import unittest.mock as mock

    with mock.patch("hf_rocketkv.integration.generate.prefill_real_rows", spy):
        greedy(rocket, ids, attention_mask=mask, max_new_tokens=3, cache=RocketKVCache(config),
               disable_compile=True)
        greedy(rocket, ids, attention_mask=mask, max_new_tokens=3, compile_config=eager_compile_config(),
               cache=RocketKVCache(config.replace(decode_runner="cuda_graphs")))
        assert seen == []
        greedy(rocket, ids, attention_mask=mask, max_new_tokens=3, compile_config=eager_compile_config(),
               cache=RocketKVCache(config.replace(batch_buckets=(8,))))
        assert seen == [(3, 8)]
    out = greedy(sdpa, ids, attention_mask=mask, max_new_tokens=3, compile_config=eager_compile_config())
    assert out.shape[0] == 3


@pytest.mark.slow
def test_pool_backed_caches_widen_only_the_table_and_share_one_graph():
    """With a pool, the bucket widens the block table (-1 columns) and reserves no page for it: two prompt lengths,
    one graph, the tokens of the unbucketed eager run."""
    from hf_rocketkv import KVBlockPool

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32", decode_runner="torch_compile", capacity_headroom=60)
    pool = KVBlockPool(rocket.config, max_gpu_bytes=1 << 20, page_size=8, dtype=torch.float32, device="cpu",
                       kt_page_size=4, kt_dtype="float32")
    for length in (40, 19):
        ids = random_ids(1, length, seed=length)
        eager = greedy(rocket, ids, max_new_tokens=6, cache=RocketKVCache(_unbucketed(config)),
                       disable_compile=True)
        cache = RocketKVCache(config, pool=pool)
        out = greedy(rocket, ids, max_new_tokens=6, cache=cache, compile_config=eager_compile_config())
        assert torch.equal(out, eager), length
        store = cache.layers[0].store
        assert store.capacity == 88 and sum(store.row_pages) * 8 < 88  # 24 + 60 in pool pages of 8; pages: needed
        assert unique_graphs() == 1, (length, dict(dynamo_utils.counters["stats"]))
        cache.close()


@pytest.mark.slow
def test_keep_all_history_is_bucketed_too():
    """multi_turn="keep_all": decode also appends to the whole-conversation history, whose table and positions the
    compiled step reads; it is rounded to the same buckets (the ladder above the largest), so two prompt lengths
    (both longer than prompt_budget) share a graph and give the unbucketed tokens."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32", decode_runner="torch_compile", multi_turn="keep_all")
    for length in (40, 71):
        ids = random_ids(1, length, seed=length)
        eager = greedy(rocket, ids, max_new_tokens=6, cache=RocketKVCache(_unbucketed(config)),
                       disable_compile=True)
        cache = RocketKVCache(config)
        out = greedy(rocket, ids, max_new_tokens=6, cache=cache, compile_config=eager_compile_config())
        assert torch.equal(out, eager), length
        assert cache.layers[0].history.store.capacity == 24 + 256  # prompt_budget + capacity_headroom: 40 and 71 fit
        assert unique_graphs() == 1, (length, dict(dynamo_utils.counters["stats"]))


@pytest.mark.slow
def test_compiled_decode_with_adakv_per_head_lengths_compiles_once_across_requests():
    """AdaKV's [B, Hkv] lengths: the compiled decode step reads and advances them like [B] lengths. The longest head
    differs per request (so exact capacities would differ); the torch_compile runner's capacity bucket holds every
    request here, so one graph serves requests whose heads keep other counts, with the eager, unbucketed tokens."""
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    config = compressing_config(kt_cache_dtype="float32", stage1="adakv", decode_runner="torch_compile",
                                capacity_headroom=40)
    longest, capacities = set(), set()
    for seeds in ((5, 6), (7, 8), (9, 10)):
        ids, mask = left_pad([random_ids(1, 40, seed=seeds[0])[0], random_ids(1, 31, seed=seeds[1])[0]])
        eager_cache = RocketKVCache(_unbucketed(config))
        eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, cache=eager_cache,
                       disable_compile=True)
        cache = RocketKVCache(config)
        out = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, cache=cache,
                     compile_config=eager_compile_config())
        assert torch.equal(out, eager), seeds
        assert cache.layers[0].lengths.dim() == 2 and torch.equal(cache.layers[0].lengths, eager_cache.layers[0].lengths)
        longest.add(int(eager_cache.layers[0].lengths.max()))
        capacities.add(cache.layers[0].capacity)
        assert unique_graphs() == 1, (seeds, dict(dynamo_utils.counters["stats"]))
    assert len(longest) > 1 and capacities == {24 + 40}  # the heads' counts changed, the bucket did not


@pytest.mark.slow
def test_beam_search_with_batch_buckets_and_compiled_decode_equals_eager():
    torch._dynamo.reset()
    rocket, _ = make_models("llama", num_hidden_layers=1)
    ids, mask = left_pad([random_ids(1, 30 + 7 * r, seed=r)[0] for r in range(3)])
    config = compressing_config(kt_cache_dtype="float32", stage1="adakv", decode_runner="torch_compile")
    compile_config = CompileConfig(fullgraph=True, mode="default", dynamic=False, backend="eager")
    compile_config._compile_all_devices = True
    eager = greedy(rocket, ids, attention_mask=mask, max_new_tokens=4, num_beams=2, disable_compile=True,
                   cache=RocketKVCache(config.replace(capacity_buckets=(), batch_buckets=())))
    cache = RocketKVCache(config)
    out = greedy(rocket, ids, attention_mask=mask, max_new_tokens=4, num_beams=2, cache=cache,
                 compile_config=compile_config)
    assert torch.equal(out, eager)
    assert cache.layers[0].lengths.shape == (6, 2)  # padding rows stripped (3 rows x 2 beams), per-head lengths
