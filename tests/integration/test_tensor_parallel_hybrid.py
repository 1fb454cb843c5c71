"""Tensor parallelism for models with sliding-window layers, soft-capping or sinks: ``torchrun --nproc_per_node=2``
(gloo, CPU) runs tp_worker.py (beside this file) on tiny random gpt-oss (sinks, alternating sliding / full layers,
MoE), Gemma 3 (several sliding layers per global one) and Gemma 2 (soft-capped logits) checkpoints loaded with
``tp_plan="auto"`` and ``attn_implementation="rocketkv"``, in float32.

Greedy tokens must equal a single process's with the same RocketKV config: a prompt inside the budget with every
page attended (RocketKV is then exact), and a longer prompt that stage 1 evicts and stage 2 selects pages of.

transformers' plans differ: Gemma 2 and 3 shard q/k/v by heads (each rank holds one of the two KV heads, its sliding
layers a window of that head), gpt-oss shards only its embeddings and LM head (every rank runs every attention head
with the full sinks vector, so each rank's cache equals one process's; its MoE experts are replicated, their
expert-parallel plan is a separate option). A plan that shards gpt-oss' attention and its sinks by heads
(``SHARDED_SINKS_PLAN``) runs too: each rank's attention then gets its own heads' sinks; and so does expert
parallelism (``ep_size=2``: each rank holds half of the MoE experts).
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_rocketkv import RocketKVCache, RocketKVConfig
from tests.integration.test_tensor_parallel import _failure, run_workers
from tests.support.hybrid_models import WINDOW, make_hybrid_models
from tests.support.tiny_models import PAD, greedy, left_pad, random_ids

EXACT = dict(prompt_budget=512, window_size=8, kernel_size=5, topk=4096, topr=16, page_size=4,
             kt_cache_dtype="float32", backend="torch")
EVICTING = dict(prompt_budget=24, window_size=8, kernel_size=5, topk=3, topr=8, page_size=4,
                kt_cache_dtype="float32", backend="torch")
NEW_TOKENS = 8
KV_HEADS_PER_RANK = {"gpt_oss": 2, "gpt_oss_sharded_sinks": 1, "gpt_oss_expert_parallel": 2, "gemma3": 1,
                     "gemma2": 1}  # of 2
# gpt-oss with its attention sharded by heads, the sinks with them: each rank's attention gets its own heads' sinks
# (a fresh local view of the shard at every forward, transformers' "local_params")
SHARDED_SINKS_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.self_attn.sinks": "colwise", "model.layers.*.self_attn": "local_params",
}


def _transformers_lacks(arch: str) -> str | None:
    """Why this transformers cannot run the plan of ``arch`` (older versions: no ``local_params`` style, no expert
    parallelism in DistributedConfig), or None."""
    import dataclasses
    import inspect

    import transformers
    from transformers import DistributedConfig
    from transformers.integrations import tensor_parallel

    if arch == "gpt_oss_sharded_sinks" and "local_params" not in tensor_parallel.ALL_PARALLEL_STYLES.keys():
        return f"transformers {transformers.__version__} has no 'local_params' tensor-parallel style"
    fields = {f.name for f in dataclasses.fields(DistributedConfig)} if dataclasses.is_dataclass(DistributedConfig) \
        else set(inspect.signature(DistributedConfig.__init__).parameters)
    if arch == "gpt_oss_expert_parallel" and "ep_size" not in fields:
        return f"transformers {transformers.__version__}'s DistributedConfig has no ep_size (expert parallelism)"
    return None


def _inputs(short: bool):
    lengths = (20, 14) if short else (48, 40)
    return left_pad([random_ids(1, lengths[0], seed=5)[0], random_ids(1, lengths[1], seed=6)[0]])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt_oss", "gpt_oss_sharded_sinks", "gpt_oss_expert_parallel", "gemma3", "gemma2"])
def test_tensor_parallel_hybrid_generate_matches_single_process(tmp_path, arch):
    if (reason := _transformers_lacks(arch)) is not None:
        pytest.skip(reason)
    rocket, _ = make_hybrid_models(arch.removesuffix("_sharded_sinks").removesuffix("_expert_parallel"))
    model_dir = tmp_path / "model"
    rocket.save_pretrained(model_dir)
    (ids, mask), (long_ids, long_mask) = _inputs(short=True), _inputs(short=False)
    spec = dict(input_ids=ids.tolist(), attention_mask=mask.tolist(), max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                rocketkv=EXACT,
                runs=[dict(input_ids=long_ids.tolist(), attention_mask=long_mask.tolist(), rocketkv=EVICTING)])
    if arch == "gpt_oss_sharded_sinks":
        spec["tp_plan"] = SHARDED_SINKS_PLAN
    if arch == "gpt_oss_expert_parallel":  # its MoE experts split over the ranks (each rank runs its own, all-reduce)
        spec["distributed"] = dict(ep_size=2, ep_implementation="all_reduce")
    result, output = run_workers(tmp_path, spec, timeout=400)
    assert result.returncode == 0, _failure(result, output)
    report = json.loads(output.read_text())
    assert report["world_size"] == 2

    from transformers import AutoModelForCausalLM

    import hf_rocketkv

    # the ranks run on their GPUs where NCCL is there (tp_worker.py): one process on a GPU of the same kind, with
    # the same experts' kernel, is the reference there (a random model's near-tied logits differ CPU vs GPU)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    single = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=hf_rocketkv.ATTN_NAME,
                                                  device_map=device).eval()
    if device == "cuda" and hasattr(single, "set_experts_implementation"):
        single.set_experts_implementation("batched_mm")
    runs = [(ids, mask, EXACT), (long_ids, long_mask, EVICTING)]
    expected = []
    for run_ids, run_mask, rocketkv in runs:
        cache = RocketKVCache(RocketKVConfig(**rocketkv))
        tokens = greedy(single, run_ids.to(device), attention_mask=run_mask.to(device), cache=cache,
                        max_new_tokens=NEW_TOKENS).cpu()
        kept = [cache.kept_tokens(i).cpu() for i in range(len(cache.layers))]
        expected.append((tokens.tolist(), kept, [layer.is_sliding for layer in cache.layers]))

    heads = KV_HEADS_PER_RANK[arch]
    if arch in ("gpt_oss", "gpt_oss_expert_parallel"):  # half of the experts' weights live on each rank under EP
        experts = sum(p.numel() for name, p in single.named_parameters() if ".experts." in name)
        for rank in report["ranks"]:
            sharded = sum(p.numel() for p in single.parameters()) - rank["local_parameters"]
            assert (sharded >= experts // 2) == (arch == "gpt_oss_expert_parallel"), (arch, sharded, experts)
    for rank in report["ranks"]:
        for which, (got, (tokens, kept, sliding)) in enumerate(zip([rank, *rank["runs"]], expected)):
            where = f"rank {rank['rank']}, {'exact' if which == 0 else 'evicting'} run"
            assert got["sliding"] == sliding and any(sliding) and not all(sliding), where
            assert got["kv_heads"] == [heads] * len(sliding), where
            assert got["tokens"] == tokens, f"{where}: other tokens than one process"
            first = rank["rank"] * heads if heads < 2 else 0
            for layer_idx, layer_kept in enumerate(got["kept_tokens"]):
                assert layer_kept == kept[layer_idx][:, first:first + heads].tolist(), (where, layer_idx)
            windows = [row for layer_idx, rows in enumerate(got["kept_tokens"]) if sliding[layer_idx] for row in rows]
            assert all(n <= WINDOW for row in windows for n in row), where
        evicted = [n for layer_idx, rows in enumerate(rank["runs"][0]["kept_tokens"]) if not expected[1][2][layer_idx]
                   for row in rows for n in row]
        assert evicted and max(evicted) == EVICTING["prompt_budget"] + NEW_TOKENS - 1, "stage 1 must have evicted"
