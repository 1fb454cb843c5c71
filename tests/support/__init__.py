"""Helpers shared by more than one test folder: plain functions and classes, imported package-absolute
(``from tests.support.tiny_models import make_models``). Fixtures live in the conftest.py nearest to the tests that
use them; helpers of one folder live in that folder (tests/memory/helpers.py, tests/serving/helpers.py, ...).

- tiny_models.py: tiny random models (Llama, Mistral, Qwen2, Qwen3), RocketKV configs, generate helpers, a
  character tokenizer for them and CPU pools sized for them.
- stage2_oracle.py: brute-force float64 references of stage 2 (KT pages, page scores, the pages to choose, sparse
  attention).
- decode_runners.py: generate()'s compiled-decode path on a CPU and a stand-in for CUDA graph capture.
- repo.py: the repository root, and the environment and torchrun command of a subprocess that runs this checkout.
"""
