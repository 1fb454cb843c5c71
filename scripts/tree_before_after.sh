#!/usr/bin/env bash
# One device call alternating two source trees on the same cases, each case a fresh process: the measurement of a
# refactor that must not move the numbers. Run from the repository root, with the older tree unpacked beside it:
#
#   git archive e62e424 --prefix=_before/ | tar -x        # the tree before (untracked, travels with the work tree)
#   git archive HEAD --prefix=_after/ | tar -x            # optional: the tree after, fixed while you edit (AFTER=_after)
#   OUT=/tmp/ab ROUNDS=2 bash scripts/tree_before_after.sh decode      # bs1 x 32k and bs64 x 8k decode ms/token
#   OUT=/tmp/ab ROUNDS=1 bash scripts/tree_before_after.sh engine      # generate_batch 32 x 8k / 512, tokens/s
#
# Cases (Llama-3.1-8B shapes, random bf16 weights, RocketKV defaults with CUDA graphs):
#   decode   python -m hf_rocketkv.bench.decode --batch 1 --context 32768 --new-tokens 64 --caches rocketkv-graphs,
#            and --batch 64 --context 8192 --prefill-batch-size 8 (decode ms/token from CUDA events)
#   engine   benchmarks/probes/engine_second_call.py (two generate_batch calls on a 30 GiB KVBlockPool; the second
#            call's output tokens/s)
# Each round runs every case on the tree before, then on the tree after, so drift of the card shows in both. Every
# row lands in $OUT/before_after_<cases>.jsonl (tree, round, case, the measurement) and the log in
# $OUT/before_after_<cases>.log.
set -u
cd "$(dirname "$0")/.."
CASES=${1:-decode}
BEFORE=${BEFORE:-_before}
AFTER=${AFTER:-.}
ROUNDS=${ROUNDS:-1}
CASE_TIMEOUT=${CASE_TIMEOUT:-400}  # seconds each case's process may run
DECODE_CASES=${DECODE_CASES:-"bs1 bs64"}  # which decode cases (a short device call: bs1 only)
OUT=${OUT:-out}
PY=${PYTHON:-python}
mkdir -p "$OUT"
LOG="$OUT/before_after_$CASES.log"
ROWS="$OUT/before_after_$CASES.jsonl"
HERE=$(pwd)

decode_case() {  # tree label, round, case name, bench.decode arguments...
  local tree=$1 round=$2 name=$3; shift 3
  local dir
  dir=$(mktemp -d)
  (cd "$tree" && PYTHONPATH=. timeout "$CASE_TIMEOUT" $PY -m hf_rocketkv.bench.decode "$@" --caches rocketkv-graphs --no-plot \
      --out "$dir") >>"$LOG" 2>&1
  $PY - "$dir/decode_bench.json" "$tree" "$round" "$name" >>"$ROWS" <<'EOF'
import json, sys
path, tree, rnd, name = sys.argv[1:]
try:
    rows = json.load(open(path))["rows"]
except OSError as err:
    rows = [{"status": f"no result: {err}"}]
for row in rows:
    keep = {k: row.get(k) for k in ("cache", "batch", "context", "status", "decode_ms_per_token", "prefill_s",
                                     "peak_gib", "tokens_per_s")}
    print(json.dumps(dict(tree=tree, round=int(rnd), case=name, **keep)))
EOF
}

engine_case() {  # tree label, round
  local tree=$1 round=$2
  (cd "$tree" && PYTHONPATH=. timeout "$CASE_TIMEOUT" $PY "$HERE/benchmarks/probes/engine_second_call.py" --label "$tree") \
      >"$OUT/engine.tmp" 2>&1
  cat "$OUT/engine.tmp" >>"$LOG"
  grep '^ENGINE ' "$OUT/engine.tmp" | sed 's/^ENGINE //' | $PY -c "
import json, sys
for line in sys.stdin:
    print(json.dumps(dict(tree='$tree', round=$round, case='engine_32x8k_512', **json.loads(line))))" >>"$ROWS"
  rm -f "$OUT/engine.tmp"
}

for round in $(seq 1 "$ROUNDS"); do
  for tree in "$BEFORE" "$AFTER"; do
    echo "== round $round tree $tree $(date -u +%H:%M:%S)" | tee -a "$LOG"
    if [ "$CASES" = decode ]; then
      case " $DECODE_CASES " in *" bs1 "*)
        decode_case "$tree" "$round" decode_bs1_32k --batch 1 --context 32768 --new-tokens 64 ;; esac
      case " $DECODE_CASES " in *" bs64 "*)
        decode_case "$tree" "$round" decode_bs64_8k --batch 64 --context 8192 --new-tokens 64 \
          --prefill-batch-size 8 ;; esac
    else
      engine_case "$tree" "$round"
    fi
    tail -n 2 "$ROWS"
  done
done
