"""End to end: a tiny random Llama generates the same greedy tokens with backend="triton" and backend="torch".

Also checks that the decode ops trace into one torch.compile graph (fullgraph=True: no graph break).
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_rocketkv
from hf_rocketkv import RocketKVCache, RocketKVConfig
from tests.kernels.kernel_utils import DEVICE, ops

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper attention: page probabilities far from uniform, so no near-ties in top-k
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return hf_rocketkv.enable(model.to(DEVICE))


def _generate(model, ids, mask, config):
    cache = RocketKVCache(config)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False,
                         eos_token_id=None)
    return out, cache


@pytest.mark.parametrize(
    "topr,kt_dtype,score",
    # top-r < head_dim needs a KT dtype that keeps the group-summed |q| free of ties: fp8 rounding of q creates
    # ties at the top-r boundary, which torch.topk and the kernel may break differently (both valid)
    [(12, "float32", "group_sign"), (16, "float8_e5m2", "group_sign"), (12, "float32", "head_bound")],
)
def test_greedy_tokens_match_torch_backend(topr, kt_dtype, score):
    model = _model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :6], mask[0, :6] = 0, 0  # left padding: ragged rows
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    # small budget: stage 1 evicts, stage 2 picks 3 of ~10 pages of 2 tokens (head_dim 16)
    config = RocketKVConfig(prompt_budget=16, window_size=4, kernel_size=3, topk=3, topr=topr, page_size=2,
                            kt_cache_dtype=kt_dtype, stage2_score=score)
    out_torch, _ = _generate(model, ids, mask, config.replace(backend="torch"))
    out_triton, cache = _generate(model, ids, mask, config.replace(backend="triton"))
    assert cache.layers[0].ops.name == "triton"
    assert torch.equal(out_triton, out_torch)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="interpreted Triton kernels are not traceable (wrap_triton passes them through); GPU only, also at "
    "Llama-3.1-8B shapes in tests/gpu/test_kernels_large_shapes_gpu.py",
)
def test_decode_ops_trace_without_graph_breaks():
    """The four decode ops inside torch.compile(fullgraph=True) give the eager results."""
    t = ops()
    g = torch.Generator().manual_seed(2)
    batch, kv_heads, group, dim, capacity, page = 2, 2, 4, 32, 32, 4
    q = torch.randn(batch, kv_heads, group, dim, generator=g).to(DEVICE)
    keys = torch.randn(batch, kv_heads, capacity, dim, generator=g).to(DEVICE)
    values = torch.randn(batch, kv_heads, capacity, dim, generator=g).to(DEVICE)
    key_new = torch.randn(batch, kv_heads, dim, generator=g).to(DEVICE)
    lengths = torch.tensor([9, 20], device=DEVICE)
    kt = t.build_kt(keys, lengths, page, torch.bfloat16)

    def step(kt, lengths):
        t.update_kt(kt, key_new, lengths, page)
        n_pages = (lengths + 1 + page - 1) // page
        probs = t.page_scores(q, kt, n_pages, 24)
        idx, valid = t.select_pages(probs, n_pages, 3)
        return t.sparse_decode_attention(q, keys, values, idx, valid, lengths + 1, page, dim**-0.5)

    kt_eager = kt.clone()
    want = step(kt_eager, lengths)
    got = torch.compile(step, fullgraph=True)(kt, lengths)
    torch.testing.assert_close(got, want)
    assert torch.equal(kt, kt_eager)  # the in-place KT update happened exactly once


def test_triton_ops_are_wired_with_reference_signatures():
    import inspect

    from hf_rocketkv.kernels.dispatch import TORCH_OPS, get_ops

    t = ops()
    assert get_ops("triton", DEVICE) is t and t.name == "triton"
    for name in ("window_scores", "build_kt", "update_kt", "page_scores", "select_pages", "sparse_decode_attention"):
        fn, ref = getattr(t, name), getattr(TORCH_OPS, name)
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(ref).parameters), name
        assert str(fn.op) == f"<CustomOpDef(hf_rocketkv::{name})>"  # what torch.compile traces
