"""Split-KV schedule of the decode kernel: which program attends which query rows over which keys.

Query rows of a request are its (token, head) pairs; ``BLOCK_M`` of them make a row block, and a
(request, row block) pair is a *group*. The kernel runs a fixed number of persistent programs (the GPU's
multiprocessors times the programs each holds at once); each gets an equal share of the batch's key blocks,
cut from the groups in order, so that every program finishes at about the same time whatever the mix of
lengths (a large batch is not rounded up to whole waves, batch 1 with a long context still fills the GPU).
A cut group becomes several *items* (splits), each writing a partial result to a workspace slot that the
merge kernel combines by LSE; an uncut group writes its result directly. Each item also costs a fixed
overhead (loading its queries, writing its result), counted in key blocks. Cutting at all costs more: the
partials' traffic and a merge that waits for the last program. So where whole groups packed onto the programs
(longest first) take at most ``SPLIT_PENALTY_KEYS`` longer than the balanced cut, nothing is cut (a batch about
as large as the GPU: 16 heads, 128 requests on 132 multiprocessors, 159 -> 147 us on an H200, NOTES.md round 5).

A request of several row blocks (128 heads in 64-row blocks, or MTP tokens) is cut once, and its row blocks' items
run side by side on neighbouring programs over the same keys, so that the second read of each key tile hits L2. A
cut of the groups one after another staggers them (at 128 heads b64 ctx16384 each program took the end of one row
block and the start of the next), and the cache was read about twice: 128 heads ctx16384, bf16, us, four timings
each, staggered / side by side: b16 221-224 / 195-196, b32 436-446 / 371-382, b64 822-853 / 718-800 (H100, NOTES.md
session 34).

Where every program runs one split, ``in_slot_order`` reorders the programs by workspace slot, so that a group's
splits are neighbouring programs and can run as one thread-block cluster that merges them (decode_wgmma_ws; the
row blocks then run their pieces at once on programs a group apart, the split kernel alone as fast: H100, 128 heads
b32 ctx4096 84.5 / 84.7 us, NOTES.md session 51).

Pure host code on plain lists, so it is unit-tested without a kernel.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

OVERHEAD_KEYS = 64  # what an item costs beyond its keys (query load, result store, merge), in keys
SPLIT_PENALTY_KEYS = 256  # what cutting any group costs the batch (partials, the merge's wait), in keys


@dataclass(frozen=True)
class Schedule:
    """``items``: rows of (request, row block, kv start, kv end, workspace slot or -1 for direct output), program
    after program; ``program_items``: program p runs ``items[program_items[p]:program_items[p + 1]]``;
    ``groups``: rows of (request, row block, first slot, number of slots) for groups with several splits;
    ``side``: how many neighbouring programs run each piece of a request side by side (``_side_by_side``), else 1."""

    items: list[tuple[int, int, int, int, int]]
    program_items: list[int]
    groups: list[tuple[int, int, int, int]]
    num_slots: int
    side: int = 1

    @property
    def num_programs(self) -> int:
        return len(self.program_items) - 1

    @property
    def one_item_per_program(self) -> bool:
        """Every program runs exactly one item (a split or a whole group)."""
        return self.program_items == list(range(self.num_programs + 1))

    @property
    def max_splits(self) -> int:
        return max((count for *_, count in self.groups), default=1)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _fill(blocks: list[int], budget: int, overhead: int) -> list[list[tuple[int, int, int]]]:
    """Programs in order, each taking pieces (group, first block, end block) of the groups until the next piece
    would exceed ``budget`` (blocks + ``overhead`` per piece); a group that does not fit is cut there."""
    assignment: list[list[tuple[int, int, int]]] = [[]]
    left = budget
    for group, n in enumerate(blocks):
        done = 0
        while n - done + overhead > left:
            room = left - overhead
            if room > 0:
                assignment[-1].append((group, done, done + room))
                done += room
            assignment.append([])
            left = budget
        assignment[-1].append((group, done, n))
        left -= n - done + overhead
    return [pieces for pieces in assignment if pieces]


def _balanced(blocks: list[int], programs: int, overhead: int, min_blocks: int) -> list[list[tuple[int, int, int]]]:
    """The assignment of at most ``programs`` programs whose largest budget is smallest (binary search; cost of a
    program: its blocks plus ``overhead`` per piece), each budget at least ``min_blocks`` blocks of keys."""
    total = sum(n + overhead for n in blocks)
    low = max(_ceil_div(total, max(1, programs)), min_blocks + overhead, overhead + 1)
    high = max(low, total)
    while low < high:
        budget = (low + high) // 2
        if len(_fill(blocks, budget, overhead)) <= programs:
            high = budget
        else:
            low = budget + 1
    return _fill(blocks, low, overhead)


def _whole(blocks: list[int], programs: int, overhead: int) -> list[list[tuple[int, int, int]]]:
    """Whole groups, longest first, each onto the least loaded of at most ``programs`` programs."""
    loads = [(0, p) for p in range(min(programs, len(blocks)))]
    assignment: list[list[tuple[int, int, int]]] = [[] for _ in loads]
    for group in sorted(range(len(blocks)), key=lambda g: -blocks[g]):
        load, p = heapq.heappop(loads)
        assignment[p].append((group, 0, blocks[group]))
        heapq.heappush(loads, (load + blocks[group] + overhead, p))
    return [sorted(pieces) for pieces in assignment if pieces]


def _cost(assignment: list[list[tuple[int, int, int]]], overhead: int) -> int:
    """The largest program's key blocks plus overhead per piece."""
    return max((sum(end - first + overhead for _, first, end in pieces) for pieces in assignment), default=0)


def _assign(blocks: list[int], programs: int, block_n: int, min_split: int) -> list[list[tuple[int, int, int]]]:
    """Groups of ``blocks`` key blocks onto at most ``programs`` programs: the balanced cut, or whole groups where
    they take at most ``SPLIT_PENALTY_KEYS`` longer (no partials, no merge)."""
    overhead = _ceil_div(OVERHEAD_KEYS, block_n)
    assignment = _balanced(blocks, programs, overhead, _ceil_div(min_split, block_n))
    if sum(map(len, assignment)) > len(blocks):  # the balanced assignment cuts a group
        whole = _whole(blocks, programs, overhead)
        if _cost(whole, overhead) <= _cost(assignment, overhead) + _ceil_div(SPLIT_PENALTY_KEYS, block_n):
            assignment = whole
    return assignment


def _side_by_side(q_lens: list[int], num_heads: int, block_m: int, programs: int) -> int:
    """How many programs run each piece of a request side by side: its row blocks where every request has the
    same number of them and the programs are at least as many; else 1 (each group cut on its own)."""
    counts = {_ceil_div(q * num_heads, block_m) for q in q_lens}
    side = counts.pop() if len(counts) == 1 else 1
    return side if 1 < side <= programs else 1


def build_schedule(q_lens: list[int], kv_lens: list[int], num_heads: int, block_m: int, block_n: int,
                   programs: int, min_split: int, num_splits: int | None = None) -> Schedule:
    """The work of a batch for at most ``programs`` persistent programs, each given at least ``min_split`` keys (a
    group's last split may be shorter), a request's row blocks side by side where all requests have as many
    (``_side_by_side``). ``num_splits`` instead cuts every group into that many splits, one program each (tests,
    sweeps, and decode's cuts into clusters)."""
    groups = [(request, row_block) for request, q in enumerate(q_lens)
              for row_block in range(_ceil_div(q * num_heads, block_m))]
    blocks = [_ceil_div(kv_lens[request], block_n) for request, _ in groups]
    side = 1
    if num_splits is not None:
        assignment = []
        for g, n in enumerate(blocks):
            per_split = _ceil_div(n, num_splits) if n else 0
            cuts = list(range(0, n, per_split)) if n else [0]
            assignment += [[(g, first, min(n, first + per_split) if n else 0)] for first in cuts]
    else:
        side = _side_by_side(q_lens, num_heads, block_m, programs)
        # Requests are cut for programs // side program slots; each slot's pieces then run once per row block, on
        # neighbouring programs (groups are numbered request by request, row blocks fastest).
        shares = _assign(blocks[::side], programs // side, block_n, min_split)
        assignment = [[(request * side + row_block, first, end) for request, first, end in pieces]
                      for pieces in shares for row_block in range(side)]

    pieces_of: dict[int, int] = {}
    for pieces in assignment:
        for group, _, _ in pieces:
            pieces_of[group] = pieces_of.get(group, 0) + 1
    first_slot: dict[int, int] = {}
    split_groups: list[tuple[int, int, int, int]] = []
    num_slots = 0
    for group, count in sorted(pieces_of.items()):
        if count > 1:
            first_slot[group] = num_slots
            split_groups.append((*groups[group], num_slots, count))
            num_slots += count

    items: list[tuple[int, int, int, int, int]] = []
    program_items = [0]
    seen: dict[int, int] = {}
    for pieces in assignment:
        for group, first, end in pieces:
            request, row_block = groups[group]
            split = seen.get(group, 0)
            seen[group] = split + 1
            slot = first_slot[group] + split if group in first_slot else -1
            items.append((request, row_block, first * block_n, min(kv_lens[request], end * block_n), slot))
        program_items.append(len(items))
    return Schedule(items, program_items, split_groups, num_slots, side)


def in_slot_order(schedule: Schedule) -> Schedule:
    """Where every program runs one split, the same work with the programs in the order of their items' workspace
    slots, so that each group's splits run on neighbouring programs in split order (as a cluster of them merges,
    ``decode._cluster_size``); else the schedule as it is. Row blocks side by side keep running the same pieces at
    once, on programs ``splits`` apart instead of next to each other (``side`` 1)."""
    if not schedule.one_item_per_program or any(item[4] < 0 for item in schedule.items):
        return schedule
    return replace(schedule, items=sorted(schedule.items, key=lambda item: item[4]), side=1)
