"""``check_first_kept`` checks every row over the budget, also the rows after one whose window fills its budget."""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv.policies.base import KeptSlots, Stage1Inputs
from hf_rocketkv.policies.keep_first import check_first_kept


class HandRows:
    """The fields check_first_kept reads, written by hand: budget 8, keep_first 4."""

    budget, keep_first = 8, 4
    forced_count = Stage1Inputs.forced_count

    def __init__(self, rows):
        self._rows = rows

    def rows(self):
        return self._rows


def kept(slots: list[int], heads: int = 2) -> KeptSlots:
    row = torch.tensor(slots).expand(heads, -1).clone()
    return KeptSlots(slots=row, counts=torch.full((heads,), len(slots)))


def test_a_row_whose_window_fills_the_budget_does_not_end_the_check():
    # row 0: 20 tokens, window 8 = budget -> no forced slot (min(4, 8 - 8, ...) = 0); row 1: window 2 -> 4 forced
    # slots 0..3, and its kept slots lack slot 0
    inputs = HandRows([(0, 20, 8), (0, 20, 2)])
    rows = [kept(list(range(12, 20))), kept([1, 2, 3, 14, 15, 16, 17, 18])]
    with pytest.raises(ValueError, match="first 4 slots of row 1"):
        check_first_kept(inputs, rows, "hand-made")


def test_rows_keeping_their_forced_slots_pass():
    inputs = HandRows([(0, 20, 8), (0, 20, 2)])
    check_first_kept(inputs, [kept(list(range(12, 20))), kept([0, 1, 2, 3, 16, 17, 18, 19])], "hand-made")
