"""How many pool pages a RocketKV request takes: the one owner of RocketKV's page arithmetic.

The pool (memory/) counts pages; what a RocketKV request keeps (``prompt_budget`` tokens per row after stage 1, the
tokens generated on top, keep_all's whole conversation) is decided here, from the request's RocketKVConfig.
Formulas: docs/memory.md.
"""

from __future__ import annotations

from ..config import RocketKVConfig
from ..memory import KVBlockPool
from ..memory.accounting import RowPages, row_pages
from ..memory.pool import check_pool_policy

__all__ = ["check_pool_policy", "request_pages"]


def request_pages(config: RocketKVConfig, pool: KVBlockPool, prompt_len: int, max_new_tokens: int, *,
                  keep_all: bool | None = None) -> RowPages:
    """One row's pages at its cold prefill peak and once compressed (``RowPages``), in ``pool``'s pages.

    ``keep_all``: keep the whole conversation (default: ``config.multi_turn == "keep_all"``)."""
    keep_all = config.multi_turn == "keep_all" if keep_all is None else keep_all
    return row_pages(prompt_len, max_new_tokens, pool.page_size, config.prompt_budget,
                     prefix_reuse=pool.prefix_reuse, keep_all=keep_all)
