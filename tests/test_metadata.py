"""Paged metadata: reference builders on hand-worked examples, fast builders against them on thousands of random
request mixes, no host reads in the fast builders, and planted builder bugs the metadata suite must flag."""

from __future__ import annotations

import random
import re

import pytest
import torch

from impls.triton.cache_ops import triton_unavailable
from impls.triton.kv_indices import _kv_indices_kernel
from mla_bench.metadata import PagedMetadata, fast, reference
from suites.base import RunContext
from suites.metadata import BUILDERS, Builder, MetadataSuite, check, make_case, random_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---- the reference on examples worked by hand ---------------------------------------------------------------------
TABLE = torch.tensor([[3, 1, 9], [0, 2, 9]], dtype=torch.int32)  # page size 2; 9 is a spare page


def test_reference_slot_mapping_csr_and_token_table_by_hand():
    q_lens, kv_lens = [1, 2], [3, 4]
    assert reference.slot_mapping(q_lens, kv_lens, TABLE, 2).tolist() == [2, 4, 5]  # positions 2 | 2, 3
    indptr, indices, last = reference.flashinfer_csr(kv_lens, TABLE, 2)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 2, 4], [3, 1, 0, 2], [1, 2])
    assert reference.token_page_table(TABLE, kv_lens, 2).tolist() == [[6, 7, 2, -1], [0, 1, 4, 5]]
    assert reference.flat_token_slots(TABLE, kv_lens, 2).tolist() == [6, 7, 2, 0, 1, 4, 5]


def test_reference_padding_requests_store_nothing_and_own_no_page():
    assert reference.slot_mapping([2, 1], [0, 1], TABLE, 2).tolist() == [-1, -1, 0]
    indptr, indices, last = reference.flashinfer_csr([0, 1], TABLE, 2)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 0, 1], [0], [0, 1])


def test_reference_dcp_slot_mapping_by_hand():
    # W=2, I=1, page 2: rank 0 holds global positions 0, 2, 4 (local 0, 1, 2), rank 1 holds 1, 3
    kv_lens, q_lens = [5, 4], [2, 1]  # new tokens: positions 3, 4 of request 0; position 3 of request 1
    rank0 = reference.dcp_slot_mapping(q_lens, kv_lens, TABLE, 2, rank=0, world=2, interleave=1)
    rank1 = reference.dcp_slot_mapping(q_lens, kv_lens, TABLE, 2, rank=1, world=2, interleave=1)
    assert rank0.tolist() == [-1, 1 * 2 + 0, -1]  # position 4 is local 2: page TABLE[0, 1] = 1, offset 0
    assert rank1.tolist() == [3 * 2 + 1, -1, 0 * 2 + 1]  # position 3 is local 1 on rank 1
    assert [reference.dcp_local_len(5, r, 2, 1) for r in (0, 1)] == [3, 2]
    with pytest.raises(ValueError, match="interleave that divides the page size"):
        reference.dcp_slot_mapping(q_lens, kv_lens, TABLE, 2, rank=0, world=2, interleave=3)


def test_fast_dcp_slot_mapping_reads_only_the_pages_its_rank_holds():
    """The table the reference accepts for rank 1 holds its one page; the other rank's new token lies past it."""
    table = torch.tensor([[5]], dtype=torch.int32)  # W=2, I=1, page 2, kv 5: rank 1 holds positions 1, 3
    assert reference.dcp_slot_mapping([2], [5], table, 2, rank=1, world=2, interleave=1).tolist() == [11, -1]
    qsl, seq = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    assert fast.dcp_slot_mapping(qsl, seq, table, 2, 2, rank=1, world=2, interleave=1).tolist() == [11, -1]


def test_triton_kv_indices_stay_inside_their_output_and_row_whatever_kv_indptr_says():
    """The kernel trusted kv_indptr (the host reads none of it): with more pages than num_pages it wrote past its
    output, with more than the table's width it read the next row."""
    from impls.triton.kv_indices import kv_indices_triton

    table = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32, device=DEVICE)
    for indptr, num_pages, expect in (([0, 3, 6], 2, [1, 2, -7, -7, -7, -7]), ([0, 4, 4], 4, [1, 2, 3, -7, -7, -7])):
        buffer = torch.full((6,), -7, dtype=torch.int32, device=DEVICE)
        _kv_indices_kernel[(2,)](torch.tensor(indptr, dtype=torch.int32, device=DEVICE), table, 3, 3, buffer,
                                 num_pages, BLOCK=128)
        assert buffer.tolist() == expect
    with pytest.raises(ValueError, match="a contiguous kv_indptr"):
        kv_indices_triton(torch.tensor([0, 9, 3, 9, 6], dtype=torch.int32, device=DEVICE)[::2], table, 6)


def test_reference_block_allocation_draws_distinct_pages_and_pads_with_spares():
    table, num_blocks = reference.allocate_block_table([5, 0, 9], 4, torch.Generator().manual_seed(0))
    owned = table[0, :2].tolist() + table[2, :3].tolist()
    assert num_blocks == 7 and len(set(owned)) == 5
    spares = set(range(7)) - set(owned)
    assert set(table[0, 2:].tolist() + table[1].tolist()) <= spares


@pytest.mark.parametrize("kv_lens, page_size", [([32, 32, 32], 16), ([5, 0, 9], 4), ([0, 0], 16), ([7], 1)])
def test_reference_block_table_has_a_spare_column_past_the_longest_request(kv_lens, page_size):
    """Width = the most pages a request needs + 1, every entry past a request's last page a spare page: in a uniform
    batch of whole pages the width was the pages needed, so a kernel reading one block past the last page read past
    the row (the next row's first page, or out of the table for the last row), not poison."""
    table, num_blocks = reference.allocate_block_table(kv_lens, page_size, torch.Generator().manual_seed(1))
    pages = [reference.blocks_needed(n, page_size) for n in kv_lens]
    assert table.shape == (len(kv_lens), max(pages) + 1) and num_blocks == sum(pages) + 2
    owned = {int(page) for row, n in zip(table, pages) for page in row[:n]}
    padding = {int(page) for row, n in zip(table, pages) for page in row[n:]}
    assert len(owned) == sum(pages) and padding <= set(range(num_blocks)) - owned
    pool = torch.tensor([4, 0, 2, 5, 1, 3])  # two requests of one page and two: spares 5, 1, 3 in that order
    assert reference.assign_blocks([16, 32], 16, pool).tolist() == [[4, 1, 3], [0, 2, 5]]  # spare (b + j) % 3


# ---- fast == reference --------------------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads cost more than they save (3x on a busy 2-core CI machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_fast_builders_equal_the_reference_on_thousands_of_random_mixes(one_thread):
    """2000 seeded random mixes; the interpreted Triton kernel (tens of ms a mix on CPU) on every 20th."""
    rng = random.Random(1234)
    failures = []
    for seed in range(2000):
        case = random_case(rng, DEVICE, seed)
        builders = [b for b in BUILDERS if "triton" not in b.name or seed % 20 == 0 or DEVICE == "cuda"]
        failures += [f"{b.name} on {case.q_lens}/{case.kv_lens} ps{case.page_size}: {p}"
                     for b in builders if (p := check(b, case))]
        if len(failures) > 5:
            break
    assert not failures, "\n".join(failures)


def test_metadata_suite_passes_every_builder(one_thread):
    results = list(MetadataSuite().run(RunContext(impls=[], device=torch.device(DEVICE))))
    assert {r.check for r in results} == {b.name for b in BUILDERS}
    assert [r.label for r in results if r.status != "passed"] == []


def test_fast_builders_read_nothing_on_the_host():
    """On the meta device any .item(), .tolist(), nonzero or data-dependent shape raises."""
    meta = torch.device("meta")
    lengths = torch.empty(2, 7, dtype=torch.int32, device=meta)
    table = torch.empty(7, 5, dtype=torch.int32, device=meta)
    sizes = fast.HostSizes(num_tokens=20, num_pages=13, num_kv_tokens=300, table_width=5, max_kv_len=70)
    step = fast.build_step(lengths, table, 16, sizes)
    assert step["kv_indices"].shape == (13,) and step["token_slots"].shape == (300,)
    topk = torch.empty(20, 8, dtype=torch.int32, device=meta)
    qsl, seq = step["query_start_loc"], lengths[1]
    assert fast.transform_indices_paged(topk, qsl, seq, table, 16).shape == (20, 8)
    assert fast.transform_indices_ragged(topk, qsl, seq, step["kv_start_loc"]).shape == (20, 8)
    assert fast.dcp_slot_mapping(qsl, seq, table, 16, 20, 1, 2, 4).shape == (20,)
    assert fast.dcp_local_lens(seq, 1, 2, 4).shape == (7,)
    assert fast.token_page_table(seq, table, 16, 70).shape == (7, 70)
    pool = torch.empty(40, dtype=torch.int64, device=meta)
    assert fast.block_table_from_pool(seq, 16, pool, sizes).shape == (7, 5)


def test_a_pool_without_a_spare_page_is_refused_on_the_host_as_the_reference_refuses_it():
    """The spare entries take a remainder by the pool's spare pages: by zero, undefined on CUDA rather than an error."""
    kv_lens = [17, 64, 0]
    sizes = fast.HostSizes.of([1, 1, 1], kv_lens, 16)
    seq = torch.tensor(kv_lens, dtype=torch.int32)
    with pytest.raises(ValueError, match="a pool of 6 blocks leaves no spare page after the 6 the requests need"):
        reference.assign_blocks(kv_lens, 16, torch.randperm(6))
    with pytest.raises(ValueError, match="a pool of 6 blocks leaves no spare page after the 6 the requests need"):
        fast.block_table_from_pool(seq, 16, torch.randperm(6), sizes)
    table = fast.block_table_from_pool(seq, 16, torch.randperm(7), sizes)
    assert table.shape == (3, sizes.table_width) and int(table.max()) < 7


def test_host_sizes_come_from_the_host_lengths():
    sizes = fast.HostSizes.of([1, 3, 0], [17, 64, 0], 16)
    assert sizes == fast.HostSizes(num_tokens=4, num_pages=6, num_kv_tokens=81, table_width=5, max_kv_len=64)


def test_fast_step_equals_the_reference_step():
    case = make_case("mixed", [1, 4, 0, 2], [33, 64, 0, 2], 16, seed=3, device=DEVICE)
    lengths = torch.tensor([case.q_lens, case.kv_lens], dtype=torch.int32, device=DEVICE)
    got = fast.build_step(lengths, case.on_device("block_table"), 16, case.sizes)
    expect = reference.build_step(case.q_lens, case.kv_lens, case.block_table, 16)
    assert got.keys() == expect.keys()
    for name in expect:
        assert got[name].dtype == expect[name].dtype and torch.equal(got[name].cpu(), expect[name]), name


# ---- planted bugs the metadata suite must flag --------------------------------------------------------------------
def _replace(name: str, planted_fast) -> tuple[Builder, ...]:
    return tuple(Builder(b.name, planted_fast, b.reference) if b.name == name else b for b in BUILDERS)


def _max_qo_len_of_last_request(case):
    """ATOM's bug: max_qo_len from the last request only."""
    qsl = case.on_device("query_start_loc")
    return qsl[-1] - qsl[-2]


def _max_qo_len_of_all_but_the_last_request(case):
    """The mirror image of ATOM's bug: the maximum taken over every request but the last."""
    return case.on_device("q_lens")[:-1].max()


def _query_start_loc_by_squeeze(case):
    """``cumsum(q_lens.squeeze())``: a batch of one squeezes to a scalar, which ``cat`` refuses."""
    q_lens = case.on_device("q_lens")
    return torch.cat([q_lens.new_zeros(1), q_lens.squeeze().cumsum(0).to(torch.int32)])


def _slot_mapping_by_shift_and_mask(case):
    """``position >> log2(page)`` and ``position & (page - 1)``: right only when the page size is a power of two."""
    shift, mask = case.page_size.bit_length() - 1, case.page_size - 1
    request, position = fast._new_token_positions(case.on_device("query_start_loc"), case.on_device("seq_lens"),
                                                  case.sizes.num_tokens)
    safe, table = position.clamp(min=0), case.on_device("block_table")
    page = (safe >> shift).clamp(max=table.shape[1] - 1)  # kept in the table: wrong in silence, not a CUDA assert
    slots = table[request, page].long() * case.page_size + (safe & mask)
    return torch.where(position >= 0, slots, -1)


def _kv_indices_one_page_too_many_on_boundaries(case):
    """pages = kv_len // page_size + 1: one page too many when kv_len is a multiple of the page size."""
    seq = case.on_device("seq_lens")
    indptr = fast.cumulative(torch.where(seq > 0, seq // case.page_size + 1, 0))
    width = case.block_table.shape[1]
    request = fast.owners(indptr, int(indptr[-1]))
    column = (torch.arange(int(indptr[-1]), device=seq.device) - indptr[request]).clamp(max=width - 1)
    return case.on_device("block_table")[request, column]


def _paged_transform_dropping_invalid(case):
    """-1 (and out-of-range positions) become slots of the request instead of staying -1."""
    index = case.on_device("topk_indices").long().clamp(min=0)
    request = fast.owners(case.on_device("query_start_loc"), index.shape[0])
    seq = case.on_device("seq_lens")[request][:, None]
    index = torch.minimum(index, (seq - 1).clamp(min=0))
    slots = case.on_device("block_table")[request[:, None], index // case.page_size].long() * case.page_size
    return (slots + index % case.page_size).to(torch.int32)


def _paged_transform_only_minus_one_invalid(case):
    """Padding tested as ``index != -1``: FlashMLA's other invalid indices (-2, -123456, -2^31) index the table."""
    index = case.on_device("topk_indices").long()
    request = fast.owners(case.on_device("query_start_loc"), index.shape[0])
    valid = (index != -1) & (index < case.on_device("seq_lens")[request][:, None])
    safe = torch.where(valid, index, 0)
    slots = case.on_device("block_table")[request[:, None], safe // case.page_size].long() * case.page_size
    return torch.where(valid, slots + safe % case.page_size, -1).to(torch.int32)


def _ragged_transform_taking_kv_len_as_valid(case):
    """``index <= kv_len``: position kv_len (one past the request) becomes the next request's first row."""
    index = case.on_device("topk_indices").long()
    request = fast.owners(case.on_device("query_start_loc"), index.shape[0])
    valid = (index >= 0) & (index <= case.on_device("seq_lens")[request][:, None])
    return torch.where(valid, index + case.on_device("kv_start_loc")[request][:, None], -1).to(torch.int32)


def _last_page_len_subtracting_in_place(case):
    """``last = seq_lens; last -= ...``: right answer, but seq_lens (read by every other builder) is rewritten."""
    seq = case.on_device("seq_lens")
    pages = fast.pages_per_request(seq, case.page_size)
    last = seq
    last -= torch.where(pages > 0, (pages - 1) * case.page_size, 0).to(seq.dtype)
    return last.clone()


def _kv_indices_kernel_with_width_as_stride(case):
    """The Triton kv_indices kernel launched with the block table's width as its row stride (engines slice a wider
    persistent table, whose rows are further apart)."""
    seq, table = case.on_device("seq_lens"), case.on_device("block_table")
    indptr = fast.cumulative(fast.pages_per_request(seq, case.page_size))
    out = torch.empty(case.sizes.num_pages, dtype=torch.int32, device=table.device)
    _kv_indices_kernel[(table.shape[0],)](indptr, table, table.shape[1], table.shape[1], out, out.shape[0], BLOCK=128)
    return out


def _max_qo_len_hard_coded_to_one(case):
    """ATOM's other bug: max_qo_len = 1, wrong as soon as a request has several query tokens (MTP, prefill)."""
    return torch.ones((), dtype=torch.int32, device=case.device)


def _slot_mapping_of_decode_only(case):
    """Every new token written at position seq_len - 1, as if each request had one query token."""
    request = fast.owners(case.on_device("query_start_loc"), case.sizes.num_tokens)
    position = case.on_device("seq_lens")[request].long() - 1
    safe = position.clamp(min=0)
    slots = case.on_device("block_table")[request, safe // case.page_size].long() * case.page_size
    return torch.where(position >= 0, slots + safe % case.page_size, -1)


def _step_with(case, **wrong):
    """``fast.build_step`` on the case's device lengths with the fields ``wrong`` (name: part of the step) rewired."""
    lengths = torch.stack([case.on_device("q_lens"), case.on_device("seq_lens")])
    step = fast.build_step(lengths, case.on_device("block_table"), case.page_size, case.sizes)
    return step | {name: part(step) for name, part in wrong.items()}


def _step_with_query_lengths_for_max_kv_len(case):
    """The step wired with the query lengths where max_kv_len needs the key lengths."""
    return _step_with(case, max_kv_len=lambda step: fast.max_len(case.on_device("q_lens")))


def _step_with_page_counts_by_shift(case):
    """The step's kv_indptr from ``(kv_len + page - 1) >> log2(page)``: right only when the page size is a power of
    two."""
    shift = case.page_size.bit_length() - 1
    return _step_with(case, kv_indptr=lambda step: fast.cumulative((step["seq_lens"] + case.page_size - 1) >> shift))


def _max_qo_len_exiting_on_mtp(case):
    """Calls ``sys.exit`` on a uniform multi-token mix, as a library might on an input it cannot take: the suite and
    the run ended (not an Exception)."""
    if len(set(case.q_lens)) == 1 and case.q_lens[0] > 1:
        raise SystemExit(0)
    return fast.max_len(case.on_device("q_lens"))


# An index past the block table is an IndexError on the CPU but a device-side assert on CUDA, which ends the
# process's CUDA context for every later test: that planted bug is shown on the CPU.
INDEXES_PAST_THE_TABLE = (_paged_transform_only_minus_one_invalid,)


@pytest.mark.parametrize("builder, planted, caught_on, says", [
    ("max_qo_len", _max_qo_len_of_last_request, "one huge", "elements differ"),
    ("max_qo_len", _max_qo_len_of_all_but_the_last_request, "longest last", "2 instead of 7"),
    ("query_start_loc", _query_start_loc_by_squeeze, "single", "raised RuntimeError"),
    ("kv_indices", _kv_indices_one_page_too_many_on_boundaries, "page boundaries", "shape"),
    ("transform paged", _paged_transform_dropping_invalid, "decode", "elements differ"),
    ("transform paged", _paged_transform_only_minus_one_invalid, "decode", "raised IndexError"),
    ("transform ragged", _ragged_transform_taking_kv_len_as_valid, "decode", "instead of -1"),
    ("kv_last_page_len", _last_page_len_subtracting_in_place, "one huge", "wrote into its input seq_lens"),
    ("kv_indices (triton)", _kv_indices_kernel_with_width_as_stride, "one huge", "elements differ"),
    ("max_qo_len", _max_qo_len_hard_coded_to_one, "mtp", "1 instead of 3"),
    ("max_qo_len", _max_qo_len_exiting_on_mtp, "mtp", "raised SystemExit"),
    ("slot mapping", _slot_mapping_of_decode_only, "mtp", "elements differ"),
    ("build_step", _step_with_query_lengths_for_max_kv_len, "one huge", "max_kv_len: 1 of 1 elements differ, first at "
     "[]: 5 instead of 20000"),
])
def test_planted_metadata_bugs_are_flagged(builder, planted, caught_on, says, one_thread):
    """On fresh mixes (a new seed each run): only the planted builder fails, on the mix named, saying how."""
    seed = random.randrange(2 ** 32)
    suite = MetadataSuite(builders=_replace(builder, planted))
    device = torch.device("cpu" if planted in INDEXES_PAST_THE_TABLE else DEVICE)
    results = list(suite.run(RunContext(impls=[], device=device, page_sizes=[16], seed=seed)))
    failed = [r for r in results if r.status == "failed"]
    assert [r.check for r in failed] == [builder], f"seed {seed}"
    mix = next((part for part in failed[0].message.split("; ") if part.startswith(caught_on + ":")), "")
    assert says in mix, f"seed {seed}: {failed[0].message[:500]}"
    # on a GPU host the planted CPU run has no Triton interpreter: only the Triton builder may be unsupported there
    others = {r.check: r.status for r in results if r.check != builder}
    allowed = {"passed", "unsupported"} if triton_unavailable(device) else {"passed"}
    assert all(status in allowed and (status == "passed" or "triton" in check) for check, status in others.items()), \
        f"seed {seed}: {others}"


def test_a_failed_result_holds_what_rebuilds_its_failing_mixes(one_thread):
    """The Result named the failing mixes ("varlen: 7 instead of 137") but held neither their lengths nor the seed
    they are drawn with: a reader of the run file could not rebuild the failing case."""
    seed = random.randrange(2 ** 32)
    suite = MetadataSuite(builders=_replace("max_qo_len", _max_qo_len_of_last_request))
    (failed,) = [r for r in suite.run(RunContext(impls=[], device=torch.device(DEVICE), page_sizes=[48], seed=seed))
                 if r.status == "failed"]
    mixes = failed.details["failing_mixes"]
    assert "one huge" in mixes and len(mixes) == failed.metrics["failed_mixes"], f"seed {seed}: {mixes}"
    planted = next(b for b in suite.builders if b.name == "max_qo_len")
    for name, lengths in mixes.items():
        case = make_case(name, lengths["q_lens"], lengths["kv_lens"], 48, failed.details["seed"], DEVICE)
        assert f"{name}: {check(planted, case)}" in failed.message, f"seed {seed}: {name}"


@pytest.mark.parametrize("builder, planted, says", [
    ("slot mapping", _slot_mapping_by_shift_and_mask, "elements differ"),
    ("build_step", _step_with_page_counts_by_shift, "page boundaries: kv_indptr: "),
])
def test_planted_shift_and_mask_page_math_is_flagged_only_at_the_page_size_no_power_of_two(builder, planted, says,
                                                                                            one_thread):
    seed = random.randrange(2 ** 32)
    suite = MetadataSuite(builders=tuple(b for b in _replace(builder, planted) if b.name == builder))
    results = list(suite.run(RunContext(impls=[], device=torch.device(DEVICE), seed=seed)))
    assert {r.details["page_size"]: r.status for r in results} == {1: "passed", 16: "passed", 48: "failed",
                                                                   64: "passed"}, f"seed {seed}"
    assert says in next(r.message for r in results if r.status == "failed"), f"seed {seed}"


# ---- bad input: a clear error naming the problem, never a deep traceback or a silent wrong answer ------------------
SEQ, QSL = torch.tensor([3, 4], dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32)


@pytest.mark.parametrize("call, says", [
    (lambda: reference.slot_mapping([1, 2], [3, 4], TABLE, 0), "page_size must be a positive int, got 0"),
    (lambda: reference.slot_mapping([1, 2], [3, 9], TABLE, 2),
     "request 1: kv_len 9 exceeds the block table's capacity (3 blocks x page size 2 = 6 tokens)"),
    (lambda: reference.flashinfer_csr([3, 9], TABLE, 2), "request 1: kv_len 9 exceeds"),  # was a short kv_indices
    (lambda: reference.slot_mapping([1, 2], [3, -4], TABLE, 2), "request 1: lengths must be >= 0"),  # was silent
    (lambda: reference.slot_mapping([5, 2], [3, 4], TABLE, 2), "request 0: query longer than context"),
    (lambda: reference.slot_mapping([1, 1, 1], [3, 4, 1], TABLE, 2), "block_table must be"),
    (lambda: reference.token_page_table(TABLE.float(), [3, 4], 2), "got torch.float32 [2, 3]"),
    (lambda: reference.transform_indices_ragged(torch.ones(1, 2, dtype=torch.int32), [1, 2], [3, 4]),
     "topk_indices must be int32 or int64 [3 query tokens, topk], got torch.int32 [1, 2]"),
    (lambda: reference.dcp_slot_mapping([1, 1], [3, 19], TABLE, 2, 0, 2, 1), "DCP rank 0 of 2"),
    (lambda: reference.dcp_local_len(5, 2, 2, 1), "0 <= rank < world; got rank=2"),
    (lambda: fast.slot_mapping(QSL, SEQ, TABLE, 0, 3), "page_size must be a positive int, got 0"),
    (lambda: fast.cumulative(torch.tensor([1.5, 2.0])), "lengths must be a 1-D int32 or int64 tensor"),
    (lambda: fast.flashinfer_csr(SEQ, TABLE[:1], 2, 4), "seq_lens holds 2 requests, block_table holds 1"),
    (lambda: fast.token_page_table(SEQ, TABLE, 2, 9), "width 9 exceeds the block table's capacity"),
    (lambda: fast.transform_indices_paged(SEQ, QSL, SEQ, TABLE, 2), "topk_indices must be a 2-D"),
    (lambda: fast.dcp_local_lens(SEQ, 0, 0, 1), "world >= 1"),
    (lambda: fast.build_step(torch.stack([SEQ, SEQ]).long(), TABLE, 2, fast.HostSizes.of([3, 4], [3, 4], 2)),
     "lengths must be int32 (the metadata's dtype), got torch.int64 [2, 2]"),  # was int64 seq_lens and maxima
    (lambda: make_case("mine", [1], [3], 0, 0, DEVICE), "mix 'mine': page_size must be a positive int"),
    (lambda: make_case("mine", [1, 1], [3], 16, 0, DEVICE), "mix 'mine': q_lens has 2 requests"),  # was truncated
    (lambda: make_case("mine", [], [], 16, 0, DEVICE), "mix 'mine': a mix needs at least one request"),
    (lambda: list(MetadataSuite().run(RunContext(impls=[], device=torch.device(DEVICE), page_sizes=[0]))),
     "page_size must be a positive int, got 0"),
])
def test_bad_input_gets_an_error_naming_it(call, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        call()


def test_an_empty_batch_has_max_length_zero_and_a_table_of_no_rows_in_both_builders():
    assert reference.max_qo_len([]) == reference.max_kv_len([]) == 0
    assert reference.assign_blocks([], 16, torch.randperm(4)).shape == (0, 1)  # was [0]: no longer a 2-D table
    assert int(fast.max_len(torch.empty(0, dtype=torch.int32))) == 0


def test_paged_metadata_of_an_empty_batch_has_max_lengths_zero():
    """max_kv_len raised 'max() arg is an empty sequence' where max_qo_len, and both reference builders, give 0."""
    meta = PagedMetadata.build((), (), 16, torch.Generator().manual_seed(random.randrange(2 ** 32)))
    assert (meta.batch, meta.max_qo_len, meta.max_kv_len) == (0, 0, 0)


def test_paged_metadata_refuses_lengths_the_reference_refuses():
    """PagedMetadata.build (what a Problem carries) took any lengths: a query longer than its context, a negative
    query length or one q_len too many became offsets no request has, in silence."""
    rng = random.Random()
    kv = rng.randint(1, 300)
    gen = torch.Generator().manual_seed(rng.randrange(2 ** 32))
    for q_lens, kv_lens, says in (((kv + rng.randint(1, 9),), (kv,), "query longer than context"),
                                  ((-rng.randint(1, 9), 1), (kv, kv), "lengths must be >= 0"),
                                  ((1, 1), (kv,), "q_lens has 2 requests but kv_lens has 1")):
        with pytest.raises(ValueError, match=says):
            PagedMetadata.build(q_lens, kv_lens, rng.choice([1, 16, 48]), gen)
    meta = PagedMetadata.build((1, kv), (kv, kv), 16, gen)
    assert meta.query_start_loc.tolist() == [0, 1, kv + 1] and meta.kv_lens == (kv, kv)


def _random_table(rng: random.Random, page_size: int, kv_lens: list[int]) -> torch.Tensor:
    """A block table of distinct random pages with room for ``kv_lens``."""
    width = reference.table_width(kv_lens, page_size)
    pages = rng.sample(range(1, 1000), len(kv_lens) * width)
    return torch.tensor(pages, dtype=torch.int32).reshape(len(kv_lens), width)


BUILDERS_READING_THE_TABLE = {
    "slot_mapping": lambda t, q, kv, ps: reference.slot_mapping(q, kv, t, ps),
    "flat_token_slots": lambda t, q, kv, ps: reference.flat_token_slots(t, kv, ps),
    "token_page_table": lambda t, q, kv, ps: reference.token_page_table(t, kv, ps),
    "flashinfer_csr": lambda t, q, kv, ps: reference.flashinfer_csr(kv, t, ps),
    "transform_indices_paged": lambda t, q, kv, ps: reference.transform_indices_paged(
        torch.randint(0, min(kv), (sum(q), 4), dtype=torch.int32), q, kv, t, ps),
    "dcp_slot_mapping": lambda t, q, kv, ps: reference.dcp_slot_mapping(q, kv, t, ps, 0, 1, 1),
}


@pytest.mark.parametrize("builder", BUILDERS_READING_THE_TABLE)
def test_reference_builders_refuse_a_negative_entry_a_request_reads(builder):
    """A -1 entry made slots [.., -2, -1]: the padding sentinel, so the cache write skipped those tokens and sparse
    attention treated them as invalid, in silence. Entries past a request's pages are not read, and may be -1."""
    rng = random.Random()
    page_size = rng.choice([2, 4, 16])
    kv_lens = [rng.randint(2 * page_size + 1, 5 * page_size) for _ in range(rng.randint(1, 3))]
    q_lens = [rng.randint(1, 2) for _ in kv_lens]
    table = _random_table(rng, page_size, kv_lens)
    table[:, -1] = -1  # the spare column: unread
    BUILDERS_READING_THE_TABLE[builder](table, q_lens, kv_lens, page_size)
    b, j = rng.randrange(len(kv_lens)), rng.randrange(2)
    table[b, j] = -rng.randint(1, 2 ** 31)
    with pytest.raises(ValueError, match=rf"block_table\[{b}, {j}\] = {int(table[b, j])} is negative"):
        BUILDERS_READING_THE_TABLE[builder](table, q_lens, kv_lens, page_size)


def test_reference_paged_transform_refuses_a_slot_that_int32_indices_would_wrap():
    """An entry of 2**30 at page size 4 wrapped in the int32 cast to slots 0..3: valid slots of other tokens."""
    rng = random.Random()
    page_size = rng.choice([4, 8, 64])
    kv_lens = [rng.randint(1, 3 * page_size) for _ in range(2)]
    table = _random_table(rng, page_size, kv_lens)
    table[1, 0] = 2 ** 31 // page_size + rng.randint(0, 1000)
    topk = torch.full((2, 3), kv_lens[0] - 1, dtype=torch.int32)
    topk[1] = -1  # token 1 (request 1) reads one position only: the others would wrap first, in random order
    topk[1, 2] = rng.randrange(min(page_size, kv_lens[1]))  # in its first page
    slot = int(table[1, 0]) * page_size + int(topk[1, 2])
    with pytest.raises(ValueError, match=rf"token 1, top-k index 2: .* block_table\[1, 0\], whose slot {slot} "
                                         r"exceeds torch.int32's largest value 2147483647"):
        reference.transform_indices_paged(topk, [1, 1], kv_lens, table, page_size)
    assert int(reference.transform_indices_paged(topk.long(), [1, 1], kv_lens, table, page_size)[1, 2]) == slot


@pytest.mark.parametrize("call", [
    lambda bad: reference.dcp_local_len(10, 0, bad, 1),
    lambda bad: reference.dcp_local_len(10, 0, 2, bad),
    lambda bad: reference.check_dcp(4, bad, 2),
    lambda bad: reference.check_dcp(4, 2, 2, bad),
    lambda bad: fast.dcp_local_lens(torch.randint(1, 99, (3,), dtype=torch.int32), 0, bad, 1),
])
@pytest.mark.parametrize("bad", [2.0, 2.5, True, "2"])
def test_dcp_helpers_refuse_a_rank_world_or_interleave_that_is_not_an_int(call, bad):
    """A float world gave float lengths (4.0, a float32 tensor), a bool passed as 1, a string a bare TypeError."""
    with pytest.raises(ValueError, match=rf"DCP (rank|world|interleave) must be an int, got {re.escape(repr(bad))}"):
        call(bad)


@pytest.mark.parametrize("call, says", [
    (lambda n: fast.HostSizes.of([1], [-n], 2), "request 0: lengths must be >= 0"),
    (lambda n: fast.HostSizes.of([1], [n + 0.5], 2), "kv_lens must hold ints"),
    (lambda n: fast.HostSizes(n, n, n, -n, n), "HostSizes.table_width must be an int >= 0"),
    (lambda n: fast.HostSizes(float(n), n, n, n, n), "HostSizes.num_tokens must be an int >= 0"),
    (lambda n: fast.slot_mapping(QSL, SEQ, TABLE, 2, -n), "num_tokens must be an int >= 0"),
    (lambda n: fast.slot_mapping(QSL, SEQ, TABLE, 2, float(n)), "num_tokens must be an int >= 0"),
    (lambda n: fast.token_page_table(SEQ, TABLE, 2, -n), "width must be an int >= 0"),
    (lambda n: fast.token_page_table(SEQ, TABLE, 2, float(n)), "width must be an int >= 0"),
    (lambda n: fast.flat_token_slots(QSL, TABLE, 2, -n), "num_kv_tokens must be an int >= 0"),
    (lambda n: fast.kv_indices(QSL, TABLE, float(n)), "num_pages must be an int >= 0"),
    (lambda n: fast.flashinfer_csr(SEQ, TABLE, 2, -n), "num_pages must be an int >= 0"),
    (lambda n: fast.dcp_slot_mapping(QSL, SEQ, TABLE, 2, -n, 0, 1, 1), "num_tokens must be an int >= 0"),
])
def test_fast_builders_refuse_host_sizes_that_are_not_counts(call, says):
    """HostSizes.of([1], [-5], 2) gave num_pages -2 and floats float sizes; a negative or float size given to a
    builder failed deep in torch (IndexError, RuntimeError)."""
    with pytest.raises(ValueError, match=re.escape(says)):
        call(random.randint(1, 9))


@pytest.mark.parametrize("spoil, says", [
    (dict(kv_lens=(-5,)), "request 0: lengths must be >= 0, got q_len=1, kv_len=-5"),
    (dict(page_size=0), "page_size must be a positive int, got 0"),
    (dict(num_blocks=2.5), "PagedMetadata.num_blocks must be an int >= 0, got 2.5"),
    (dict(token_slots=[0, 1]), "PagedMetadata.token_slots must be a tensor, got list"),
])
def test_paged_metadata_refuses_host_fields_no_builder_would_make(spoil, says):
    """PagedMetadata(q_lens=(1,), kv_lens=(-5,), page_size=0, ...) constructed, for kernels to read."""
    meta = PagedMetadata.build((1,), (random.randint(1, 40),), 16, torch.Generator().manual_seed(random.randrange(99)))
    with pytest.raises(ValueError, match=f"^{re.escape(says)}$"):
        PagedMetadata(**{**{f: getattr(meta, f) for f in vars(meta)}, **spoil})
