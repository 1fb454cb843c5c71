"""memory/ knows RocketKVConfig only through ``as_budget``, which ``hf_rocketkv.cache`` registers when it loads; the
tests here pass RocketKVConfigs to pools, so the cache is loaded before any of them runs (a file run alone included)."""

import hf_rocketkv.cache  # noqa: F401
