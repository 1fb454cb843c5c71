#!/usr/bin/env bash
# Runs every test marked `gpu` (tests/gpu and the GPU-only tests elsewhere in tests/) on this machine's GPU(s) and
# writes a results file. Run from anywhere; it works in the repository root.
#
#   bash scripts/gpu_tests.sh                         # pytest -m gpu tests
#   bash scripts/gpu_tests.sh tests/gpu -x            # other pytest paths / options instead of "tests"
#   OUT=/tmp/out COMMIT=abc1234 bash scripts/gpu_tests.sh
#
# Writes $OUT/<device-slug>_<UTC date>_<commit>.json (default OUT=results/gpu_tests; see scripts/gpu_test_summary.py
# for its fields). COMMIT defaults to `git rev-parse --short HEAD`: set it where the tree came without .git. A machine
# without network gets pytest, hypothesis, pytest-timeout and the serve extra from .device_wheels/ (pip --no-index;
# fill it with `pip download -d .device_wheels --python-version 3.12 --only-binary=:all: --platform
# manylinux2014_x86_64 pytest hypothesis pytest-timeout fastapi uvicorn httpx prometheus-client`). TEST_TIMEOUT
# (default 900) bounds one test's seconds. Exits with pytest's status.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-results/gpu_tests}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
if ! $PY -c "import pytest, hypothesis" 2>/dev/null; then  # a GPU machine without network: the carried wheels
  $PY -m pip install -q --no-index --find-links .device_wheels pytest hypothesis pytest-timeout
fi
if ! $PY -c "import fastapi, uvicorn, httpx, prometheus_client" 2>/dev/null && [ -d .device_wheels ]; then
  # the server's tests (tests/gpu/test_serve_defaults_gpu.py) skip without the serve extra
  $PY -m pip install -q --no-index --find-links .device_wheels fastapi uvicorn httpx prometheus-client || true
fi
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
paths=("$@")
[ ${#paths[@]} -eq 0 ] && paths=(tests)
timeout_opt=()
$PY -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout="${TEST_TIMEOUT:-900}")
command=($PY -m pytest -m gpu "${paths[@]}" -q -p no:cacheprovider ${timeout_opt[@]+"${timeout_opt[@]}"} \
         --junitxml="$work/junit.xml")
echo "== ${command[*]}"
"${command[@]}"
status=$?
$PY scripts/gpu_test_summary.py --junit "$work/junit.xml" --out-dir "$OUT" --commit "$COMMIT" \
  --command "${command[*]}" --exit-status "$status"
exit $status
