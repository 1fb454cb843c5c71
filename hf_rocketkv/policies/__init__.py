"""Stage-1 eviction policies (scores per KV head over the prompt -> kept slots) and the token-budget derivation.

    from hf_rocketkv.policies import get_stage1_policy, Stage1Inputs
    policy = get_stage1_policy("h2o")            # or "snapkv", "streaming", "knorm", "adakv", "random", an object
    kept = policy.select(Stage1Inputs(q_window, keys, start, end, budget=256, scaling=head_dim**-0.5))

Pure objects over tensors: nothing here knows transformers or the cache classes (docs/policies.md).
"""

from .adakv import AdaKVPolicy
from .base import KeptSlots, Stage1Inputs, Stage1Policy, select_by_scores
from .h2o import H2OPolicy, H2OState
from .keep_first import KeepFirst
from .knorm import KnormPolicy
from .random_policy import RandomPolicy
from .registry import STAGE1_POLICY_NAMES, get_stage1_policy, is_stage1_policy
from .scorer import ScorerPolicy
from .snapkv import SnapKVPolicy
from .stage2 import STAGE2_NAMES, every_page, fit_forced_pages, forced_page_counts
from .streaming import StreamingPolicy
from .token_budget import DerivedBudgets, derive_budgets

__all__ = [
    "STAGE1_POLICY_NAMES",
    "STAGE2_NAMES",
    "AdaKVPolicy",
    "DerivedBudgets",
    "H2OPolicy",
    "H2OState",
    "KeepFirst",
    "KeptSlots",
    "KnormPolicy",
    "RandomPolicy",
    "ScorerPolicy",
    "SnapKVPolicy",
    "Stage1Inputs",
    "Stage1Policy",
    "StreamingPolicy",
    "derive_budgets",
    "every_page",
    "fit_forced_pages",
    "forced_page_counts",
    "get_stage1_policy",
    "is_stage1_policy",
    "select_by_scores",
]
