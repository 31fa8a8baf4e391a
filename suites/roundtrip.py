"""The roundtrip suite: the cache layouts, the cache ops, the metadata conversions and the index transforms are
exact, and every impl's capability matrix has no crash cell.

Checks (one Result each):

- ``codec bounds`` per layout: quantize -> dequantize stays within the layout's stated ``error_bound`` on values of
  wide dynamic range (fp32 and bf16 inputs), exactly 0 where the format is exact (bf16 values in bf16 fields),
  and the codec is idempotent on its own grid (on values of moderate range: an nvfp4 block whose e4m3 scale falls
  in the subnormal range, 28000x below the layer's largest value, may move to another grid when re-encoded);
- ``edge inputs`` per layout: all-zero tokens and scale blocks (finite zeros, no NaN scale), values at and beyond
  the saturation point, subnormals, NaN/Inf refused by default and, when propagated, NaN/Inf over exactly the
  scale blocks that hold them;
- ``triton write`` per layout: the Triton write kernel's bytes equal the reference codec's, for fp32 / bf16 /
  fp16 and strided inputs, with slot -1 padding skipped and the rest of the poisoned cache untouched; NaN input
  refused without a write, or written as the codec writes it when propagated;
- ``triton gather`` per layout: the Triton gather returns what was written, bit for bit (the reference
  dequantization rounded to fp32, and that to bf16), also over caches of random bytes (every code pattern);
- ``conversions`` per page size: block table <-> FlashInfer CSR <-> token page table (2-D and flattened) lose
  nothing, for the reference and the fast builders;
- ``paged vs ragged`` per layout: sparse attention through PAGED indices over the cache slots and through RAGGED
  indices over the gathered K give the same float64 answer, bit for bit, and the fast transforms equal the
  reference's;
- the capability matrix (``suites.capability``).
"""

from __future__ import annotations

import traceback
from typing import Callable, Iterator

import torch

from mla_bench.layouts import LATENT_DIM, LAYOUTS, NOPE_DIM, CacheLayout, PagedCache, get_layout
from mla_bench.layouts.ops import gather_cache, write_cache
from mla_bench.metadata import fast, reference
from mla_bench.problem import build_problem
from mla_bench.results import Result
from mla_bench.workload import Mode, Workload, derive_seed
from reference.expected import expected
from reference.sparse import indexed_latent_mqa
from suites.base import RunContext
from suites.capability import run_matrix
from suites.metadata import make_case, named_mixes

SUITE = "roundtrip"
WRITE_PAGE_SIZE = 16


class RoundtripSuite:
    """``layouts`` defaults to every registered layout (or the run's ``--layouts``); ``write`` / ``gather`` to the
    Triton cache ops (other implementations of the same signatures can be checked the same way)."""

    name = SUITE
    unapplied_filters = ("modes", "sweep", "dcp_world")  # its checks are per layout and page size, not workloads

    def __init__(self, layouts: dict[str, CacheLayout] | None = None, write: Callable | None = None,
                 gather: Callable | None = None, matrix: bool = True) -> None:
        self.layouts = layouts
        self.write = write
        self.gather = gather
        self.matrix = matrix

    def run(self, ctx: RunContext) -> Iterator[Result]:
        layouts = self.layouts or {name: get_layout(name) for name in (ctx.layouts or LAYOUTS)}
        for layout in layouts.values():
            ctx.progress(f"roundtrip codec {layout.name}")
            yield _guarded("codec bounds", layout.name, lambda: check_codec_bounds(layout, ctx.seed))
            yield _guarded("edge inputs", layout.name, lambda: check_edge_inputs(layout, ctx.seed))
        write, gather, unavailable = self._cache_ops(ctx.device)
        for layout in layouts.values():
            ctx.progress(f"roundtrip cache ops {layout.name}")
            reason = unavailable(layout)
            for check, run in (("triton write", check_write), ("triton gather", check_gather)):
                if reason:
                    yield Result(SUITE, check, "unsupported", label=layout.name, message=reason)
                else:
                    yield _guarded(check, layout.name, lambda: run(layout, write, gather, ctx.device, ctx.seed))
        for page_size in ctx.page_sizes or (1, WRITE_PAGE_SIZE):
            yield _guarded("conversions", f"ps{page_size}", lambda: check_conversions(page_size, ctx.device, ctx.seed))
        for layout in layouts.values():
            ctx.progress(f"roundtrip transforms {layout.name}")
            if layout is LAYOUTS.get(layout.name):
                yield _guarded("paged vs ragged", layout.name, lambda: check_paged_vs_ragged(layout.name, ctx))
        if self.matrix:
            yield from run_matrix(ctx.impls, [name for name in layouts if name in LAYOUTS], ctx.device, ctx.preset,
                                  ctx.seed, ctx.progress)

    def _cache_ops(self, device: torch.device) -> tuple[Callable, Callable, Callable[[CacheLayout], str | None]]:
        """The write and gather under test, and why they cannot run on a layout here (None when they can)."""
        from impls.triton import cache_ops  # imported on use: Triton kernels need the interpreter set first

        if self.write and self.gather:
            return self.write, self.gather, lambda layout: None

        def unavailable(layout: CacheLayout) -> str | None:
            if not cache_ops.has_kernel(layout):
                return f"no Triton cache kernel for layout {layout.name}"
            return cache_ops.triton_unavailable(device)
        return cache_ops.write_cache_triton, cache_ops.gather_cache_triton, unavailable


def _guarded(check: str, label: str, run: Callable[[], tuple[list[str], dict]]) -> Result:
    """Run one check: ``run`` returns (problems, metrics); an exception is an error Result, not a suite crash."""
    try:
        problems, metrics = run()
    except Exception:  # noqa: BLE001
        return Result(SUITE, check, "error", label=label, message=traceback.format_exc())
    return Result(SUITE, check, "failed" if problems else "passed", label=label, metrics=metrics,
                  message="; ".join(problems))


# ---- inputs ---------------------------------------------------------------------------------------------------------
def latent_values(n: int, seed: int, spread: float = 2.0) -> torch.Tensor:
    """fp32 ``[n, 576]`` values whose magnitudes vary over tokens (e^N(0, spread)) and within a token (e^N(0, 0.5)),
    so scale blocks differ."""
    gen = torch.Generator().manual_seed(seed)
    token = torch.exp(spread * torch.randn(n, 1, generator=gen))
    element = torch.exp(0.5 * torch.randn(n, LATENT_DIM, generator=gen))
    return torch.randn(n, LATENT_DIM, generator=gen).sign() * token * element


def _scale_block_columns(layout: CacheLayout, column: int) -> slice:
    """The columns sharing ``column``'s scale."""
    nope_block, rope_block = layout.scale_blocks
    block = nope_block if column < NOPE_DIM else rope_block
    start = column - (column - (0 if column < NOPE_DIM else NOPE_DIM)) % block
    return slice(start, start + block)


def _bound_excess(layout: CacheLayout, x: torch.Tensor, decoded: torch.Tensor, scale: float | None) -> tuple[float, int]:
    """(max of error / bound over finite elements (inf where a zero bound is broken), count of non-finite decodes)."""
    error = (decoded - x.double()).abs()
    bound = layout.error_bound(x, scale)
    ratio = torch.where(bound > 0, error / bound, torch.where(error > 0, float("inf"), 0.0))
    finite = torch.isfinite(decoded)
    return float(ratio[finite].max()) if bool(finite.any()) else 0.0, int((~finite).sum())


# ---- codec ----------------------------------------------------------------------------------------------------------
def check_codec_bounds(layout: CacheLayout, seed: int) -> tuple[list[str], dict]:
    problems, metrics = [], {}
    x32 = latent_values(256, seed)
    for dtype_name, x in (("fp32", x32), ("bf16", x32.bfloat16())):
        scale = layout.fit_tensor_scale(x)
        decoded = layout.dequantize(layout.quantize(x, scale), scale)
        ratio, nonfinite = _bound_excess(layout, x, decoded, scale)
        metrics[f"{dtype_name}.bound_ratio"] = ratio
        metrics[f"{dtype_name}.rel_l2"] = float((decoded - x.double()).norm() / x.double().norm())
        if nonfinite:
            problems.append(f"{dtype_name} inputs: {nonfinite} finite values decode as NaN/Inf")
        if not ratio <= 1:
            problems.append(f"{dtype_name} inputs: error reaches {ratio:.3g}x the stated bound")
    moderate = latent_values(64, seed, spread=0.5)
    scale = layout.fit_tensor_scale(moderate)
    decoded = layout.dequantize(layout.quantize(moderate, scale), scale)
    again = layout.dequantize(layout.quantize(decoded.float(), scale), scale)
    if not torch.equal(again, decoded):
        problems.append(f"not idempotent: re-encoding decoded values changes {int((again != decoded).sum())} of them")
    return problems, metrics


def check_edge_inputs(layout: CacheLayout, seed: int) -> tuple[list[str], dict]:
    problems: list[str] = []
    base = latent_values(8, derive_seed(seed, 1), spread=0.5)
    scale = layout.fit_tensor_scale(base)
    nope_block, rope_block = layout.scale_blocks
    nope_block = max(nope_block, 16)

    def roundtrip(x: torch.Tensor, **kwargs) -> torch.Tensor:
        return layout.dequantize(layout.quantize(x, scale, **kwargs), scale)

    # all-zero tokens and all-zero scale blocks: exact zeros, never a NaN scale
    zeros = base.clone()
    zeros[0] = 0
    zeros[1, :nope_block] = 0
    zeros[2, NOPE_DIM:NOPE_DIM + rope_block] = 0
    decoded = roundtrip(zeros)
    if not bool(torch.isfinite(decoded).all()):
        problems.append(f"all-zero blocks decode to {int((~torch.isfinite(decoded)).sum())} NaN/Inf values")
    elif bool((decoded[zeros == 0] != 0).any()):
        problems.append("all-zero blocks do not decode to zeros")

    # subnormal and huge inputs: finite and within the stated bound
    extremes = base.clone()
    extremes[3] = 1e-40 * extremes[3].sign()
    extremes[4, :nope_block] = -3e-42
    extremes[5, nope_block:2 * nope_block] = 3e38 * extremes[5, nope_block:2 * nope_block].sign()
    extremes[6] = 1e30
    for dtype_name, x in (("fp32", extremes), ("bf16", extremes.bfloat16())):
        x_scale = layout.fit_tensor_scale(x)
        ratio, nonfinite = _bound_excess(layout, x, layout.dequantize(layout.quantize(x, x_scale), x_scale), x_scale)
        if nonfinite or not ratio <= 1:
            problems.append(f"subnormal/huge {dtype_name} inputs: {nonfinite} NaN/Inf decodes, error {ratio:.3g}x bound")

    # beyond a fixed per-layer scale's range: saturate at the largest code, never NaN/Inf
    if layout.needs_tensor_scale:
        top = float(layout.dequantize(layout.quantize(torch.full((1, LATENT_DIM), 3e38), scale), scale)[0, 0])
        for value in (10 * top, 3e38):
            beyond = base.clone()
            beyond[7, :4] = torch.tensor([value, -value, top, -top])
            got = roundtrip(beyond)[7, :4].tolist()
            if got != [top, -top, top, -top]:
                problems.append(f"values beyond the scale's range ({value:.3g}) decode to {got[:2]}, "
                                f"expected the saturation value +-{top:.6g}")

    # NaN/Inf: refused by default; propagated over exactly their scale blocks
    bad = base.clone()
    bad[1, 5] = float("nan")
    bad[2, NOPE_DIM + 3] = float("inf")
    bad[3, 200] = float("-inf")
    try:
        layout.quantize(bad, scale)
        problems.append("NaN/Inf input was encoded without propagate_nonfinite")
    except ValueError as exc:
        if "NaN/Inf" not in str(exc):
            problems.append(f"NaN/Inf input refused with an unclear message: {exc}")
    decoded = roundtrip(bad, propagate_nonfinite=True)
    expect_nonfinite = torch.zeros_like(decoded, dtype=torch.bool)
    for token, column in ((1, 5), (2, NOPE_DIM + 3), (3, 200)):
        expect_nonfinite[token, _scale_block_columns(layout, column)] = True
    if not torch.equal(~torch.isfinite(decoded), expect_nonfinite):
        problems.append(f"propagated NaN/Inf: {int((~torch.isfinite(decoded)).sum())} non-finite decodes, expected "
                        f"exactly their scale blocks ({int(expect_nonfinite.sum())} values)")
    clean = roundtrip(torch.where(torch.isfinite(bad), bad, 0.0))
    if not torch.equal(decoded[~expect_nonfinite], clean[~expect_nonfinite]):
        problems.append("propagated NaN/Inf changed values outside their scale blocks")
    return problems, {"problems": len(problems)}


# ---- cache ops ------------------------------------------------------------------------------------------------------
def bit_mismatches(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """Elements whose bits differ (a NaN matches any NaN); ``actual`` and ``expected`` have one float dtype."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise ValueError(f"cannot compare {actual.dtype} {list(actual.shape)} with {expected.dtype} "
                         f"{list(expected.shape)}")
    actual, expected = actual.cpu(), expected.cpu()
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[actual.dtype]
    both_nan = torch.isnan(actual) & torch.isnan(expected)
    return int(((actual.view(as_int) != expected.view(as_int)) & ~both_nan).sum())


def _cache_pair(layout: CacheLayout, num_blocks: int, values: torch.Tensor, device: torch.device):
    scale = layout.fit_tensor_scale(values)
    return (PagedCache.empty(layout, num_blocks, WRITE_PAGE_SIZE, device, scale),
            PagedCache.empty(layout, num_blocks, WRITE_PAGE_SIZE, device, scale))


def _write_case(device: torch.device, seed: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(num_blocks, values fp32 [N, 576], slots with two -1 paddings and the rest distinct and permuted)."""
    n = 1024 if device.type == "cuda" else 6  # the interpreter runs one program in tens of milliseconds
    num_blocks = -(-2 * n // WRITE_PAGE_SIZE)
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * WRITE_PAGE_SIZE, generator=gen)[:n]
    slots[[1, n - 2]] = -1
    values = latent_values(n, derive_seed(seed, 2))
    values[0, :128] = 0
    values[2, 7] = 1e-40
    return num_blocks, values, slots


def check_write(layout: CacheLayout, write: Callable, gather: Callable, device: torch.device,
                seed: int) -> tuple[list[str], dict]:
    problems, mismatched = [], 0
    num_blocks, values, slots = _write_case(device, seed)
    wide = torch.cat([values.clamp(-6e4, 6e4), values[:, :24]], dim=1)  # rows of 600: a strided [N, 576] view
    for name, x in (("fp32", values), ("bf16", values.bfloat16()), ("strided fp16", wide[:, :LATENT_DIM].half())):
        expect, got = _cache_pair(layout, num_blocks, x, device)
        write_cache(expect, x, slots)
        write(got, x.to(device), slots.to(device))
        wrong = int((got.data.cpu() != expect.data.cpu()).sum())
        mismatched += wrong
        if wrong:
            problems.append(f"{name} inputs: {wrong} bytes differ from the reference codec's (padding rows and "
                            f"unwritten slots must stay poisoned)")

    bad = values.clone()
    bad[3, 9] = float("nan")
    bad[4, NOPE_DIM + 1] = float("-inf")
    expect, got = _cache_pair(layout, num_blocks, values, device)
    before = got.data.clone()
    try:
        write(got, bad.to(device), slots.to(device))
        problems.append("NaN/Inf input written without propagate_nonfinite")
    except ValueError as exc:
        if "NaN/Inf" not in str(exc):
            problems.append(f"NaN/Inf input refused with an unclear message: {exc}")
    if not torch.equal(got.data, before):
        problems.append("a refused write changed the cache")
    expect.rows()[slots[slots >= 0]] = layout.quantize(bad[slots >= 0], expect.tensor_scale,
                                                       propagate_nonfinite=True).to(device)
    write(got, bad.to(device), slots.to(device), propagate_nonfinite=True)
    wrong = int((got.data.cpu() != expect.data.cpu()).sum())
    mismatched += wrong
    if wrong:
        problems.append(f"propagated NaN/Inf: {wrong} bytes differ from the reference codec's")
    return problems, {"mismatched_bytes": mismatched, "tokens": values.shape[0]}


def check_gather(layout: CacheLayout, write: Callable, gather: Callable, device: torch.device,
                 seed: int) -> tuple[list[str], dict]:
    problems, mismatched = [], 0
    num_blocks, values, slots = _write_case(device, seed)
    _, cache = _cache_pair(layout, num_blocks, values, device)
    write(cache, values.to(device), slots.to(device))
    written = slots[slots >= 0].flip(0)
    random_bytes = PagedCache(layout, torch.randint(0, 256, cache.data.shape, dtype=torch.uint8,
                                                    generator=torch.Generator().manual_seed(seed)).to(device),
                              cache.tensor_scale)
    some_slots = torch.randperm(random_bytes.num_slots)[:8]  # 8 x 576 random codes: every byte value, many times
    for name, source, token_slots in (("written tokens", cache, written), ("random bytes", random_bytes, some_slots)):
        decoded = gather_cache(source, token_slots)
        for dtype in (torch.float32, torch.bfloat16):
            got = gather(source, token_slots.to(device), dtype)
            wrong = bit_mismatches(got, decoded.float().to(dtype))
            mismatched += wrong
            if wrong:
                problems.append(f"{name}, {dtype}: {wrong} values differ from the reference dequantization")
    return problems, {"mismatched_values": mismatched}


# ---- metadata conversions -------------------------------------------------------------------------------------------
def _owned(block_table: torch.Tensor, kv_lens: list[int], page_size: int) -> torch.Tensor:
    """The block table with entries past each request's pages set to -1 (what CSR and token tables carry)."""
    owned = block_table.clone()
    for b, n in enumerate(kv_lens):
        owned[b, reference.blocks_needed(n, page_size):] = -1
    return owned


def check_conversions(page_size: int, device: torch.device, seed: int) -> tuple[list[str], dict]:
    problems = []
    mixes = named_mixes(page_size, seed)
    for name, (q_lens, kv_lens) in mixes.items():
        case = make_case(name, q_lens, kv_lens, page_size, seed, device)
        table, sizes, width = case.block_table, case.sizes, case.block_table.shape[1]
        owned = _owned(table, kv_lens, page_size)
        token_table = reference.token_page_table(table, kv_lens, page_size)
        indptr, indices, _ = reference.flashinfer_csr(kv_lens, table, page_size)
        fast_indptr, fast_indices, _ = fast.flashinfer_csr(case.on_device("seq_lens"), case.on_device("block_table"),
                                                           page_size, sizes.num_pages)
        fast_token_table = fast.token_page_table(case.on_device("seq_lens"), case.on_device("block_table"), page_size,
                                                 sizes.max_kv_len).cpu()
        flat = reference.flat_token_slots(table, kv_lens, page_size)
        from_csr = torch.cat([indices[int(indptr[b]):int(indptr[b + 1])].long().repeat_interleave(page_size)[:n]
                              * page_size + torch.arange(n) % page_size for b, n in enumerate(kv_lens)])
        checks = {
            "block table -> CSR -> block table": reference.block_table_from_csr(indptr, indices, width),
            "fast CSR -> block table": reference.block_table_from_csr(fast_indptr.cpu(), fast_indices.cpu(), width),
            "block table -> token table -> block table":
                reference.block_table_from_token_table(token_table, kv_lens, page_size, width),
            "fast token table -> block table":
                reference.block_table_from_token_table(fast_token_table, kv_lens, page_size, width),
        }
        for what, rebuilt in checks.items():
            if not torch.equal(rebuilt, owned):
                problems.append(f"{name}: {what} loses entries")
        rows = torch.cat([token_table[b, :n] for b, n in enumerate(kv_lens)])
        if not (torch.equal(rows, flat) and torch.equal(from_csr, flat)):
            problems.append(f"{name}: the token table rows, the CSR pages and the flattened token slots disagree")
    return problems, {"mixes": len(mixes)}


# ---- index transforms -----------------------------------------------------------------------------------------------
def check_paged_vs_ragged(layout: str, ctx: RunContext) -> tuple[list[str], dict]:
    problems = []
    answers = {}
    for transform in ("paged", "ragged"):
        workload = Workload(mode=Mode.SPARSE_PREFILL, q_lens=(2, 3, 1, 2), kv_lens=(40, 97, 5, 2), topk=16,
                            index_transform=transform, layout=layout, page_size=16, seed=ctx.seed)
        p = build_problem(workload, "cpu")
        meta = p.meta
        if transform == "paged":
            rows = gather_cache(p.cache, torch.arange(p.cache.num_slots))  # every slot, poisoned ones too
            fast_indices = fast.transform_indices_paged(p.topk_indices.to(ctx.device), meta.query_start_loc.to(ctx.device),
                                                        meta.seq_lens.to(ctx.device), meta.block_table.to(ctx.device),
                                                        meta.page_size)
        else:
            rows = gather_cache(p.cache, meta.token_slots)
            fast_indices = fast.transform_indices_ragged(p.topk_indices.to(ctx.device),
                                                         meta.query_start_loc.to(ctx.device),
                                                         meta.seq_lens.to(ctx.device), meta.kv_start_loc.to(ctx.device))
        if not torch.equal(fast_indices.cpu(), p.sparse_indices):
            problems.append(f"the fast {transform} transform differs from the reference's")
        answers[transform] = indexed_latent_mqa(p.q, rows, p.sparse_indices, p.scale)
        logical = expected(p)
    for transform, (out, lse) in answers.items():
        if not (torch.equal(out, logical.out) and torch.equal(lse, logical.lse)):
            problems.append(f"{transform} indices give a different attention than the logical positions")
    return problems, {"tokens": int(logical.out.shape[0])}
