"""``import hf_rocketkv`` is cheap and still registers with transformers (integration/import_hook.py).

Each case runs in a fresh interpreter (what is imported is process-wide): the package alone imports neither torch nor
transformers, and whichever order the user imports things in, ``attn_implementation="rocketkv"``, its mask function
and the generate() hooks are in place before transformers' model code can be used.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support.markers import slow_except
from tests.support.repo import ROOT, subprocess_env

HEAVY = ("torch", "transformers", "transformers.modeling_utils", "torch._dynamo", "torch.distributed", "triton",
         "sympy", "yaml", "fastapi", "matplotlib")

CHECK_REGISTERED = """
    from transformers import AttentionInterface, GenerationMixin, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface
    import hf_rocketkv.cache
    assert "rocketkv" in AttentionInterface._global_mapping, "attention not registered"
    assert "rocketkv" in AttentionMaskInterface._global_mapping, "mask not registered"
    assert getattr(GenerationMixin.generate, "__hf_rocketkv_wrapped__", False), "generate() not wrapped"
    assert getattr(PreTrainedModel.get_compiled_call, "__hf_rocketkv_wrapped__", False), "compiled call not wrapped"
    assert hf_rocketkv.cache.RocketKVCache.compatibility_check.__name__ == "require"
    import transformers.modeling_utils as modeling_utils
    assert type(modeling_utils.__loader__).__name__ == "SourceFileLoader", modeling_utils.__loader__
    assert not [f for f in sys.meta_path if type(f).__module__ == "hf_rocketkv.integration.import_hook"]
    print("registered")
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env=subprocess_env(), check=False)


def test_import_loads_nothing_heavy():
    result = run_python(f"""
        import sys
        import hf_rocketkv
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
        print(hf_rocketkv.ATTN_NAME, hf_rocketkv.__version__, "RocketKVCache" in dir(hf_rocketkv))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "rocketkv 0.1.0 True"]


@pytest.mark.parametrize("first", slow_except([  # a fresh interpreter each (6-12 s): two orders by default, CI all
    "import hf_rocketkv",  # then transformers: the hook registers when modeling_utils has run
    "import transformers.modeling_utils; import hf_rocketkv",  # already loaded: registered at import
    "from hf_rocketkv.integration import compat",  # a package module imports transformers itself
    "from hf_rocketkv import RocketKVCache",  # the cache floor (transformers.cache_utils) before the models
    "import hf_rocketkv.cli",
], keep=["import hf_rocketkv", "import transformers.modeling_utils; import hf_rocketkv"]))
def test_registered_whatever_the_import_order(first):
    result = run_python("import sys\n" + first + "\nimport hf_rocketkv\n" + textwrap.dedent(CHECK_REGISTERED))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("registered")


def test_a_model_loads_with_rocketkv_attention_after_a_plain_import():
    """What the README promises: ``import hf_rocketkv`` then ``attn_implementation="rocketkv"``, nothing else."""
    result = run_python("""
        import hf_rocketkv
        from transformers import AutoModelForCausalLM, LlamaConfig
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="rocketkv")
        print(model.config._attn_implementation)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "rocketkv"


def test_public_names_resolve_lazily():
    import hf_rocketkv
    from hf_rocketkv.cache import RocketKVCache
    from hf_rocketkv.config import RocketKVConfig

    assert hf_rocketkv.RocketKVCache is RocketKVCache and hf_rocketkv.RocketKVConfig is RocketKVConfig
    assert set(hf_rocketkv.__all__) <= set(dir(hf_rocketkv))
    with pytest.raises(AttributeError, match="no attribute 'RocketKVCach'"):
        hf_rocketkv.RocketKVCach  # noqa: B018
