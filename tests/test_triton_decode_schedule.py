"""The split-KV schedule of the decode kernel: every (request, row block) covers its keys exactly once, and the
persistent programs get balanced shares."""

from __future__ import annotations

import pytest

from impls.triton.decode_schedule import OVERHEAD_KEYS, build_schedule, in_slot_order


def coverage(schedule, q_lens, kv_lens, heads, block_m):
    """Check the schedule's invariants and return the item count per group."""
    assert schedule.program_items[0] == 0 and schedule.program_items[-1] == len(schedule.items)
    assert all(a < b for a, b in zip(schedule.program_items, schedule.program_items[1:]))  # no idle program
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


def program_costs(schedule, block_n):
    """Key blocks plus per-item overhead of each program."""
    overhead = -(-OVERHEAD_KEYS // block_n)
    return [sum(-(-(end - start) // block_n) + overhead for _, _, start, end, _ in
                schedule.items[schedule.program_items[p]:schedule.program_items[p + 1]])
            for p in range(schedule.num_programs)]


@pytest.mark.parametrize("q_lens, kv_lens, heads, block_m", [
    ((1,), (8192,), 16, 16),
    ((1,) * 32, (4096,) * 32, 128, 64),
    ((1, 4, 0, 2), (150, 9, 5, 0), 4, 16),
    ((3, 1), (1, 70), 20, 32),
    ((1,) * 7, (5000, 3, 0, 12000, 64, 700, 1), 16, 16),
])
def test_every_key_range_is_covered_once(q_lens, kv_lens, heads, block_m):
    schedule = build_schedule(list(q_lens), list(kv_lens), heads, block_m, 64, programs=132, min_split=64)
    coverage(schedule, q_lens, kv_lens, heads, block_m)
    assert schedule.num_programs <= 132


def test_programs_get_equal_shares_of_a_ragged_batch():
    """Whatever the lengths, no program gets more than the even share plus two items' overhead, so one wave of
    programs runs the whole batch."""
    kv_lens = [100, 16384, 3000, 7, 9000, 4096, 1, 65536] * 4
    schedule = build_schedule([1] * len(kv_lens), kv_lens, 16, 16, 32, programs=264, min_split=128)
    coverage(schedule, [1] * len(kv_lens), kv_lens, 16, 16)
    costs = program_costs(schedule, 32)
    overhead = OVERHEAD_KEYS // 32
    share = sum(-(-n // 32) + overhead for n in kv_lens) / 264
    assert 250 <= schedule.num_programs <= 264
    assert max(costs) <= share + 2 * overhead + 1


def test_batch_one_with_a_long_context_is_split_to_fill_the_gpu():
    schedule = build_schedule([1], [8192], 16, 16, 64, programs=132, min_split=64)
    assert schedule.num_programs == len(schedule.items) == schedule.max_splits
    assert schedule.num_programs >= 100
    assert all(end - start >= 64 for _, _, start, end, _ in schedule.items[:-1])


def test_min_split_bounds_the_number_of_splits():
    schedule = build_schedule([1], [8192], 16, 16, 32, programs=264, min_split=256)
    assert all(end - start >= 256 for _, _, start, end, _ in schedule.items[:-1])
    assert schedule.max_splits <= 8192 // 256


def test_a_large_batch_is_not_split_further_than_the_gpu_needs():
    """256 equal requests on 132 programs: two whole requests per program (a balanced cut would shorten the longest
    program by less than a cut costs)."""
    schedule = build_schedule([1] * 256, [4096] * 256, 16, 16, 64, programs=132, min_split=64)
    assert coverage(schedule, [1] * 256, [4096] * 256, 16, 16) == {(b, 0): 1 for b in range(256)}
    assert not schedule.groups and schedule.num_programs == 132
    assert max(program_costs(schedule, 64)) == 2 * (4096 // 64 + 1)


def test_forced_splits_and_empty_requests():
    schedule = build_schedule([1, 2, 1], [100, 0, 30], 4, 16, 16, programs=4, min_split=16, num_splits=3)
    counts = coverage(schedule, [1, 2, 1], [100, 0, 30], 4, 16)
    assert counts == {(0, 0): 3, (1, 0): 1, (2, 0): 2}  # 30 keys make only two 16-key splits
    assert (1, 0, 0, 0, -1) in schedule.items  # the empty request still writes its rows
    assert schedule.num_programs == len(schedule.items)


def test_a_batch_about_as_large_as_the_gpu_is_not_cut():
    """128 equal requests on 132 programs: whole requests, no partials and no merge (cutting them costs more than
    the four idle programs; NOTES.md, round 5)."""
    schedule = build_schedule([1] * 128, [4096] * 128, 16, 16, 64, programs=132, min_split=128)
    assert coverage(schedule, [1] * 128, [4096] * 128, 16, 16) == {(b, 0): 1 for b in range(128)}
    assert schedule.num_slots == 0 and not schedule.groups and schedule.num_programs == 128


def test_whole_requests_are_packed_longest_first_when_that_costs_no_more():
    kv_lens = [4096] * 100 + [2048] * 60
    schedule = build_schedule([1] * 160, kv_lens, 16, 16, 64, programs=132, min_split=128)
    coverage(schedule, [1] * 160, kv_lens, 16, 16)
    assert schedule.num_slots == 0
    assert max(program_costs(schedule, 64)) == 2 * (2048 // 64 + 1)  # a long request alone, or two short ones


def test_a_batch_half_the_size_of_the_gpu_is_still_cut():
    schedule = build_schedule([1] * 64, [4096] * 64, 16, 16, 64, programs=132, min_split=128)
    assert coverage(schedule, [1] * 64, [4096] * 64, 16, 16) == {(b, 0): 2 for b in range(64)}


@pytest.mark.parametrize("q_lens, kv_lens, heads, block_m, programs", [
    ((1,) * 64, (16384,) * 64, 128, 64, 132),
    ((1,) * 32, (4096,) * 32, 128, 64, 132),
    ((1,), (8192,), 128, 64, 132),
    ((1, 1, 1, 1), (300, 9000, 0, 4096), 128, 64, 131),
    ((2,) * 5, (700, 50, 3000, 64, 1), 16, 16, 8),
])
def test_the_row_blocks_of_a_request_run_side_by_side_over_the_same_keys(q_lens, kv_lens, heads, block_m, programs):
    """Where every request has the same number of row blocks (two here), programs come in pairs whose items are the
    same pieces of the same requests, one program per row block: both read each key tile at about the same time, so
    the second read hits L2 (NOTES.md, session 34)."""
    schedule = build_schedule(list(q_lens), list(kv_lens), heads, block_m, 64, programs=programs, min_split=128)
    coverage(schedule, q_lens, kv_lens, heads, block_m)
    assert schedule.side == 2 and schedule.num_programs % 2 == 0 and schedule.num_programs <= programs
    for p in range(0, schedule.num_programs, 2):
        pair = [schedule.items[schedule.program_items[p + k]:schedule.program_items[p + k + 1]] for k in (0, 1)]
        spans = [[(r, start, end) for r, _, start, end, _ in items] for items in pair]
        assert spans[0] == spans[1]
        assert {rb for _, rb, *_ in pair[0]} == {0} and {rb for _, rb, *_ in pair[1]} == {1}


@pytest.mark.parametrize("q_lens, heads, num_splits, side", [
    ((1, 1, 1), 128, None, 2), ((2, 2), 128, None, 4), ((1, 1), 64, None, 1), ((1, 2), 128, None, 1),
    ((1, 1), 128, 2, 1),
])
def test_the_schedule_says_how_many_programs_read_each_piece_side_by_side(q_lens, heads, num_splits, side):
    """``Schedule.side``: a request's row blocks in 64-row blocks where every request has as many; 1 where they
    differ, where there is one, and under forced splits (each group cut on its own)."""
    kv_lens = [3000 + 500 * r for r in range(len(q_lens))]
    schedule = build_schedule(list(q_lens), kv_lens, heads, 64, 64, programs=132, min_split=128,
                              num_splits=num_splits)
    assert schedule.side == side


def test_requests_of_different_row_block_counts_are_cut_group_by_group():
    """Mixed token counts (one and three tokens of 16 heads in 16-row blocks) keep the cut of every group on its own,
    which still covers every key once."""
    q_lens, kv_lens = [1, 3, 1], [5000, 2000, 64]
    schedule = build_schedule(q_lens, kv_lens, 16, 16, 64, programs=16, min_split=128)
    assert schedule.side == 1 and coverage(schedule, q_lens, kv_lens, 16, 16)[(0, 0)] > 1


@pytest.mark.parametrize("q_lens, kv_lens, heads, num_splits", [
    ((1,) * 32, (4096,) * 32, 128, None),         # two row blocks side by side, two splits each
    ((2,) * 8, (4096,) * 8, 128, None),           # four row blocks, four splits each
    ((1, 1, 1), (300, 9000, 4100), 20, 3),        # forced splits, one of them empty
])
def test_in_slot_order_puts_each_groups_splits_on_neighbouring_programs(q_lens, kv_lens, heads, num_splits):
    """Reordered for clusters (decode_wgmma_ws), the programs run the same items, one each, program p the item of
    slot p, so each group's splits are neighbouring programs in split order."""
    schedule = build_schedule(list(q_lens), list(kv_lens), heads, 64, 64, programs=132, min_split=128,
                              num_splits=num_splits)
    ordered = in_slot_order(schedule)
    coverage(ordered, q_lens, kv_lens, heads, 64)
    assert sorted(ordered.items) == sorted(schedule.items) and ordered.one_item_per_program
    assert [item[4] for item in ordered.items] == list(range(ordered.num_programs))
    for request, row_block, first, count in ordered.groups:
        splits = ordered.items[first:first + count]
        assert {(r, rb) for r, rb, *_ in splits} == {(request, row_block)}
        assert [start for _, _, start, _, _ in splits] == sorted(start for _, _, start, _, _ in splits)
    if schedule.side > 1:
        assert ordered.items != schedule.items and ordered.side == 1


@pytest.mark.parametrize("q_lens, kv_lens, heads", [
    ((1,) * 48, (4096,) * 48, 16),                # some programs run two items
    ((1,) * 128, (4096,) * 128, 128),             # whole groups: nothing to merge
])
def test_in_slot_order_leaves_schedules_it_cannot_order_as_they_are(q_lens, kv_lens, heads):
    schedule = build_schedule(list(q_lens), list(kv_lens), heads, 64, 64, programs=132, min_split=128)
    assert in_slot_order(schedule) is schedule
