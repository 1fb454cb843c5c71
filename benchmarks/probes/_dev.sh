#!/usr/bin/env bash
# temporary device driver (not committed)
set -u
export PYTHONPATH=.
export COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo ${COMMIT_NAME:-5679496})
mkdir -p $OUT/pg $OUT/gpu
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu_name.txt 2>&1
for stage in "$@"; do
  case $stage in
    pg_decode) timeout 230 bash scripts/perf_guard.sh --cases decode_bs1_32k > $OUT/pg/decode.log 2>&1; echo "pg_decode rc=$?" >> $OUT/stages.txt ;;
    pg_engine) timeout 200 bash scripts/perf_guard.sh --cases engine_32x8k > $OUT/pg/engine.log 2>&1; echo "pg_engine rc=$?" >> $OUT/stages.txt ;;
    pg_gemma) timeout 260 bash scripts/perf_guard.sh --cases hybrid_gemma3_32k > $OUT/pg/gemma.log 2>&1; echo "pg_gemma rc=$?" >> $OUT/stages.txt ;;
    gpu) OUT=$OUT/gpu TEST_TIMEOUT=120 timeout 480 bash scripts/gpu_tests.sh tests/gpu/test_decode_graphs_gpu.py tests/gpu/test_hybrid_decode_gpu.py tests/kernels/test_ring_attention.py tests/kernels/test_ring_append.py tests/integration/test_attention_spans.py > $OUT/gpu/log.txt 2>&1; echo "gpu rc=$?" >> $OUT/stages.txt ;;
    tune) timeout 200 python -m benchmarks.probes.tune_gated_projection --out $OUT/tune.json > $OUT/tune.log 2>&1; echo "tune rc=$?" >> $OUT/stages.txt ;;
    ab_bs1) OUT=$OUT/ab DECODE_CASES=bs1 CASE_TIMEOUT=150 ROUNDS=${ROUNDS:-1} timeout 560 bash scripts/tree_before_after.sh decode; echo "ab_bs1 rc=$?" >> $OUT/stages.txt ;;
    ab_bs64) OUT=$OUT/ab DECODE_CASES=bs64 CASE_TIMEOUT=200 ROUNDS=1 timeout 560 bash scripts/tree_before_after.sh decode; echo "ab_bs64 rc=$?" >> $OUT/stages.txt ;;
    ab_engine) OUT=$OUT/ab CASE_TIMEOUT=200 ROUNDS=1 timeout 560 bash scripts/tree_before_after.sh engine; echo "ab_engine rc=$?" >> $OUT/stages.txt ;;
    tune_attn) timeout 170 python -m benchmarks.probes.tune_gated_projection --parts attention --out $OUT/tune_attn.json > $OUT/tune_attn.log 2>&1; echo "tune_attn rc=$?" >> $OUT/stages.txt ;;
    gpu_sp) OUT=$OUT/gpu_sp TEST_TIMEOUT=60 timeout 150 bash scripts/gpu_tests.sh tests/kernels/test_stacked_projection.py tests/integration/test_qkv.py > $OUT/gpu_sp.log 2>&1; echo "gpu_sp rc=$?" >> $OUT/stages.txt ;;
    ab_qkv) python -c "from hf_rocketkv import RocketKVConfig; open('/tmp/qkv_on.yaml','w').write(RocketKVConfig(fused_qkv=True).to_yaml()); open('/tmp/qkv_off.yaml','w').write(RocketKVConfig(fused_qkv=False).to_yaml())"
      mkdir -p $OUT/ab_qkv
      for row in off_1 on_1 off_2 on_2; do
        extra="--config /tmp/qkv_on.yaml"; case $row in off*) extra="--config /tmp/qkv_off.yaml";; esac
        timeout 140 python -m hf_rocketkv.bench.decode --batch 1 --context 32768 --new-tokens 64 --caches rocketkv-graphs --no-plot $extra --out $OUT/ab_qkv/$row > $OUT/ab_qkv/$row.log 2>&1
        echo "ab_qkv $row rc=$?" >> $OUT/stages.txt
        python -c "import json,sys; r=json.load(open('$OUT/ab_qkv/$row/decode_bench.json'))['rows']; print('$row', [(x.get('cache'), x.get('decode_ms_per_token')) for x in r])" >> $OUT/stages.txt 2>&1
      done ;;
  esac
done
for stage in "$@"; do
  case $stage in
    tf525_setup) python -V > $OUT/tf525_setup.log 2>&1; pip install --no-deps --no-index --target /tmp/tf525 .device_wheels/*.whl >> $OUT/tf525_setup.log 2>&1; echo "tf525_setup rc=$?" >> $OUT/stages.txt
      PYTHONPATH=/tmp/tf525:. python -c "import transformers, huggingface_hub, tokenizers; from transformers.generation.utils import DeferredStopCheck; print('tf', transformers.__version__, huggingface_hub.__version__, tokenizers.__version__)" >> $OUT/stages.txt 2>&1 ;;
    gemma32_rk_tf) mkdir -p $OUT/g32; for v in ${TF_VERSIONS:-517 525}; do pp=.; [ $v = 525 ] && pp=/tmp/tf525:.
        PYTHONPATH=$pp timeout ${T_G32:-150} python -m benchmarks.hybrid_decode --models ${G_MODEL:-gemma-3-12b} --caches ${G_CACHES:-rocketkv} ${G_EXTRA:-} --out $OUT/g32/$v > $OUT/g32/$v.log 2>&1
        echo "gemma32_rk_tf $v rc=$? $(date -u +%T)" >> $OUT/stages.txt
        grep -h '^{' $OUT/g32/$v.log | python -c "import sys,json; [print('  $v', r.get('cache'), r.get('decode_ms_per_token'), r.get('transformers', '')) for r in map(json.loads, sys.stdin)]" >> $OUT/stages.txt 2>&1
      done ;;
    prof_tf525) mkdir -p $OUT/gprof525; PYTHONPATH=/tmp/tf525:. timeout 200 python -m benchmarks.probes.profile_hybrid_step --model ${PROF_MODEL:-gemma-3-12b} --context 32768 --out $OUT/gprof525 > $OUT/gprof525/log.txt 2>&1; echo "prof_tf525 rc=$? $(date -u +%T)" >> $OUT/stages.txt; gzip -9 $OUT/gprof525/*trace*.json; grep '^{' $OUT/gprof525/log.txt >> $OUT/stages.txt ;;
    prof_b1) mkdir -p $OUT/prof; timeout 240 python -m benchmarks.probes.profile_graph_step --batch 1 --context 32768 --eager --out $OUT/prof > $OUT/prof/log.txt 2>&1; echo "prof_b1 rc=$?" >> $OUT/stages.txt ;;
    eager_b1) mkdir -p $OUT/eager; timeout 200 python -m hf_rocketkv.bench.decode --batch 1 --context 32768 --new-tokens 48 --caches rocketkv rocketkv-graphs --no-plot --out $OUT/eager > $OUT/eager/log.txt 2>&1; echo "eager_b1 rc=$?" >> $OUT/stages.txt ;;
  esac
done
for stage in "$@"; do
  case $stage in
    ab_gemma_qkv) mkdir -p $OUT/ab_gemma
      timeout 170 python -m benchmarks.hybrid_decode --models gemma-3-12b --caches rocketkv-qkv-off rocketkv --out $OUT/ab_gemma/p1 > $OUT/ab_gemma/p1.log 2>&1; echo "ab_gemma p1 rc=$?" >> $OUT/stages.txt
      timeout 170 python -m benchmarks.hybrid_decode --models gemma-3-12b --caches rocketkv rocketkv-qkv-off --out $OUT/ab_gemma/p2 > $OUT/ab_gemma/p2.log 2>&1; echo "ab_gemma p2 rc=$?" >> $OUT/stages.txt
      grep -h decode_ms_per_token $OUT/ab_gemma/p*.log | python -c "import sys,json; [print(json.loads(l)['cache'], round(json.loads(l)['decode_ms_per_token'],3)) for l in sys.stdin if l.startswith('{')]" >> $OUT/stages.txt 2>&1 ;;
  esac
done
for stage in "$@"; do
  case $stage in
    h48_gemma32) mkdir -p $OUT/h48; timeout ${T_GEMMA32:-300} python -m benchmarks.hybrid_decode --models gemma-3-12b --caches rocketkv static-compile --out $OUT/h48/gemma32 > $OUT/h48/gemma32.log 2>&1; echo "h48_gemma32 rc=$? $(date -u +%T)" >> $OUT/stages.txt ;;
    h48_gemma_engine) mkdir -p $OUT/h48; timeout ${T_ENGINE:-200} python -m benchmarks.hybrid_batching --model gemma-3-12b --requests 16 --prompt-len 8192 --new-tokens 256 --out $OUT/h48/gemma_engine > $OUT/h48/gemma_engine.log 2>&1; echo "h48_gemma_engine rc=$? $(date -u +%T)" >> $OUT/stages.txt ;;
    h48_gptoss32) mkdir -p $OUT/h48; timeout ${T_GPTOSS:-200} python -m benchmarks.hybrid_decode --models gpt-oss-20b --caches rocketkv static-compile --out $OUT/h48/gptoss32 > $OUT/h48/gptoss32.log 2>&1; echo "h48_gptoss32 rc=$? $(date -u +%T)" >> $OUT/stages.txt ;;
    h48_gemma128) mkdir -p $OUT/h48; timeout ${T_GEMMA128:-480} python -m benchmarks.hybrid_decode --models gemma-3-12b --caches rocketkv static-compile --context 128000 --dense-prefill-chunk 8192 --out $OUT/h48/gemma128 > $OUT/h48/gemma128.log 2>&1; echo "h48_gemma128 rc=$? $(date -u +%T)" >> $OUT/stages.txt ;;
  esac
done
for stage in "$@"; do
  case $stage in
    res_kernel_tests) mkdir -p $OUT/gpu_res; timeout 120 python -m pytest -p no:cacheprovider -q -m gpu tests/kernels/test_residual_norm.py tests/kernels/test_rms_norm.py > $OUT/gpu_res/kernels.log 2>&1; echo "res_kernel_tests rc=$? $(date -u +%T)" >> $OUT/stages.txt ;;
    res_gemma32) mkdir -p $OUT/h48; timeout ${T_GEMMA32:-320} python -m benchmarks.hybrid_decode --models gemma-3-12b --caches rocketkv-residual-off rocketkv static-compile --out $OUT/h48/gemma32 > $OUT/h48/gemma32.log 2>&1; echo "res_gemma32 rc=$? $(date -u +%T)" >> $OUT/stages.txt ;;
  esac
done
for stage in "$@"; do
  case $stage in
    nr_tests) mkdir -p $OUT/gpu_nr; timeout 200 python -m pytest -p no:cacheprovider -q -m gpu tests/kernels/test_rope_norm.py tests/kernels/test_rope.py tests/integration/test_qkv.py tests/kernels/test_residual_norm.py > $OUT/gpu_nr/tests.log 2>&1; echo "nr_tests rc=$? $(date -u +%T)" >> $OUT/stages.txt ;;
    gemma_prof) mkdir -p $OUT/gprof; timeout 300 python -m benchmarks.probes.profile_hybrid_step --model ${PROF_MODEL:-gemma-3-12b} --context 32768 --out $OUT/gprof > $OUT/gprof/log.txt 2>&1; echo "gemma_prof rc=$? $(date -u +%T)" >> $OUT/stages.txt; gzip -9 $OUT/gprof/*trace*.json
      python -c "
import json; d=json.load(open('$OUT/gprof/profile_hybrid_step.json'))
for r in d['rows']:
  print(r['row'], r.get('generate_ms_per_step'), r.get('gpu_busy_ms_per_step'), r.get('kernels_per_step'))
  [print('  ',k,v) for k,v in r['by_kind'].items()]
  [print('   %8.1f %6.1f %s'%(t['us_per_step'],t['calls_per_step'],t['name'][:100])) for t in r['top_kernels'][:45]]
  print('  launch gaps', r.get('launch_gaps_ms_per_step'))
  [print('   gap %8.1f us %6.1f /step %6.2f us  %s'%(g['us_per_step'],g['per_step'],g['mean_us'],g['pair'])) for g in r.get('top_gap_pairs',[])]
" > $OUT/gprof/summary.txt 2>&1 ;;
    gemma32_rk) mkdir -p $OUT/h48; timeout 150 python -m benchmarks.hybrid_decode --models gemma-3-12b --caches rocketkv --out $OUT/h48/gemma32_rk > $OUT/h48/gemma32_rk.log 2>&1; echo "gemma32_rk rc=$? $(date -u +%T)" >> $OUT/stages.txt ;;
    tune_cold) timeout ${T_TUNE:-200} python -m benchmarks.probes.tune_gated_projection --parts attention --rows 1 16 64 --copies 8 --out $OUT/tune_cold.json > $OUT/tune_cold.log 2>&1; echo "tune_cold rc=$? $(date -u +%T)" >> $OUT/stages.txt ;;
    ab_oproj_llama) mkdir -p $OUT/ab_oproj_llama
      for row in ${AB_ROWS:-off_1 on_1 off_2 on_2}; do
        flag=1; case $row in off*) flag=0;; esac
        HF_ROCKETKV_AB_OPROJ=$flag timeout 100 python -m hf_rocketkv.bench.decode --batch 1 --context 32768 --new-tokens 64 --caches rocketkv-graphs --no-plot --out $OUT/ab_oproj_llama/$row > $OUT/ab_oproj_llama/$row.log 2>&1
        echo "ab_oproj_llama $row rc=$? $(date -u +%T)" >> $OUT/stages.txt
        python -c "import json,sys; r=json.load(open('$OUT/ab_oproj_llama/$row/decode_bench.json'))['rows']; print('$row', [(x.get('cache'), x.get('decode_ms_per_token')) for x in r])" >> $OUT/stages.txt 2>&1
      done ;;
    ab_oproj) mkdir -p $OUT/ab_oproj
      for row in ${AB_ROWS:-off_1 on_1 off_2 on_2}; do
        flag=1; case $row in off*) flag=0;; esac
        HF_ROCKETKV_AB_OPROJ=$flag timeout 90 python -m benchmarks.hybrid_decode --models ${AB_MODEL:-gemma-3-12b} --caches rocketkv --out $OUT/ab_oproj/$row > $OUT/ab_oproj/$row.log 2>&1
        echo "ab_oproj $row rc=$? $(date -u +%T) $(grep -o '"decode_ms_per_token": [0-9.]*' $OUT/ab_oproj/$row.log)" >> $OUT/stages.txt
      done ;;
    chain_tests) mkdir -p $OUT/gpu_chain; timeout 240 python -m pytest -p no:cacheprovider -q -m gpu tests/kernels/test_residual_norm.py tests/integration/test_residual.py tests/integration/test_layer_chain.py tests/kernels/test_rope_norm.py tests/integration/test_qkv.py tests/integration/test_norm.py > $OUT/gpu_chain/tests.log 2>&1; echo "chain_tests rc=$? $(date -u +%T)" >> $OUT/stages.txt ;;
    seen_tests) mkdir -p $OUT/gpu_seen; timeout ${T_SEEN:-240} python -m pytest -p no:cacheprovider -q -m gpu tests/kernels/test_ring_append.py tests/kernels/test_paged_ops.py tests/gpu/test_decode_graphs_gpu.py tests/gpu/test_hybrid_decode_gpu.py > $OUT/gpu_seen/tests.log 2>&1; echo "seen_tests rc=$? $(date -u +%T)" >> $OUT/stages.txt ;;
    res_tests) mkdir -p $OUT/gpu_res; timeout 150 python -m pytest -p no:cacheprovider -q -m gpu $(ls tests/kernels/test_residual_norm.py tests/integration/test_residual.py 2>/dev/null) > $OUT/gpu_res/tests.log 2>&1; echo "res_tests rc=$? $(date -u +%T)" >> $OUT/stages.txt ;;
    ab_res_llama) python -c "from hf_rocketkv import RocketKVConfig; open('/tmp/res_on.yaml','w').write(RocketKVConfig().to_yaml()); open('/tmp/res_off.yaml','w').write(RocketKVConfig(fused_residual=False).to_yaml())"
      mkdir -p $OUT/ab_res
      for row in ${AB_ROWS:-off_1 on_1 off_2 on_2}; do
        extra="--config /tmp/res_on.yaml"; case $row in off*) extra="--config /tmp/res_off.yaml";; esac
        timeout 100 python -m hf_rocketkv.bench.decode --batch 1 --context 32768 --new-tokens 64 --caches rocketkv-graphs --no-plot $extra --out $OUT/ab_res/$row > $OUT/ab_res/$row.log 2>&1
        echo "ab_res $row rc=$? $(date -u +%T)" >> $OUT/stages.txt
        python -c "import json,sys; r=json.load(open('$OUT/ab_res/$row/decode_bench.json'))['rows']; print('$row', [(x.get('cache'), x.get('decode_ms_per_token')) for x in r])" >> $OUT/stages.txt 2>&1
      done ;;
  esac
done
for stage in "$@"; do
  case $stage in
    ru_gemma32) mkdir -p $OUT/ru; for p in ${RU_PASSES:-p1}; do caches="rocketkv-stop-sync rocketkv"; [ $p = p2 ] && caches="rocketkv rocketkv-stop-sync"
        timeout ${T_RU:-170} python -m benchmarks.hybrid_decode --models gemma-3-12b --caches $caches --out $OUT/ru/gemma32_$p > $OUT/ru/gemma32_$p.log 2>&1; echo "ru_gemma32 $p rc=$? $(date -u +%T)" >> $OUT/stages.txt
        grep -h '^{' $OUT/ru/gemma32_$p.log | python -c "import sys,json; [print('  ', r.get('cache'), r.get('decode_ms_per_token'), r.get('ttft_s')) for r in map(json.loads, sys.stdin) if 'cache' in r]" >> $OUT/stages.txt 2>&1; done ;;
    ru_tests) mkdir -p $OUT/gpu_ru; timeout ${T_RUT:-220} python -m pytest -p no:cacheprovider -q -m gpu ${RU_K:+-k "$RU_K"} tests/kernels/test_ring_append.py tests/gpu/test_hybrid_decode_gpu.py > $OUT/gpu_ru/tests.log 2>&1; echo "ru_tests rc=$? $(date -u +%T)" >> $OUT/stages.txt; tail -3 $OUT/gpu_ru/tests.log >> $OUT/stages.txt ;;
    ru_gptoss32) mkdir -p $OUT/ru; timeout ${T_RUG:-170} python -m benchmarks.hybrid_decode --models gpt-oss-20b --caches rocketkv-stop-sync rocketkv --out $OUT/ru/gptoss32 > $OUT/ru/gptoss32.log 2>&1; echo "ru_gptoss32 rc=$? $(date -u +%T)" >> $OUT/stages.txt
        grep -h '^{' $OUT/ru/gptoss32.log | python -c "import sys,json; [print('  ', r.get('cache'), r.get('decode_ms_per_token'), r.get('ttft_s')) for r in map(json.loads, sys.stdin) if 'cache' in r]" >> $OUT/stages.txt 2>&1 ;;
  esac
done
for stage in "$@"; do
  case $stage in
    ru_gemma128) mkdir -p $OUT/ru; timeout ${T_RU128:-150} python -m benchmarks.hybrid_decode --models gemma-3-12b --caches rocketkv rocketkv-stop-sync --context 128000 --rocketkv-prefill-chunk 8192 --out $OUT/ru/gemma128 > $OUT/ru/gemma128.log 2>&1; echo "ru_gemma128 rc=$? $(date -u +%T)" >> $OUT/stages.txt
        grep -h '^{' $OUT/ru/gemma128.log | python -c "import sys,json; [print('  ', r.get('cache'), r.get('decode_ms_per_token'), r.get('ttft_s')) for r in map(json.loads, sys.stdin) if 'cache' in r]" >> $OUT/stages.txt 2>&1 ;;
  esac
done
for stage in "$@"; do
  case $stage in
    eng_prof) mkdir -p $OUT/eprof; timeout ${T_EPROF:-260} python -m benchmarks.probes.engine_decode_profile --model ${EP_MODEL:-gemma-3-12b} --requests 16 --out $OUT/eprof > $OUT/eprof/log.txt 2>&1; echo "eng_prof rc=$? $(date -u +%T)" >> $OUT/stages.txt
      python -c "
import json; d=json.load(open('$OUT/eprof/engine_decode_profile.json'))
print({k: d[k] for k in ('wall_prefill_s','wall_full_s','output_tokens_per_s','decode_ms_per_step') if k in d})
s=d['decode_step']; print('busy', s.get('gpu_busy_ms_per_step'), 'kernels', s.get('kernels_per_step'))
[print('  ',k,v) for k,v in s['by_kind'].items()]
[print('   ', t) for t in (s.get('top_kernels') or d.get('top_kernels') or [])[:40]]
" > $OUT/eprof/summary.txt 2>&1 ;;
  esac
done
for stage in "$@"; do
  case $stage in
    win_probe) mkdir -p $OUT/winp; for m in ${WIN_MODELS:-gemma-3-12b gpt-oss-20b}; do timeout ${T_WIN:-150} python -m benchmarks.probes.profile_hybrid_prefill --model $m --prompt-len 8192 --repeats 5 --out $OUT/winp/$m > $OUT/winp/$m.log 2>&1; echo "win_probe $m rc=$? $(date -u +%T)" >> $OUT/stages.txt
      python -c "
import json; d=json.load(open('$OUT/winp/$m/profile_hybrid_prefill.json')); print('  prefill_ms', d['prefill']['prefill_ms'])
[print('  ', r) for r in d['attention']]" >> $OUT/stages.txt 2>&1; done ;;
  esac
done
for stage in "$@"; do
  case $stage in
    win_tests) mkdir -p $OUT/gpu_win; timeout ${T_WINT:-120} python -m pytest -p no:cacheprovider -q -m gpu tests/integration/test_window_prefill.py tests/integration/test_attention_spans.py > $OUT/gpu_win/tests.log 2>&1; echo "win_tests rc=$? $(date -u +%T)" >> $OUT/stages.txt; tail -3 $OUT/gpu_win/tests.log >> $OUT/stages.txt ;;
    win_engine) mkdir -p $OUT/win_engine; for m in ${WE_MODELS:-gemma-3-12b}; do req=16; [ $m = gpt-oss-20b ] && req=32
      for row in ${WE_ROWS:-off on}; do flag=True; [ $row = off ] && flag=False
        timeout ${T_WE:-170} python -c "
import sys, runpy
import hf_rocketkv.integration.window_prefill as w
w._TAKES_WINDOW = w._TAKES_WINDOW and $flag
sys.argv = ['hybrid_batching', '--model', '$m', '--requests', '$req', '--prompt-len', '8192', '--new-tokens', '256', '--out', '$OUT/win_engine/${m}_$row']
runpy.run_module('benchmarks.hybrid_batching', run_name='__main__')
" > $OUT/win_engine/${m}_$row.log 2>&1; echo "win_engine $m $row rc=$? $(date -u +%T)" >> $OUT/stages.txt
        python -c "
import json; d=json.load(open('$OUT/win_engine/${m}_$row/hybrid_batching.json'))
print('  ${m} $row', [(c['call'], round(c['wall_s'],2), round(c['output_tokens_per_s'],1), c['first_tokens'][0][:2]) for c in d['calls']])" >> $OUT/stages.txt 2>&1; done; done ;;
  esac
done
for stage in "$@"; do
  case $stage in
    win_ab) mkdir -p $OUT/win_ab; for m in ${WAB_MODELS:-gemma-3-12b gpt-oss-20b}; do timeout ${T_WAB:-80} python -m benchmarks.probes.window_prefill_ab --model $m --repeats 3 --rounds 2 --out $OUT/win_ab/$m > $OUT/win_ab/$m.log 2>&1; echo "win_ab $m rc=$? $(date -u +%T)" >> $OUT/stages.txt; grep -h '^{' $OUT/win_ab/$m.log >> $OUT/stages.txt; done ;;
  esac
done
