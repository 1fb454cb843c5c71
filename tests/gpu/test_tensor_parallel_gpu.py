"""Tensor parallelism on two GPUs (NCCL) against one GPU, step by step, in float32.

A random checkpoint with Llama-3.1-8B shapes (4 layers) is loaded once with ``tp_plan="auto"`` across two GPUs
(tests/gpu/tp_worker_gpu.py under torchrun) and once on one GPU in this process; both run greedy generate() with the
same compressing RocketKVCache (Triton backend, float32 KT) on the same 8,192-token prompt. Token equality is no test
on a random model (near-tied logits amplify reduction-order noise), so the steps are compared
(tests/integration/tp_steps.py): each rank's stage-1 kept positions for its KV heads must equal the single GPU's for
the same heads, its stage-2 selected pages too except where pages swap at a tie (the tie rule of tp_steps.py: within
1,024 float32 ulps, 1.2e-4, of the scores' own size, or within twice the two runs' measured score disagreement on
that head, which itself must stay under 2% of the head's top score), and the logits must agree within 1e-4 relative
up to the first decode step that attended a swapped page; the steps after it are not compared (that step's token left
other K/V in the deeper layers, so the states differ by more than rounding; their logits' errors are printed). On two
H100s a layer-3 swap of pages 1.5e-3 apart, relative, led to step-1 logits 1.6e-2 apart.

Size for one 80 GB card (H100) per process, float32: the single-GPU run holds the 4 layers' weights (4 x 218M
parameters, 3.5 GB) plus the untied embedding and LM head (2 x 525M, 4.2 GB), 7.7 GB in all; prefilling 8,192 tokens
adds the MLP's three [8192, 14336] activations (1.4 GB), the [8192, 4096] hidden states and the KV cache (4 x 67 MB),
about 10 GB at peak; each tensor-parallel rank holds half of the layers' weights and activations. The bf16
checkpoint is built on GPU 0 (3.9 GB) and freed before either run. The test prints each run's measured peak: on two H100s (2026-11-27) 26.5 GiB for
the single-GPU run (float32 prefill's attention and logits workspaces come on top of the estimate) and 14.5 GiB per
rank, so it fits 80 GB cards with room to spare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from hf_rocketkv import RocketKVCache

from .gpu_models import llama_8b_layers, two_gpus
from .tp_worker_gpu import ROCKET, prompt

REPO = Path(__file__).resolve().parents[2]
LAYERS, CONTEXT, NEW_TOKENS = 4, 8192, 6
LOGITS_REL = 1e-4


def _save_checkpoint(folder: Path) -> None:
    model = llama_8b_layers(LAYERS, torch.bfloat16)  # every bf16 weight is exact in the float32 runs
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()


@two_gpus
def test_tensor_parallel_steps_match_one_gpu(tmp_path):
    from transformers import AutoModelForCausalLM

    import hf_rocketkv
    from tests.integration.tp_steps import NOISE_REL, pages_differ_beyond_ties, record_steps, score_noise

    model_dir = tmp_path / "model"
    _save_checkpoint(model_dir)
    output = tmp_path / "tp.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "tests.gpu.tp_worker_gpu", str(model_dir), str(output), str(CONTEXT), str(NEW_TOKENS)]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert result.returncode == 0 and output.exists(), result.stdout[-3000:] + result.stderr[-5000:]
    ranks = json.loads(output.read_text())

    single = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=hf_rocketkv.ATTN_NAME,
                                                  dtype=torch.float32, device_map="cuda").eval()
    ids = prompt(CONTEXT, single.config.vocab_size).to("cuda")
    torch.cuda.reset_peak_memory_stats()
    expected = record_steps(single, RocketKVCache(ROCKET), ids, torch.ones_like(ids), NEW_TOKENS, 0)
    single_peak = torch.cuda.max_memory_allocated() / 2**30

    world = len(ranks)
    heads = len(expected["kept"][0][0]) // world
    layers = len(expected["kept"])
    for rank in ranks:
        r = rank["rank"]
        for layer, (got, want) in enumerate(zip(rank["kept"], expected["kept"])):
            for b in range(len(want)):
                for h in range(heads):
                    assert got[b][h] == want[b][r * heads + h], f"rank {r} layer {layer} head {h}: stage 1 kept other"

    def heads_of(rank, index):
        """(row, head, got pages, want pages, got scores, want scores) of one recorded (step, layer) of a rank."""
        got_step, want_step = rank["steps"][index], expected["steps"][index]
        assert got_step["layer"] == want_step["layer"]
        r = rank["rank"]
        for b in range(len(want_step["pages"])):
            for h in range(heads):
                yield (b, h, got_step["pages"][b][h], want_step["pages"][b][r * heads + h], got_step["scores"][b][h],
                       want_step["scores"][b][r * heads + h])

    # The first (step, layer) where any rank attended other pages: up to it the runs differ by rounding only; after it
    # (deeper layers of that step, every later step) the hidden states carry what the other pages held, so those are
    # counted, not compared. The ranks share the hidden states, so the point is one for all of them.
    recorded = min(len(rank["steps"]) for rank in ranks)
    first_swap = next((i for i in range(recorded) for rank in ranks
                       if any(got != want for _, _, got, want, _, _ in heads_of(rank, i))), None)
    compared = recorded if first_swap is None else first_swap + 1
    pages_total = ties = 0
    worst_noise = 0.0
    for rank in ranks:
        r = rank["rank"]
        for index in range(compared):
            for b, h, got_pages, want_pages, got_scores, want_scores in heads_of(rank, index):
                where = f"rank {r} layer {index % layers} step {index // layers + 1} row {b} head {h}"
                pages_total += 1
                noise = score_noise(got_scores, want_scores)
                worst_noise = max(worst_noise, noise / max(want_scores))
                assert noise <= NOISE_REL * max(want_scores), (
                    f"{where}: page scores disagree by {noise:.3g}, {noise / max(want_scores):.3g} of the largest")
                why = pages_differ_beyond_ties(got_pages, want_pages, want_scores, got_scores=got_scores)
                ties += got_pages != want_pages
                assert why is None, f"{where}: {why}"
        # logits[0] is the prefill's, logits[s] decode step s's: held to one GPU's before the step of the first swap
        swap_step = None if first_swap is None else first_swap // layers + 1
        for step, (got, want) in enumerate(zip(rank["logits"], expected["logits"])):
            got_t, want_t = torch.tensor(got), torch.tensor(want)
            err = float((got_t - want_t).abs().max() / want_t.abs().max())
            if swap_step is None or step < swap_step:
                assert err < LOGITS_REL, f"rank {r} step {step}: logits {err:.2e} from one GPU's"
            else:
                print(f"rank {r} step {step} (at or after the tie swap of step {swap_step}): logits {err:.2e} from "
                      f"one GPU's")
    after_swap = recorded - compared
    assert pages_total > 0
    peaks = " / ".join(f"{rank['peak_gib']:.1f}" for rank in ranks)
    print(f"tensor parallel on {world} GPUs: pages compared {pages_total}, swaps at ties {ties}, layer steps after "
          f"a swap not compared {after_swap}, largest score "
          f"disagreement {worst_noise:.2e} of a head's top score; peak GiB one GPU "
          f"{single_peak:.1f}, per rank {peaks}")
