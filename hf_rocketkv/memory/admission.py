"""Admission: the pages one request (one batch row) got from ``KVBlockPool.admit``.

Life of a row (the consumer is RocketKVCache with a pool; docs/memory.md):

    adm = pool.admit(P, N, cfg, token_ids=ids)     # atomic: every page or none (PoolExhaustedError)
    # prompt tokens [0, adm.reused_tokens) are already in adm.prompt's first pages (a prefix hit):
    # compute and write tokens [adm.reused_tokens, P) into adm.prompt, run stage 1 over all P tokens,
    # write the survivors into adm.view (then decode appends there)
    pool.commit_prompt(adm)                        # the prompt's full pages join the prefix index
    pool.release(adm.prompt)                       # prompt pages become cached (free, yet hittable)
    ...decode...
    pool.release(adm)                              # everything left goes back
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .block_table import BlockTable
from .hashing import PrefixKeys
from .sliding_slab import SlotLease


@dataclass
class Admission:
    """One row's tables and what its prefix hit covered.

    prompt          prompt table: ``hit_pages`` reused pages, then fresh ones, positional, room for
                    ``RowDemand.prompt_table_tokens`` (keep_all: the new tokens too; prefix reuse off:
                    ``max(prompt, view)`` pages, compacted in place)
    page_size       the pool's tokens per page
    view            view table: ``ceil(RowDemand.view_tokens / page_size)`` fresh pages (empty when reuse is off)
    page_hashes     chained hashes of the prompt's full pages (empty without token ids or with reuse off)
    reused_tokens   prompt tokens whose K/V came from the prefix index (``hit_pages * page_size``)
    computed_tokens prompt tokens the model must compute (``prompt_len - reused_tokens``)
    onloaded_pages  hit pages brought back from host memory for this admission
    slot            the row's sliding-window slot (a pool of a model with sliding layers), else None
    """

    prompt: BlockTable
    view: BlockTable
    prompt_len: int
    max_new_tokens: int
    page_size: int
    keys: PrefixKeys
    page_hashes: tuple[bytes, ...] = ()
    hit_pages: int = 0
    onloaded_pages: int = 0
    committed_pages: int = field(default=0)  # full prompt pages registered in the index so far (hits included)
    slot: SlotLease | None = None

    @property
    def reused_tokens(self) -> int:
        return self.hit_pages * self.page_size

    def committed(self, pages: int) -> None:
        """The first ``pages`` full prompt pages are in the prefix index (``PrefixIndex.commit_prompt``)."""
        self.committed_pages = pages

    @property
    def computed_tokens(self) -> int:
        return self.prompt_len - self.reused_tokens
