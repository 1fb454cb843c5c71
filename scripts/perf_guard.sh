#!/usr/bin/env bash
# The performance guard (benchmarks/perf_guard.py): on this machine's GPU, the headline cases beside their baselines
# in one process, judged against the floors of benchmarks/perf_floors.json. Run from anywhere; it works in the
# repository root.
#
#   bash scripts/perf_guard.sh                       # every case: decode bs1 x 32k vs StaticCache+compile,
#                                                    # generate_batch 32 x 8k / 512 vs the previous result, and
#                                                    # Gemma-3-12B decode bs1 x 32k vs StaticCache+compile
#   bash scripts/perf_guard.sh --cases decode_bs1_32k
#   OUT=/tmp/out COMMIT=abc1234 bash scripts/perf_guard.sh
#
# Writes $OUT/<device-slug>_<UTC date>_<commit>.json (default OUT=results/perf_guard; the previous result of the
# engine case is read from there too, or from PREVIOUS_DIR). COMMIT defaults to `git rev-parse --short HEAD`: set it
# where the tree came without .git. Prints one line per case (ok / FAIL / not judged) and exits 1 when a case is
# below its floor or could not be measured.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-results/perf_guard}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
previous=()
[ -n "${PREVIOUS_DIR:-}" ] && previous=(--previous-dir "$PREVIOUS_DIR")
echo "== $PY -m benchmarks.perf_guard --out $OUT --commit $COMMIT ${previous[*]+${previous[*]}} $*"
exec $PY -m benchmarks.perf_guard --out "$OUT" --commit "$COMMIT" ${previous[@]+"${previous[@]}"} "$@"
