"""memory/accounting.py on its own: a row's table sizes in pages (RowDemand.pages) for each of the three cases of
the module docstring, the field checks, and PagesNeeded.as_dict; every expected number is worked out by hand."""

import pytest

from hf_rocketkv.memory.accounting import PagesNeeded, RowDemand, RowPages, ceil_div


def test_ceil_div():
    assert [ceil_div(a, 8) for a in (0, 1, 7, 8, 9, 16, 17)] == [0, 1, 1, 1, 2, 2, 3]


def test_prompt_table_defaults_to_the_prompt():
    """P = 100, V = 40, page 8: prompt table ceil(100 / 8) = 13 pages, view ceil(40 / 8) = 5."""
    row = RowDemand(prompt_tokens=100, new_tokens=10, view_tokens=40, hit_cap_tokens=96)
    assert row.prompt_table_tokens == 100
    assert (row.prompt_table_pages(8), row.view_pages(8)) == (13, 5)


@pytest.mark.parametrize("keep_prompt, reuse, expected", [
    # prefix reuse on: peak = prompt + view = 13 + 5, steady = view
    (False, True, RowPages(13, 5, 18, 5)),
    # reuse off: the prompt table is compacted in place, peak = max(13, 5), steady = view, no view table
    (False, False, RowPages(13, 0, 13, 5)),
    # prompt kept (T = 100 + 10 = 110: 14 pages): peak = steady = prompt + view, reuse or not
    (True, True, RowPages(14, 5, 19, 19)),
    (True, False, RowPages(14, 5, 19, 19)),
])
def test_pages_in_each_case(keep_prompt, reuse, expected):
    table = 110 if keep_prompt else None
    row = RowDemand(100, 10, 40, 96, prompt_table_tokens=table, keep_prompt=keep_prompt)
    assert row.pages(8, reuse) == expected


def test_pages_default_is_prefix_reuse_on():
    row = RowDemand(100, 10, 40, 96)
    assert row.pages(8) == RowPages(13, 5, 18, 5)
    # reuse off with a view larger than the prompt: the in-place table grows to the view, max(3, 7) = 7
    assert RowDemand(20, 30, 50, 16).pages(8, False) == RowPages(7, 0, 7, 7)


@pytest.mark.parametrize("field", ["prompt_tokens", "new_tokens", "view_tokens", "hit_cap_tokens"])
def test_refusals_name_the_field(field):
    values = {"prompt_tokens": 10, "new_tokens": 1, "view_tokens": 5, "hit_cap_tokens": 8}
    values[field] = -1
    with pytest.raises(ValueError, match=rf"^RowDemand\.{field} must be an integer >= 0, got -1$"):
        RowDemand(**values)


def test_other_refusals():
    with pytest.raises(ValueError, match=r"^RowDemand\.prompt_table_tokens must be an integer >= 10, got 9$"):
        RowDemand(10, 1, 5, 8, prompt_table_tokens=9)
    with pytest.raises(ValueError, match=r"RowDemand\.hit_cap_tokens=11 exceeds prompt_tokens=10"):
        RowDemand(10, 1, 5, 11)
    with pytest.raises(ValueError, match=r"RowDemand\.keep_prompt must be True or False, got 1"):
        RowDemand(10, 1, 5, 8, keep_prompt=1)
    assert RowDemand(10, 1, 5, 10).hit_cap_tokens == 10  # the cap may cover the whole prompt


def test_pages_needed_as_dict():
    needed = PagesNeeded(prefill_peak=9, steady_state=4, prompt_pages=6, view_pages=3, hit_pages=2,
                         hit_pages_free=1, hit_pages_host=1, hit_tokens=16, new_pages=8, rows=2)
    assert needed.as_dict() == {"prefill_peak": 9, "steady_state": 4, "prompt_pages": 6, "view_pages": 3,
                                "hit_pages": 2, "hit_pages_free": 1, "hit_pages_host": 1, "hit_tokens": 16,
                                "new_pages": 8, "rows": 2, "slots": 0, "prefill_peak_bytes": 0,
                                "steady_state_bytes": 0}
    assert list(needed.as_dict()) == ["prefill_peak", "steady_state", "prompt_pages", "view_pages", "hit_pages",
                                      "hit_pages_free", "hit_pages_host", "hit_tokens", "new_pages", "rows", "slots",
                                      "prefill_peak_bytes", "steady_state_bytes"]
