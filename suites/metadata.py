"""The metadata suite: every fast metadata builder equals its reference builder on named request mixes.

Mixes (per page size): decode (q = 1), MTP (uniform q > 1), varlen, empty requests (kv 0, q 0 or padding
queries), lengths on and next to page boundaries, one huge request among small ones, a single request, the longest
query last. Builders: cumulative lengths, block allocation from a permuted pool, slot mapping, FlashInfer CSR
(kv_indptr, kv_indices in torch and in Triton, last_page_len), token page table and its flattened form, max_qo_len /
max_kv_len, DCP local lengths and slot mapping, PAGED and RAGGED top-k transforms (-1 kept, out-of-range indices -1,
FlashMLA's invalid indices among them), and the whole step an engine builds in one call (``fast.build_step``, field
by field against ``reference.build_step``: a part wired to the wrong inputs fails). The builders read their inputs
as engines hold them: the block table is the first columns of a wider table (row stride > width), and a builder
that writes into an input is named for it (other builders read them).

One Result per (builder, page size); its message names every mix where the builder differs and how (the step: its
first field that differs), its details the seed and the lengths of those mixes (``make_case`` rebuilds one from
them). The tests run the same comparison on thousands of random mixes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from mla_bench.errors import reraise_interrupt
from mla_bench.lengths import check_lengths
from mla_bench.metadata import fast, reference
from mla_bench.results import Result
from suites.base import RunContext

PAGE_SIZES = (1, 16, 48, 64)  # 48: a page size that is no power of two catches a shift or mask for // and %
DCP_CONFIGS = ((2, 1), (3, 1), (4, 4))  # (world, interleave); the interleave must divide the page size
TOPK = 12
INVALID_INDICES = (-2 ** 31, -123456, -2, 2 ** 31 - 1)  # FlashMLA's tests try these (and -1, kv_len) as invalid
TABLE_SLACK = 3  # columns of the wider table the device block table is sliced from


@dataclass
class Case:
    """One request mix on one device: host lengths (what the scheduler holds) and the device tensors built from them
    by the reference, which the fast builders take as inputs."""

    name: str
    q_lens: list[int]
    kv_lens: list[int]
    page_size: int
    pool: torch.Tensor           # permuted block ids (host)
    block_table: torch.Tensor    # reference.assign_blocks of the pool (host)
    topk_indices: torch.Tensor   # [sum q, TOPK] int32 positions, -1 padded, some out of range (host)
    device: torch.device
    _device_inputs: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _host_inputs: dict[str, torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._host_inputs = {
            "q_lens": torch.tensor(self.q_lens, dtype=torch.int32),
            "seq_lens": torch.tensor(self.kv_lens, dtype=torch.int32),
            "query_start_loc": torch.tensor(reference.cumulative(self.q_lens), dtype=torch.int32),
            "kv_start_loc": torch.tensor(reference.cumulative(self.kv_lens), dtype=torch.int32),
            "block_table": self.block_table,
            "pool": self.pool,
            "topk_indices": self.topk_indices,
        }

    @property
    def sizes(self) -> fast.HostSizes:
        return fast.HostSizes.of(self.q_lens, self.kv_lens, self.page_size)

    def on_device(self, name: str) -> torch.Tensor:
        """The reference-built input ``name`` on the case's device (built once per case). The block table is the
        first columns of a wider table, as engines slice their persistent one: a builder that takes its width for
        its row stride reads wrong entries."""
        if name not in self._device_inputs:
            value = self._host_inputs[name].to(self.device, copy=True)  # a copy even on the host's device
            if name == "block_table":
                value = torch.nn.functional.pad(value, (0, TABLE_SLACK), value=int(self.pool[-1]))[:, :value.shape[1]]
            self._device_inputs[name] = value
        return self._device_inputs[name]

    def written_inputs(self) -> list[str]:
        """The device inputs that no longer equal their host source (a builder wrote into them); they are dropped,
        so the next builder gets fresh ones."""
        written = [name for name, value in self._device_inputs.items()
                   if not torch.equal(value.cpu(), self._host_inputs[name])]
        for name in written:
            del self._device_inputs[name]
        return written


def make_case(name: str, q_lens: list[int], kv_lens: list[int], page_size: int, seed: int,
              device: torch.device | str) -> Case:
    """A mix with a randomly permuted block pool (two spare pages) and random top-k indices: valid positions, -1
    padding, out-of-range positions (>= kv_len), and in row ``r`` the ``r``-th of kv_len and ``INVALID_INDICES`` in
    turn (each in some row of a mix of 5 query tokens or more); every transform maps the invalid ones to -1."""
    try:
        q_lens, kv_lens = check_lengths(q_lens, kv_lens)
        if not q_lens:
            raise ValueError("a mix needs at least one request")
        num_blocks = sum(reference.blocks_needed(n, page_size) for n in kv_lens) + 2
    except ValueError as exc:
        raise ValueError(f"mix {name!r}: {exc}") from None
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(num_blocks, generator=gen)
    rows = []
    for q_len, kv_len in zip(q_lens, kv_lens):
        invalid = (kv_len,) + INVALID_INDICES
        for _ in range(q_len):
            pick = torch.randint(0, kv_len + 3, (TOPK,), generator=gen)
            pick = torch.where(torch.rand(TOPK, generator=gen) < 0.2, -1, pick)
            pick[len(rows) % TOPK] = invalid[len(rows) % len(invalid)]
            rows.append(pick)
    topk = torch.stack(rows).to(torch.int32) if rows else torch.empty(0, TOPK, dtype=torch.int32)
    return Case(name, list(q_lens), list(kv_lens), page_size, pool,
                reference.assign_blocks(list(kv_lens), page_size, pool), topk, torch.device(device))


def named_mixes(page_size: int, seed: int = 0) -> dict[str, tuple[list[int], list[int]]]:
    """The suite's request mixes for one page size (deterministic in ``seed``)."""
    rng = random.Random(seed * 1000 + page_size)
    ps = page_size
    varlen_kv = [rng.randint(1, 300) for _ in range(9)]
    boundary_kv = [ps, 2 * ps, ps + 1, max(ps - 1, 1), 3 * ps, 3 * ps - 1, 1]
    return {
        "decode": ([1] * 8, [rng.randint(1, 500) for _ in range(8)]),
        "mtp": ([3] * 6, [rng.randint(3, 400) for _ in range(6)]),
        "varlen": ([rng.randint(1, n) for n in varlen_kv], varlen_kv),
        "empty requests": ([0, 2, 0, 1, 3, 0, 1], [0, 0, 17, 5, 40, 0, 1]),
        "page boundaries": ([min(q, kv) for q, kv in zip([1, 2, 1, 1, 4, 2, 1], boundary_kv)], boundary_kv),
        "one huge": ([1, 5, 1, 2, 1], [20, 20000, 3, 9, 64]),
        "single": ([5], [rng.randint(5, 300)]),
        "longest last": ([1, 2, 1, 7], [9, 30, 4, 50]),  # a max over all requests but the last is wrong here
    }


def random_case(rng: random.Random, device: torch.device | str, seed: int) -> Case:
    """A random small mix: up to 12 requests, page sizes 1..64 (3 and 48 no power of two), lengths often empty or
    on page boundaries."""
    ps = rng.choice([1, 2, 3, 4, 16, 48, 64])
    batch = rng.randint(1, 12)
    kv_lens = [rng.choice([0, rng.randint(1, 200), ps * rng.randint(1, 4), ps * rng.randint(1, 4) + 1])
               for _ in range(batch)]
    q_lens = [rng.randint(0, 3) if kv == 0 else rng.randint(0, min(kv, 12)) for kv in kv_lens]
    if sum(q_lens) == 0:
        q_lens[0] = 1
    return make_case(f"random #{seed}", q_lens, kv_lens, ps, seed, device)


Built = torch.Tensor | dict[str, torch.Tensor]


@dataclass(frozen=True)
class Builder:
    """A fast builder and the reference it must equal; both take a Case and return a tensor or a dict of them."""

    name: str
    fast: Callable[[Case], Built]
    reference: Callable[[Case], Built]


def _dcp_all(case: Case, one: Callable[[int, int, int], torch.Tensor]) -> torch.Tensor:
    """``one(rank, world, interleave)`` over every rank of every DCP config valid for the case's page size."""
    parts = [one(rank, world, interleave) for world, interleave in DCP_CONFIGS if case.page_size % interleave == 0
             for rank in range(world)]
    return torch.cat(parts)


def _fast_csr(case: Case, part: int, indices: Callable = fast.kv_indices) -> torch.Tensor:
    return fast.flashinfer_csr(case.on_device("seq_lens"), case.on_device("block_table"), case.page_size,
                               case.sizes.num_pages, indices)[part]


def _kv_indices_triton(case: Case) -> torch.Tensor:
    from impls.triton.kv_indices import kv_indices_triton  # imported on use: Triton kernels need the interpreter set

    return _fast_csr(case, 1, kv_indices_triton)


def _i32(value: int) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int32)


BUILDERS: tuple[Builder, ...] = (
    Builder("query_start_loc",
            lambda c: fast.cumulative(c.on_device("q_lens")),
            lambda c: torch.tensor(reference.cumulative(c.q_lens), dtype=torch.int32)),
    Builder("kv_start_loc",
            lambda c: fast.cumulative(c.on_device("seq_lens")),
            lambda c: torch.tensor(reference.cumulative(c.kv_lens), dtype=torch.int32)),
    Builder("block table",
            lambda c: fast.block_table_from_pool(c.on_device("seq_lens"), c.page_size, c.on_device("pool"), c.sizes),
            lambda c: reference.assign_blocks(c.kv_lens, c.page_size, c.pool)),
    Builder("slot mapping",
            lambda c: fast.slot_mapping(c.on_device("query_start_loc"), c.on_device("seq_lens"),
                                        c.on_device("block_table"), c.page_size, c.sizes.num_tokens),
            lambda c: reference.slot_mapping(c.q_lens, c.kv_lens, c.block_table, c.page_size)),
    Builder("kv_indptr", lambda c: _fast_csr(c, 0),
            lambda c: reference.flashinfer_csr(c.kv_lens, c.block_table, c.page_size)[0]),
    Builder("kv_indices", lambda c: _fast_csr(c, 1),
            lambda c: reference.flashinfer_csr(c.kv_lens, c.block_table, c.page_size)[1]),
    Builder("kv_indices (triton)", _kv_indices_triton,
            lambda c: reference.flashinfer_csr(c.kv_lens, c.block_table, c.page_size)[1]),
    Builder("kv_last_page_len", lambda c: _fast_csr(c, 2),
            lambda c: reference.flashinfer_csr(c.kv_lens, c.block_table, c.page_size)[2]),
    Builder("token page table",
            lambda c: fast.token_page_table(c.on_device("seq_lens"), c.on_device("block_table"), c.page_size,
                                            c.sizes.max_kv_len),
            lambda c: reference.token_page_table(c.block_table, c.kv_lens, c.page_size)),
    Builder("flat token slots",
            lambda c: fast.flat_token_slots(c.on_device("kv_start_loc"), c.on_device("block_table"), c.page_size,
                                            c.sizes.num_kv_tokens),
            lambda c: reference.flat_token_slots(c.block_table, c.kv_lens, c.page_size)),
    Builder("max_qo_len", lambda c: fast.max_len(c.on_device("q_lens")),
            lambda c: _i32(reference.max_qo_len(c.q_lens))),
    Builder("max_kv_len", lambda c: fast.max_len(c.on_device("seq_lens")),
            lambda c: _i32(reference.max_kv_len(c.kv_lens))),
    Builder("dcp local lens",
            lambda c: _dcp_all(c, lambda r, w, i: fast.dcp_local_lens(c.on_device("seq_lens"), r, w, i)),
            lambda c: _dcp_all(c, lambda r, w, i: torch.tensor([reference.dcp_local_len(n, r, w, i) for n in c.kv_lens],
                                                               dtype=torch.int32))),
    Builder("dcp slot mapping",
            lambda c: _dcp_all(c, lambda r, w, i: fast.dcp_slot_mapping(
                c.on_device("query_start_loc"), c.on_device("seq_lens"), c.on_device("block_table"), c.page_size,
                c.sizes.num_tokens, r, w, i)),
            lambda c: _dcp_all(c, lambda r, w, i: reference.dcp_slot_mapping(c.q_lens, c.kv_lens, c.block_table,
                                                                                c.page_size, r, w, i))),
    Builder("transform paged",
            lambda c: fast.transform_indices_paged(c.on_device("topk_indices"), c.on_device("query_start_loc"),
                                                   c.on_device("seq_lens"), c.on_device("block_table"), c.page_size),
            lambda c: reference.transform_indices_paged(c.topk_indices, c.q_lens, c.kv_lens, c.block_table,
                                                        c.page_size)),
    Builder("transform ragged",
            lambda c: fast.transform_indices_ragged(c.on_device("topk_indices"), c.on_device("query_start_loc"),
                                                    c.on_device("seq_lens"), c.on_device("kv_start_loc")),
            lambda c: reference.transform_indices_ragged(c.topk_indices, c.q_lens, c.kv_lens)),
    Builder("build_step",
            lambda c: fast.step_of(c.on_device("query_start_loc"), c.on_device("seq_lens"), c.on_device("block_table"),
                                   c.page_size, c.q_lens, c.kv_lens),
            lambda c: reference.build_step(c.q_lens, c.kv_lens, c.block_table, c.page_size)),
)


def difference(actual: Built, expected: Built) -> str | None:
    """How ``actual`` differs from ``expected`` (dtype, shape, first differing element; for dicts, the fields or the
    first field that differs), or None when equal."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"a {type(actual).__name__}, expected the fields {sorted(expected)}"
        if actual.keys() != expected.keys():
            return f"fields {sorted(actual)}, expected {sorted(expected)}"
        return next((f"{name}: {p}" for name in expected if (p := difference(actual[name], expected[name]))), None)
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    if actual.shape != expected.shape:
        return f"shape {list(actual.shape)}, expected {list(expected.shape)}"
    actual = actual.cpu()
    wrong = actual != expected
    if not bool(wrong.any()):
        return None
    at = tuple(wrong.nonzero()[0].tolist())
    return (f"{int(wrong.sum())} of {wrong.numel()} elements differ, first at {list(at)}: "
            f"{actual[at].item()} instead of {expected[at].item()}")


def check(builder: Builder, case: Case) -> str | None:
    """``builder`` on ``case``: None when it equals the reference and leaves its inputs alone, else what went wrong."""
    try:
        problem = difference(builder.fast(case), builder.reference(case))
    except BaseException as exc:  # noqa: BLE001 - a crashing builder (sys.exit too) is a finding, not a suite crash
        reraise_interrupt(exc)
        problem = f"raised {type(exc).__name__}: {exc}"
    written = case.written_inputs()
    if written:
        wrote = f"wrote into its input {', '.join(written)}, which other builders read"
        return f"{wrote}; {problem}" if problem else wrote
    return problem


class MetadataSuite:
    """Fast metadata builders against the reference builders (``builders`` defaults to all of them)."""

    name = "metadata"
    unapplied_filters = ("impls", "modes", "layouts", "sweep", "dcp_world")  # builders of ours, per page size

    def __init__(self, builders: tuple[Builder, ...] = BUILDERS) -> None:
        self.builders = builders

    def run(self, ctx: RunContext) -> Iterator[Result]:
        if not ctx.impl_free:
            return  # another worker of the run checks the builders
        triton_reason = _triton_unavailable(ctx.device)
        for page_size in ctx.page_sizes or PAGE_SIZES:
            cases = [make_case(name, q, kv, page_size, ctx.seed, ctx.device)
                     for name, (q, kv) in named_mixes(page_size, ctx.seed).items()]
            for builder in self.builders:
                ctx.progress(f"metadata {builder.name} ps{page_size}")
                label = f"{builder.name} ps{page_size} ({len(cases)} mixes)"
                if triton_reason and "triton" in builder.name:
                    yield Result(self.name, builder.name, "unsupported", label=label, message=triton_reason)
                    continue
                failing = [(case, p) for case in cases if (p := check(builder, case))]
                yield Result(self.name, builder.name, "failed" if failing else "passed", label=label,
                             metrics={"mixes": len(cases), "failed_mixes": len(failing)},
                             details={"page_size": page_size, "seed": ctx.seed, "mixes": [c.name for c in cases],
                                      "failing_mixes": {case.name: {"q_lens": case.q_lens, "kv_lens": case.kv_lens}
                                                        for case, _ in failing}},
                             message="; ".join(f"{case.name}: {p}" for case, p in failing))


def _triton_unavailable(device: torch.device) -> str | None:
    from impls.triton.cache_ops import triton_unavailable  # imported on use, like every Triton module

    return triton_unavailable(device)
