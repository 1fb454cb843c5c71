#!/usr/bin/env bash
# Runs named GPU measurement steps one after another, each under its own time limit, each logged to $OUT/<step>.log
# (tee: a step that times out still leaves its output), so one device call can batch several checks.
#
#   OUT=/tmp/out bash benchmarks/gpu_steps.sh decode_b1_32k decode_b32_8k prefix_reuse graph_tests
#
# Run it from the repository root: the timing scripts run as modules (python -m benchmarks.<name>, the probes as benchmarks.probes.<name>). The GPU
# correctness checks are tests (tests/gpu and every test marked `gpu`): the step gpu_tests runs them all through
# scripts/gpu_tests.sh, which writes its results file under $OUT/gpu_tests; the *_tests steps run some of them.
# A failing step never stops the next one; the summary at the end lists each step's exit status and seconds.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
PY=${PYTHON:-python}

need_pytest() {  # a GPU machine without network: pytest and hypothesis from the carried wheels
  $PY -c "import pytest, hypothesis" 2>/dev/null || \
    $PY -m pip install -q --no-index --find-links .device_wheels pytest hypothesis pytest-timeout
}

# "${GPU_TESTS[@]}" PATH...: the `gpu` tests of PATH, with a results file under $OUT/gpu_tests (a command, not a
# function: step runs it under timeout)
GPU_TESTS=(env OUT="$OUT/gpu_tests" bash scripts/gpu_tests.sh)

step() {  # step NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee "$OUT/$name.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$OUT/summary.txt"
}

for name in "$@"; do
  case $name in
    decode_b1_32k)   step "$name" 200 $PY -m hf_rocketkv.bench.decode --batch 1 --context 32768 --new-tokens 64 \
                        --caches rocketkv-graphs rocketkv dynamic --no-plot --out "$OUT/decode_b1_32k" ;;
    headline)        # the README's table and picture: batch 1 at 32k and 128k against StaticCache + compile and
                     # DynamicCache in one process, then RocketKV at batch 64 and 128 x 32k (prefill rows of 8)
                     step "${name}_b1" 600 $PY -m hf_rocketkv.bench.decode --batch 1 --context 32768 128000 \
                        --new-tokens 64 --caches rocketkv-graphs static-compile dynamic --cudnn-for-static --no-plot \
                        --out "$OUT/headline_b1"
                     step "${name}_batched" 600 $PY -m hf_rocketkv.bench.decode --batch 64 128 --context 32768 \
                        --new-tokens 64 --prefill-batch-size 8 --caches rocketkv-graphs --no-plot \
                        --out "$OUT/headline_batched"
                     step "${name}_plot" 60 $PY -m benchmarks.plot_headline "$OUT/headline_b1/decode_bench.json" \
                        "$OUT/headline_batched/decode_bench.json" --out "$OUT/headline.png" ;;
    decode_pool_b1_32k) # private pages, bf16 pool pages and fp8 pool pages side by side (graphs), eager and DynamicCache
                     step "$name" 300 $PY -m hf_rocketkv.bench.decode --batch 1 --context 32768 --new-tokens 64 \
                        --caches rocketkv-graphs rocketkv-graphs-pool rocketkv-graphs-pool-fp8 rocketkv dynamic \
                        --no-plot --out "$OUT/decode_pool_b1_32k" ;;
    decode_pool_b32_8k) step "$name" 300 $PY -m hf_rocketkv.bench.decode --batch 32 --context 8192 --new-tokens 64 \
                        --prefill-batch-size 8 --caches rocketkv-graphs rocketkv-graphs-pool rocketkv-graphs-pool-fp8 \
                        --no-plot --out "$OUT/decode_pool_b32_8k" ;;
    rope_tests)      # the fused RoPE and RMSNorm (prefill and decode) against transformers' formulas, and whole generations on/off
                     need_pytest
                     step "$name" 300 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_rope.py tests/integration/test_rope.py \
                        tests/kernels/test_rms_norm.py tests/integration/test_norm.py ;;
    adakv_tests)     # AdaKV's per-head lengths: compaction kernel (compiled), layer vs oracles, Triton vs torch, generate
                     need_pytest
                     step "$name" 400 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_compact.py \
                        tests/policies/test_adakv_layer.py tests/policies/test_adakv_generate.py \
                        tests/policies/test_policy_cache.py ;;
    decode_adakv_b1_32k) # stage1="adakv" (per-head lengths) against snapkv: graphed and eager, same call
                     step "$name" 300 $PY -m hf_rocketkv.bench.decode --batch 1 --context 32768 --new-tokens 64 \
                        --caches rocketkv-graphs rocketkv-graphs-adakv rocketkv rocketkv-adakv --no-plot \
                        --out "$OUT/decode_adakv_b1_32k" ;;
    decode_adakv_b32_8k) step "$name" 300 $PY -m hf_rocketkv.bench.decode --batch 32 --context 8192 --new-tokens 64 \
                        --prefill-batch-size 8 --caches rocketkv-graphs rocketkv-graphs-adakv --no-plot \
                        --out "$OUT/decode_adakv_b32_8k" ;;
    decode_rope_b1_32k) # fused_rope on / off side by side: graphed and eager, DynamicCache
                     step "$name" 300 $PY -m hf_rocketkv.bench.decode --batch 1 --context 32768 --new-tokens 64 \
                        --caches rocketkv-graphs rocketkv-graphs-rope-off rocketkv rocketkv-rope-off dynamic \
                        --no-plot --out "$OUT/decode_rope_b1_32k" ;;
    decode_rope_b32_8k) step "$name" 300 $PY -m hf_rocketkv.bench.decode --batch 32 --context 8192 --new-tokens 64 \
                        --prefill-batch-size 8 --caches rocketkv-graphs rocketkv-graphs-rope-off --no-plot \
                        --out "$OUT/decode_rope_b32_8k" ;;
    profile_b64_32k_regions) step "$name" 590 $PY -m benchmarks.probes.profile_graph_step --batch 64 --context 32768 \
                        --prefill-batch-size 8 --bandwidth-tbs 4.8 --regions --out "$OUT/profile_b64_32k_regions" ;;
    profile_b64_8k_rope_ab) # fused_rope on, then off, compile_regions, batch 64 x 8k (stage 1 keeps 2048 either way)
                     for r in "" "--rope-off"; do step "$name${r//-/_}" 290 $PY -m benchmarks.probes.profile_graph_step \
                        --batch 64 --context 8192 --prefill-batch-size 16 --bandwidth-tbs 4.8 --regions $r \
                        --new-tokens 24 --out "$OUT/$name${r//-/_}"; done ;;
    profile_b64_32k_regions_rope_off) step "$name" 590 $PY -m benchmarks.probes.profile_graph_step --batch 64 \
                        --context 32768 --prefill-batch-size 8 --bandwidth-tbs 4.8 --regions --rope-off \
                        --out "$OUT/profile_b64_32k_regions_rope_off" ;;
    decode_b32_8k)   step "$name" 240 $PY -m hf_rocketkv.bench.decode --batch 32 --context 8192 --new-tokens 64 \
                        --prefill-batch-size 8 --caches rocketkv-graphs dynamic --no-plot --out "$OUT/decode_b32_8k" ;;
    decode_graphs_b32_8k) step "$name" 240 $PY -m hf_rocketkv.bench.decode --batch 32 --context 8192 --new-tokens 64 \
                        --prefill-batch-size 8 --caches rocketkv-graphs --no-plot --out "$OUT/decode_graphs_b32_8k" ;;
    attention_kernel_tests) # the sparse attention and paged ops against their twins on this GPU
                     need_pytest
                     step "$name" 240 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_sparse_decode_attention.py \
                        tests/kernels/test_paged_ops.py tests/kernels/test_fp8_pages.py ;;
    tune_wide)       step "$name" 400 $PY -m benchmarks.probes.tune_decode_kernels --wide --skip-attention --batches 64 32 1 \
                        --out "$OUT/tune_wide" ;;
    prefix_reuse)    step "$name" 240 $PY -m benchmarks.bench_prefix_reuse --out "$OUT/prefix_reuse" ;;
    prefix_equal_fp32) step "$name" 150 $PY -m benchmarks.bench_prefix_reuse --dtype float32 --layers 8 --prefix 8192 \
                        --batch 2 --pool-gib 8 --host-gib 2 --out "$OUT/prefix_equal_fp32" ;;
    gpu_tests)       # every test marked `gpu` (tests/gpu and the GPU-only tests elsewhere), one results file
                     step "$name" 590 "${GPU_TESTS[@]}" tests ;;
    onload_exact)    # a prefix hit onloaded from host memory equals the device hit, bit for bit
                     step "$name" 150 "${GPU_TESTS[@]}" tests/gpu/test_prefix_onload_gpu.py ;;
    graph_tests)     # CUDA-graph decode equals eager decode (also after compile_regions); torch.compile decode runs
                     step "$name" 300 "${GPU_TESTS[@]}" tests/gpu/test_decode_graphs_gpu.py \
                        tests/gpu/test_compiled_decode_gpu.py ;;
    warm_start)      step "$name" 300 $PY -m benchmarks.probes.warm_start_time --out "$OUT/warm_start" ;;
    kernel_tests)    # every Triton kernel against its PyTorch twin, compiled for this GPU (pytest from .device_wheels if absent)
                     need_pytest
                     step "$name" 330 $PY -m pytest -q -p no:cacheprovider --durations=15 tests/kernels ;;
    launch_tests)    # kernels/launch.TritonLaunch: the compiled kernel it reuses is Triton's own, over specializations
                     need_pytest
                     step "$name" 120 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_launch.py ;;
    op_graph_tests)  # eager decode through per-layer CUDA graphs equals plain eager launches, bit for bit (cache/op_graphs.py)
                     need_pytest
                     step "$name" 240 $PY -m pytest -q -p no:cacheprovider tests/cache/test_op_graphs.py ;;
    graph_pool_tests) # the CUDA-graph runner on pool pages (pages back without the garbage collector) and the graphs' tests
                     need_pytest
                     step "$name" 180 $PY -m pytest -q -p no:cacheprovider tests/integration/test_decode_graphs.py ;;
    compact_tests)   # stage 1's compaction kernel against its twin and the slot-by-slot oracle, on this GPU
                     need_pytest
                     step "$name" 120 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_compact.py ;;
    attention_tests) # the prefill attention's lower-right causal path (cuDNN split + merge, flash) against its oracle
                     need_pytest
                     step "$name" 120 $PY -m pytest -q -p no:cacheprovider tests/integration/test_attention.py tests/integration/test_attention_spans.py \
                        tests/integration/test_causal_prefill.py tests/kernels/test_merge_attention.py ;;
    prefill_tests)   # the prefill path on this GPU: its kernels against their twins (compiled, with their specialisations), the attention paths, the engine's prefill graphs
                     need_pytest
                     step "$name" 300 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_merge_attention.py tests/kernels/test_rope.py \
                        tests/kernels/test_rms_norm.py tests/kernels/test_window_scores.py tests/kernels/test_specialisation.py \
                        tests/integration/test_attention.py tests/integration/test_causal_prefill.py tests/serving/test_prefill_graphs.py ;;
    profile_prefix_hit) step "$name" 150 $PY -m benchmarks.probes.profile_prefix_hit --out "$OUT/profile_prefix_hit" ;;
    profile_prefill) step "$name" 150 $PY -m benchmarks.probes.profile_prefill --out "$OUT/profile_prefill" ;;
    sync_sites)      step "$name" 120 $PY -m benchmarks.probes.sync_sites --layers 2 --out "$OUT/sync_sites" ;;
    decode_compression) # decode-time compression: CUDA-graph decode equals eager, the capacity stays bounded
                     step "$name" 240 "${GPU_TESTS[@]}" tests/gpu/test_decode_compression_gpu.py ;;
    batching)        step "$name" 300 $PY -m benchmarks.batching_throughput --rates 1,4 --mixed-requests 16 --mixed-time-s 20 \
                        --mixed-max-prompt 16384 --out "$OUT/batching" ;;
    profile_graph_b32) step "$name" 240 $PY -m benchmarks.probes.profile_graph_step --batch 32 --context 8192 --eager \
                        --out "$OUT/profile_graph_b32" ;;
    decode_host_time) step "$name" 200 $PY -m benchmarks.probes.decode_host_time --out "$OUT/decode_host_time" ;;
    eager_layer_time) step "$name" 150 $PY -m benchmarks.probes.eager_layer_time --out "$OUT/eager_layer_time" ;;
    launch_overhead) step "$name" 120 $PY -m benchmarks.probes.launch_overhead --out "$OUT/launch_overhead" ;;
    bench_fp8_append) step "$name" 120 $PY -m benchmarks.probes.bench_fp8_append --out "$OUT/bench_fp8_append" ;;
    profile_pool_b1) # the graphed step at batch 1 x 32k on private pages, bf16 pool pages and fp8 pool pages
                     for pool in none model fp8; do
                       step "${name}_$pool" 150 $PY -m benchmarks.probes.profile_graph_step --batch 1 --context 32768 \
                          --pool "$pool" --out "$OUT/profile_pool_b1"
                     done ;;
    profile_graph_b1) step "$name" 180 $PY -m benchmarks.probes.profile_graph_step --batch 1 --context 32768 \
                        --out "$OUT/profile_graph_b1" ;;
    batching_fixed)  step "$name" 240 $PY -m benchmarks.batching_throughput --rates "" --out "$OUT/batching_fixed" ;;
    batching_fixed_regions) step "$name" 300 $PY -m benchmarks.batching_throughput --rates "" --compile-regions --profile-prefill \
                        --out "$OUT/batching_fixed_regions" ;;
    profile_graph_b32_regions) step "$name" 240 $PY -m benchmarks.probes.profile_graph_step --batch 32 --context 8192 \
                        --regions --out "$OUT/profile_graph_b32_regions" ;;
    tune_kernels)    step "$name" 420 $PY -m benchmarks.probes.tune_decode_kernels --out "$OUT/tune_kernels" ;;
    batching_fixed_compiled) step "$name" 300 $PY -m benchmarks.batching_throughput --rates "" --compile-regions \
                        --out "$OUT/batching_fixed_compiled" ;;
    batching_fixed_compiled_rope_off) step "$name" 300 $PY -m benchmarks.batching_throughput --rates "" --compile-regions \
                        --rope-off --out "$OUT/batching_fixed_compiled_rope_off" ;;
    batching_fixed_sync) step "$name" 300 $PY -m benchmarks.batching_throughput --rates "" --compile-regions \
                        --no-overlap-decode --out "$OUT/batching_fixed_sync" ;;
    batching_gc)     step "$name" 300 $PY -m benchmarks.batching_throughput --rates "" --compile-regions --freeze-gc \
                        --out "$OUT/batching_gc" ;;
    batching_host_times) step "$name" 300 $PY -m benchmarks.batching_throughput --rates "" --compile-regions --time-host \
                        --out "$OUT/batching_host_times" ;;
    triton_compiles) step "$name" 240 $PY -m benchmarks.probes.triton_compiles ;;
    prefill_cprofile) step "$name" 150 $PY -m benchmarks.probes.prefill_host_time --regions --cprofile --repeats 3 \
                        --out "$OUT/prefill_cprofile" ;;
    prefill_host_time) step "$name" 150 $PY -m benchmarks.probes.prefill_host_time --regions --out "$OUT/prefill_host_time" ;;
    profile_prefill_regions) step "$name" 180 $PY -m benchmarks.probes.profile_prefill --regions \
                        --out "$OUT/profile_prefill_regions" ;;
    batching_regions) step "$name" 420 $PY -m benchmarks.batching_throughput --rates 1,4 --mixed-requests 16 \
                        --mixed-time-s 20 --mixed-max-prompt 16384 --compile-regions --out "$OUT/batching_regions" ;;
    profile_graph_b1_regions) step "$name" 180 $PY -m benchmarks.probes.profile_graph_step --batch 1 --context 32768 \
                        --regions --out "$OUT/profile_graph_b1_regions" ;;
    stage2_score_tests) # stage2_score="head_bound" (and the default) in the scoring / selection kernels on this GPU
                     need_pytest
                     step "$name" 240 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_page_scores.py \
                        tests/kernels/test_select_pages.py tests/kernels/test_paged_ops.py tests/kernels/test_e2e_triton.py ;;
    bench_kernels_quick) step "$name" 200 $PY -m benchmarks.probes.bench_kernels --quick --budget-s 120 \
                        --out "$OUT/bench_kernels_quick" ;;
    mixed_curve)     step "$name" 300 $PY -m benchmarks.batching_throughput --skip-fixed --rates 1,2,4,8 --mixed-requests 16 \
                        --mixed-time-s 20 --mixed-max-prompt 32768 --compile-regions --out "$OUT/mixed_curve" ;;
    mixed_curve_transformers) step "$name" 540 $PY -m benchmarks.batching_throughput --engine transformers --skip-fixed \
                        --rates 1,2,4,8 --mixed-requests 16 --mixed-time-s 20 --mixed-max-prompt 32768 \
                        --out "$OUT/mixed_curve_transformers" ;;
    decode_pages2)   # the fidelity-pages2 config (pages of 2, topk 128) against the default (pages of 4, topk 64)
                     for cfg in default fidelity-pages2; do
                       step "${name}_${cfg}_b1" 200 $PY -m hf_rocketkv.bench.decode --batch 1 --context 32768 \
                          --new-tokens 64 --caches rocketkv-graphs --config hf_rocketkv/configs/$cfg.yaml --no-plot \
                          --out "$OUT/${name}_${cfg}_b1"
                       step "${name}_${cfg}_b32" 240 $PY -m hf_rocketkv.bench.decode --batch 32 --context 8192 \
                          --new-tokens 64 --prefill-batch-size 8 --caches rocketkv-graphs \
                          --config hf_rocketkv/configs/$cfg.yaml --no-plot --out "$OUT/${name}_${cfg}_b32"
                     done ;;
    tp_verify)       # needs 2 GPUs: tensor parallel against 1 GPU, float32, step level; the engine in lockstep
                     step "$name" 590 "${GPU_TESTS[@]}" tests/gpu/test_tensor_parallel_gpu.py \
                        tests/gpu/test_lockstep_serving_gpu.py ;;
    tp_speed)        # tensor parallel on 2 GPUs against 1, bf16: TTFT and decode after a warm-up (benchmarks/tp_speed.py)
                     # TP_LAYERS (default 8; 32 = the whole 8B model) and TP_WORKLOADS (default "b1 b16")
                     layers=${TP_LAYERS:-8}; dir=/tmp/tps$layers; scale=$(( layers > 8 ? layers / 8 : 1 ))
                     tag=$([ "$layers" = 8 ] && echo "" || echo "_L$layers")
                     [ -d "$dir" ] || step "${name}${tag}_save" $((80 * scale)) $PY -m benchmarks.random_checkpoint \
                        --layers "$layers" --dtype bfloat16 --dir "$dir"
                     for wl in ${TP_WORKLOADS:-b1 b16}; do
                       # batch, context, the single-GPU limit at 8 layers (TP takes less), RocketKVConfig overrides;
                       # batch 16: prefill in row groups of 4 (16 x 32k MLP activations at once would not fit one H100)
                       case $wl in
                         b1)  read -r b ctx limit rk <<< "1 100000 100 {}" ;;
                         b16) read -r b ctx limit rk <<< "16 32768 140 {\"prefill_batch_size\":4}" ;;
                         *)   echo "unknown TP workload $wl (b1, b16)" | tee -a "$OUT/summary.txt"; continue ;;
                       esac
                       run="${name}${tag}_b${b}_${ctx}"
                       step "${run}_single" $((limit * scale)) env CUDA_VISIBLE_DEVICES=0 $PY -m benchmarks.tp_speed \
                          run --dir "$dir" --batch "$b" --context "$ctx" --new-tokens 64 --repeats 3 \
                          --rocketkv-json "$rk" --out "$OUT/${run}_single.json"
                       step "${run}_tp" $((100 * scale)) $PY -m torch.distributed.run --nproc_per_node=2 \
                          -m benchmarks.tp_speed run --dir "$dir" --batch "$b" --context "$ctx" --new-tokens 64 \
                          --repeats 3 --rocketkv-json "$rk" --out "$OUT/${run}_tp.json"
                       step "${run}_compare" 60 $PY -m benchmarks.tp_speed compare "$OUT/${run}_single.json" \
                          "$OUT/${run}_tp.json"
                     done ;;
    engine_device_tests) # needs 2 GPUs: the engines on a model on cuda:1 (their threads' current CUDA device)
                     need_pytest
                     step "$name" 180 $PY -m pytest -q -p no:cacheprovider tests/serving/test_engine_device.py tests/integration/test_decode_graphs.py ;;
    lockstep_serve)  # the batching engine in lockstep on 2 GPUs against 1 GPU: throughput, same events on both ranks
                     [ -d /tmp/tps8 ] || step "${name}_save" 80 $PY -m benchmarks.random_checkpoint --layers 8 --dtype bfloat16 --dir /tmp/tps8
                     step "${name}_single" 200 env CUDA_VISIBLE_DEVICES=0 $PY -m benchmarks.tp_serving_throughput --dir /tmp/tps8 \
                        --out "$OUT/lockstep_single.json"
                     step "${name}_tp" 200 $PY -m torch.distributed.run --nproc_per_node=2 -m benchmarks.tp_serving_throughput \
                        --dir /tmp/tps8 --out "$OUT/lockstep_tp.json"
                     step "${name}_compare" 60 $PY -m benchmarks.tp_serving_throughput --compare "$OUT/lockstep_single.json" \
                        "$OUT/lockstep_tp.json" ;;
    fp8_kernel_tests) # the fp8 page kernels (attention, append, compaction) compiled for this GPU against their twins
                     need_pytest
                     step "$name" 240 $PY -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_pages.py \
                        tests/kernels/test_fp8_append.py ;;
    fp8_vs_bf16_fixed) # the batching engine's fixed workload (32 x 8k, 512 new) on bf16 pool pages, then on fp8 pages
                     for dt in auto fp8; do
                       step "${name}_$dt" 300 $PY -m benchmarks.batching_throughput --rates "" --kv-cache-dtype "$dt" \
                          --out "$OUT/${name}_$dt"
                     done ;;
    *) echo "unknown step $name (see benchmarks/gpu_steps.sh)" | tee -a "$OUT/summary.txt" ;;
  esac
done
cat "$OUT/summary.txt"
