"""The split-KV schedule of the decode kernel: every (request, row block) covers its keys exactly once."""

from __future__ import annotations

import pytest

from impls.triton.decode_schedule import build_schedule


def coverage(schedule, q_lens, kv_lens, heads, block_m):
    """Check the schedule's invariants and return the item count per group."""
    per_group: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for request, row_block, start, end, slot in schedule.items:
        per_group.setdefault((request, row_block), []).append((start, end, slot))
    expected_groups = {(b, r) for b, q in enumerate(q_lens) for r in range(-(-q * heads // block_m))}
    assert set(per_group) == expected_groups
    multi = {(request, row_block): (first, count) for request, row_block, first, count in schedule.groups}
    slots = []
    for group, ranges in per_group.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == kv_lens[group[0]]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
        if len(ranges) == 1:
            assert ranges[0][2] == -1 and group not in multi  # written directly
        else:
            first, count = multi[group]
            assert count == len(ranges) and [r[2] for r in ranges] == list(range(first, first + count))
            slots += [r[2] for r in ranges]
    assert sorted(slots) == list(range(schedule.num_slots))
    return {group: len(ranges) for group, ranges in per_group.items()}


@pytest.mark.parametrize("q_lens, kv_lens, heads, block_m", [
    ((1,), (8192,), 16, 16),
    ((1,) * 32, (4096,) * 32, 128, 64),
    ((1, 4, 0, 2), (150, 9, 5, 0), 4, 16),
    ((3, 1), (1, 70), 20, 32),
])
def test_every_key_range_is_covered_once(q_lens, kv_lens, heads, block_m):
    schedule = build_schedule(list(q_lens), list(kv_lens), heads, block_m, 64, target_programs=132, min_split=64)
    coverage(schedule, q_lens, kv_lens, heads, block_m)


def test_batch_one_with_a_long_context_is_split_to_fill_the_gpu():
    schedule = build_schedule([1], [8192], 16, 16, 64, target_programs=132, min_split=64)
    assert len(schedule.items) == 128 and schedule.max_splits == 128


def test_a_large_batch_is_not_split_further_than_the_gpu_needs():
    schedule = build_schedule([1] * 256, [4096] * 256, 16, 16, 64, target_programs=132, min_split=64)
    assert len(schedule.items) == 256 and not schedule.groups


def test_forced_splits_and_empty_requests():
    schedule = build_schedule([1, 2, 1], [100, 0, 30], 4, 16, 16, target_programs=4, min_split=16, num_splits=3)
    counts = coverage(schedule, [1, 2, 1], [100, 0, 30], 4, 16)
    assert counts == {(0, 0): 3, (1, 0): 1, (2, 0): 2}  # 30 keys make only two 16-key splits
    assert (1, 0, 0, 0, -1) in schedule.items  # the empty request still writes its rows


def test_longest_items_come_first():
    schedule = build_schedule([1, 1], [64, 4096], 16, 16, 64, target_programs=8, min_split=64)
    lengths = [end - start for _, _, start, end, _ in schedule.items]
    assert lengths == sorted(lengths, reverse=True)
