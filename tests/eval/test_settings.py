"""The run config of ``hf-rocketkv eval`` (eval/settings.py): YAML errors name the key, a valid file loads."""

from __future__ import annotations

import pytest

from hf_rocketkv.eval.settings import run_config_from_dict


def test_yaml_settings_errors_name_the_key():
    with pytest.raises(ValueError, match=r"unknown top-level key\(s\) \['evaluation'\]"):
        run_config_from_dict({"evaluation": {}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lenghts'\] in 'eval'"):
        run_config_from_dict({"eval": {"lenghts": [1024]}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['top_k'\]"):
        run_config_from_dict({"sparse_attention_config": {"algorithm": "rocket", "top_k": 3}})
    with pytest.raises(ValueError, match="eval.depths must be"):
        run_config_from_dict({"eval": {"depths": [1.5]}})
    with pytest.raises(ValueError, match="eval.samples must be"):
        run_config_from_dict({"eval": {"samples": "two"}})
    run = run_config_from_dict(
        {"sparse_attention_config": {"prompt_budget": 256, "topk": 16}, "eval": {"tasks": "passkey"}}
    )
    assert run.rocket.prompt_budget == 256 and run.eval.tasks == ["passkey"]
    assert run.eval.replace(samples=None, seed=5).seed == 5
