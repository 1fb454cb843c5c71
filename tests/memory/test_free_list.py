"""FreeLists: intrusive queues per priority, checked against a plain-list oracle."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_rocketkv.memory.free_list import UNCACHED, FreeLists, cached_queue

SETTINGS = settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_order_and_counts():
    free = FreeLists(8)
    for page in (3, 1, 4):
        free.push_back(UNCACHED, page)
    free.push_front(UNCACHED, 0)
    free.push_back(cached_queue(50), 6)
    free.push_back(cached_queue(10), 5)
    free.push_back(cached_queue(10), 7)
    assert list(free.iter_queue(UNCACHED)) == [0, 3, 1, 4]
    assert list(free.in_allocation_order()) == [0, 3, 1, 4, 5, 7, 6]
    assert len(free) == 7 and free.count(cached_queue(10)) == 2
    assert free.first_cached() == 5
    assert free.remove(3) == UNCACHED  # from the middle
    assert free.remove(5) == cached_queue(10)
    assert list(free.in_allocation_order()) == [0, 1, 4, 7, 6]
    assert 3 not in free and 7 in free and free.queue_of(3) == -1
    for page in (0, 1, 4):
        free.remove(page)
    assert free.next_in_allocation_order() == 7 and free.first(UNCACHED) is None


def test_double_push_and_bad_remove_raise():
    free = FreeLists(2)
    free.push_back(UNCACHED, 0)
    with pytest.raises(RuntimeError, match="already free"):
        free.push_front(cached_queue(3), 0)
    with pytest.raises(RuntimeError, match="not free"):
        free.remove(1)


operations = st.lists(
    st.tuples(st.sampled_from(["back", "front", "remove"]), st.integers(0, 11), st.sampled_from([0, 1, 2, 36, 101])),
    max_size=60,
)


@SETTINGS
@given(operations)
def test_matches_list_oracle(ops):
    free = FreeLists(12)
    oracle: dict[int, list[int]] = {}  # queue -> pages in order
    for action, page, queue in ops:
        holder = next((q for q, pages in oracle.items() if page in pages), None)
        if action == "remove":
            if holder is None:
                continue
            assert free.remove(page) == holder
            oracle[holder].remove(page)
        elif holder is None:
            (free.push_back if action == "back" else free.push_front)(queue, page)
            pages = oracle.setdefault(queue, [])
            pages.append(page) if action == "back" else pages.insert(0, page)
        expected = [p for q in sorted(oracle) for p in oracle[q]]
        assert list(free.in_allocation_order()) == expected
        assert len(free) == len(expected) == len(set(expected))
        cached = [p for q in sorted(oracle) if q > 0 for p in oracle[q]]
        assert free.first_cached() == (cached[0] if cached else None)
