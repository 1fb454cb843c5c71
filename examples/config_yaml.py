"""Read and write RocketKV configs in TensorRT-LLM's YAML shape.

    python examples/config_yaml.py
"""

from hf_rocketkv import RocketKVConfig

TRTLLM_YAML = """
sparse_attention_config:
  algorithm: rocket
  window_size: 32
  kernel_size: 63
  prompt_budget: 2048
  topk: 64
  topr: 128
  page_size: 4
  kt_cache_dtype: float8_e5m2
"""


def main() -> None:
    config = RocketKVConfig.from_yaml(TRTLLM_YAML)
    print(config)
    print(config.replace(prompt_budget=256, topk=16, backend="torch").to_yaml())
    try:
        RocketKVConfig(page_size=3)
    except ValueError as err:
        print("rejected:", err)


if __name__ == "__main__":
    main()
