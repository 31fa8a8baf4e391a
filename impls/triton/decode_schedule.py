"""Split-KV schedule of the decode kernel: which program attends which query rows over which keys.

Query rows of a request are its (token, head) pairs; ``BLOCK_M`` of them make a row block, and a
(request, row block) pair is a *group*. Each group's keys are cut into splits of about equal length so that
the whole batch gives roughly ``target_programs`` work items (the GPU's multiprocessors times the programs
each runs at once): batch 1 with a long context fills the GPU, a large batch is not split at all. A group
with one split writes its result directly; the splits of the others go to workspace slots that the merge
kernel combines by LSE.

Pure host code on plain lists, so it is unit-tested without a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """``items``: rows of (request, row block, kv start, kv end, workspace slot or -1 for direct output);
    ``groups``: rows of (request, row block, first slot, number of slots) for groups with several splits."""

    items: list[tuple[int, int, int, int, int]]
    groups: list[tuple[int, int, int, int]]
    num_slots: int

    @property
    def max_splits(self) -> int:
        return max((count for *_, count in self.groups), default=1)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def split_length(kv_lens: list[int], group_rows: list[int], block_n: int, target_programs: int,
                 min_split: int) -> int:
    """Keys per split: the batch's key-block work spread over ``target_programs`` items, at least
    ``min_split`` keys, a multiple of ``block_n``."""
    work = sum(kv * blocks for kv, blocks in zip(kv_lens, group_rows))
    length = max(min_split, _ceil_div(work, max(1, target_programs)), 1)
    return _ceil_div(length, block_n) * block_n


def build_schedule(q_lens: list[int], kv_lens: list[int], num_heads: int, block_m: int, block_n: int,
                   target_programs: int, min_split: int, num_splits: int | None = None) -> Schedule:
    """The work items of a batch. ``num_splits`` forces that many splits per group (sweeps and tests)."""
    blocks_per_request = [_ceil_div(q * num_heads, block_m) for q in q_lens]
    length = split_length(kv_lens, blocks_per_request, block_n, target_programs, min_split)
    work: list[tuple[int, int, int, int, int]] = []  # (request, split, row block, start, end)
    groups: list[tuple[int, int, int, int]] = []
    splits_of: dict[tuple[int, int], int] = {}
    for request, (row_blocks, kv) in enumerate(zip(blocks_per_request, kv_lens)):
        if row_blocks == 0:
            continue
        wanted = num_splits if num_splits is not None else _ceil_div(kv, length)
        per_split = _ceil_div(_ceil_div(kv, max(1, wanted)), block_n) * block_n if kv else 0
        count = max(1, _ceil_div(kv, per_split)) if kv else 1
        for row_block in range(row_blocks):
            splits_of[request, row_block] = count
            for split in range(count):
                work.append((request, split, row_block, split * per_split, min(kv, (split + 1) * per_split)))

    # Slots: each multi-split group owns consecutive slots, one per split.
    first_slot: dict[tuple[int, int], int] = {}
    num_slots = 0
    for (request, row_block), count in splits_of.items():
        if count > 1:
            first_slot[request, row_block] = num_slots
            groups.append((request, row_block, num_slots, count))
            num_slots += count
    # Longest items first (a better last wave); a request's row blocks of one key range stay adjacent so
    # they read the same keys at about the same time (the second read hits L2).
    work.sort(key=lambda w: (-(w[4] - w[3]), w[0], w[1], w[2]))
    items = []
    for request, split, row_block, start, end in work:
        first = first_slot.get((request, row_block))
        items.append((request, row_block, start, end, -1 if first is None else first + split))
    return Schedule(items, groups, num_slots)
