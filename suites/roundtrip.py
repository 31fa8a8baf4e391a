"""The roundtrip suite: the cache layouts, the cache ops, the metadata conversions and the index transforms are
exact, and every impl's capability matrix has no crash cell.

Checks (one Result each):

- ``codec bounds`` per layout: quantize -> dequantize stays within the layout's stated ``error_bound`` on values of
  wide dynamic range (fp32 and bf16 inputs) with a probe per token that a too-large tile scale rounds past the bound,
  exactly 0 where the format is exact (bf16 values in bf16 fields), a fitted per-layer scale saturates at the
  largest value it scales (a looser one hides behind its own bound), and the codec is idempotent on its own grid
  (on values of moderate range: an nvfp4 block whose e4m3 scale falls in the subnormal range, 28000x below the
  layer's largest value, may move to another grid when re-encoded);
- ``edge inputs`` per layout: all-zero tokens and scale blocks (finite zeros, no NaN scale), values at and beyond
  the saturation point, subnormals, e2m1 grid values at SGLang's MX scale floors (where the floor, not amax, sets
  the block scale: a floor twice too high breaks the bound), NaN/Inf refused by default and, when propagated,
  NaN/Inf over exactly the scale blocks that hold them; a per-layer scale fitted to zeros, subnormals (amax down to
  1e-44) or NaN/Inf-holding values is one the layout takes, NaN/Inf ignored;
- ``device codec`` per layout, on a GPU only: the codec there writes the bytes it writes on the host and fits the same
  per-layer scale (fp32 and bf16 inputs of wide range with the tile probes and the MX floors, and NaN/Inf
  propagated). The codecs run where their values live (``write_cache`` into a GPU cache, the bench scripts' caches
  drawn on the GPU; ``build_problem`` encodes on the host), and there torch divides by a Python number as a
  multiplication by its reciprocal (one bit off the quotient for about half of all values);
- ``triton write`` per layout: the Triton write kernel's bytes equal the reference codec's, for fp32 / bf16 /
  fp16 and strided (rows 600 apart) inputs spread over several pages, with slot -1 padding skipped and the rest of
  the poisoned cache untouched (slot 0 and the last slot, where a mishandled -1 lands, are never written); a NaN
  in kv_c and an Inf in k_pe, each alone in a written row, refused without a write, or written as the codec writes
  them when propagated; NaN/Inf in padding rows neither refused nor written; an empty write a no-op; a differing
  byte is named by its field (codes, scales, rope) and slot;
- ``triton gather`` per layout: the Triton gather returns what was written, bit for bit (the reference
  dequantization rounded to fp32, and that to bf16), also over caches of random bytes (every code pattern), and
  nothing for no slots;
- ``conversions`` per page size: block table <-> FlashInfer CSR <-> token page table (2-D and flattened) lose
  nothing, for the reference and the fast builders;
- ``paged vs ragged`` per layout: sparse attention through PAGED indices over the cache slots and through RAGGED
  indices over the gathered K give the same float64 answer, bit for bit, and the fast transforms equal the
  reference's (the mix holds an empty request and a padding one: no key, one query);
- the capability matrix (``suites.capability``).

``write`` and ``gather`` default to the Triton cache ops each on its own, so either can be swapped for another
implementation of the same signature; the check of a given op is named ``given write`` / ``given gather``.
"""

from __future__ import annotations

import traceback
from typing import Callable, Iterator

import torch

from mla_bench.errors import describe, reraise_interrupt
from mla_bench.layouts import LATENT_DIM, LAYOUTS, NOPE_DIM, CacheLayout, PagedCache, get_layout
from mla_bench.layouts.base import check_tensor_scale
from mla_bench.layouts.formats import E2M1_MAX, E4M3_MAX, SLACK, ceil_log2
from mla_bench.layouts.fp8 import DS_MLA_TILE
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
        layouts = self.layouts if self.layouts is not None else {name: get_layout(name)
                                                                  for name in (ctx.layouts or LAYOUTS)}
        if ctx.impl_free:  # the checks of no impl: under --isolate, another worker may make them
            yield from self._impl_free_checks(ctx, layouts)
        if self.matrix:
            yield from run_matrix(ctx.impls, [name for name in layouts if name in LAYOUTS], ctx.device, ctx.preset,
                                  ctx.seed, ctx.progress)

    def _impl_free_checks(self, ctx: RunContext, layouts: dict[str, CacheLayout]) -> Iterator[Result]:
        for layout in layouts.values():
            ctx.progress(f"roundtrip codec {layout.name}")
            yield _guarded("codec bounds", layout.name, lambda: check_codec_bounds(layout, ctx.seed))
            yield _guarded("edge inputs", layout.name, lambda: check_edge_inputs(layout, ctx.seed))
            if ctx.device.type != "cpu":
                yield _guarded("device codec", layout.name, lambda: check_device_codec(layout, ctx.device, ctx.seed))
        write, gather, unavailable = self._cache_ops(ctx.device)
        names = {"write": f"{'given' if self.write else 'triton'} write",
                 "gather": f"{'given' if self.gather else 'triton'} gather"}
        for layout in layouts.values():
            ctx.progress(f"roundtrip cache ops {layout.name}")
            for op, run in (("write", check_write), ("gather", check_gather)):
                check, reason = names[op], unavailable[op](layout)
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

    def _cache_ops(self, device: torch.device) -> tuple[Callable, Callable, dict[str, Callable]]:
        """The write and gather under test (each the given one, else the Triton op), and per op's check why it cannot
        run on a layout here (None when it can): the write check uses the write, the gather check both."""
        from impls.triton import cache_ops  # imported on use: Triton kernels need the interpreter set first

        def triton_reason(layout: CacheLayout) -> str | None:
            if not cache_ops.has_kernel(layout):
                return f"no Triton cache kernel for layout {layout.name}"
            return cache_ops.triton_unavailable(device)
        return (self.write or cache_ops.write_cache_triton, self.gather or cache_ops.gather_cache_triton,
                {"write": lambda layout: None if self.write else triton_reason(layout),
                 "gather": lambda layout: None if self.write and self.gather else triton_reason(layout)})


def _guarded(check: str, label: str, run: Callable[[], tuple[list[str], dict]]) -> Result:
    """Run one check: ``run`` returns (problems, metrics); an exception is an error Result, not a suite crash, whose
    message names the exception before its traceback."""
    try:
        problems, metrics = run()
    except BaseException as exc:  # noqa: BLE001 - an impl's crash (sys.exit too) is this check's result
        reraise_interrupt(exc)
        return Result(SUITE, check, "error", label=label, message=f"{type(exc).__name__}: {exc}\n\n"
                                                                  f"{traceback.format_exc()}")
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


def _with_tile_probes(x: torch.Tensor) -> torch.Tensor:
    """``x`` with column 5 of each token at the smallest e4m3 step of its first 128-column tile under the exact scale,
    ``amax / 448 * 2^-9``: that scale encodes it exactly, while a tile scale too large (amax / 240, e4m3fnuz's
    largest value, a ROCm mix-up) rounds it to a step of its own, 1.5x the bound (a relative bound alone lets such a
    scale pass on the other values)."""
    probed = x.clone()
    probed[:, 5] = x[:, :DS_MLA_TILE].abs().amax(dim=1) / E4M3_MAX * 2.0 ** -9
    return probed


def _at_mx_floors() -> torch.Tensor:
    """A token of e2m1 grid values (block amax 4 steps) times the block scale SGLang's MX floors set: 2^-33 (block-16's
    ``max(amax / 6, 1e-10)``) on the first 256 columns, 2^-42 (NSA's ``max(amax, 1e-12) / 6``) on the rest. That
    scale encodes them exactly; one twice as large (a floor twice too high) rounds the 0.5 steps past the bound (1.16x,
    1.36x), which the random values, far above the floors, never show."""
    floors = torch.exp2(ceil_log2(torch.tensor([1e-10, 1e-12 / E2M1_MAX])).float())
    grid = torch.tensor([0.5, -1, 1.5, -2, 3, -4, 2, -0.5]).repeat(LATENT_DIM // 8)
    return grid * floors.repeat_interleave(torch.tensor([NOPE_DIM // 2, LATENT_DIM - NOPE_DIM // 2]))


def _saturation(layout: CacheLayout, scale: float | None) -> torch.Tensor:
    """Per column, what a value beyond every range (3e38) decodes to under ``scale``: where a per-layer scale applies,
    the largest code times it."""
    return layout.dequantize(layout.quantize(torch.full((1, LATENT_DIM), 3e38), scale), scale)[0]


def _scale_block_columns(layout: CacheLayout, column: int) -> slice:
    """The columns sharing ``column``'s scale."""
    nope_block, rope_block = layout.scale_blocks
    block = nope_block if column < NOPE_DIM else rope_block
    start = column - (column - (0 if column < NOPE_DIM else NOPE_DIM)) % block
    return slice(start, start + block)


def _bound_excess(layout: CacheLayout, x: torch.Tensor, decoded: torch.Tensor,
                  scale: float | None) -> tuple[float, int, str]:
    """(max of error / bound over finite elements (inf where a zero bound is broken), count of non-finite decodes,
    where the max is)."""
    error = (decoded - x.double()).abs()
    bound = layout.error_bound(x, scale)
    ratio = torch.where(bound > 0, error / bound, torch.where(error > 0, float("inf"), 0.0))
    ratio = torch.where(torch.isfinite(decoded), ratio, -1.0)
    token, column = divmod(int(ratio.argmax()), LATENT_DIM)
    return max(float(ratio.max()), 0.0), int((~torch.isfinite(decoded)).sum()), _at(token, column)


def _at(token: int, column: int) -> str:
    return f"token {token}, column {column} ({'kv_c' if column < NOPE_DIM else 'k_pe'})"


# ---- codec ----------------------------------------------------------------------------------------------------------
def check_codec_bounds(layout: CacheLayout, seed: int) -> tuple[list[str], dict]:
    problems, metrics = [], {}
    x32 = _with_tile_probes(latent_values(256, seed))
    for dtype_name, x in (("fp32", x32), ("bf16", x32.bfloat16())):
        scale = layout.fit_tensor_scale(x)
        decoded = layout.dequantize(layout.quantize(x, scale), scale)
        ratio, nonfinite, worst = _bound_excess(layout, x, decoded, scale)
        metrics[f"{dtype_name}.bound_ratio"] = ratio
        metrics[f"{dtype_name}.rel_l2"] = float((decoded - x.double()).norm() / x.double().norm())
        if nonfinite:
            problems.append(f"{dtype_name} inputs: {nonfinite} finite values decode as NaN/Inf")
        if not ratio <= 1:
            problems.append(f"{dtype_name} inputs: error reaches {ratio:.3g}x the stated bound (at {worst})")
        # the bound takes the fitted per-layer scale, so it cannot judge it: the columns that scale saturates alike
        # (all for fp8_e4m3, the nope ones for nvfp4) must reach it with their largest value, no more, no less
        if layout.needs_tensor_scale:
            tops = _saturation(layout, scale)
            top, amax = float(tops[0]), float(x.double().abs()[:, tops == tops[0]].max())
            if not abs(top - amax) <= amax * (SLACK - 1):
                problems.append(f"{dtype_name} inputs: the fitted per-layer scale {scale:.6g} saturates at {top:.6g}, "
                                f"not at the largest value it scales ({amax:.6g}): a larger one coarsens every step, "
                                f"a smaller one clips")
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

    # subnormal, floor-scaled and huge inputs: finite and within the stated bound
    extremes = base.clone()
    extremes[3] = 1e-40 * extremes[3].sign()
    extremes[4, :nope_block] = -3e-42
    extremes[5, nope_block:2 * nope_block] = 3e38 * extremes[5, nope_block:2 * nope_block].sign()
    extremes[6] = 1e30
    extremes[7] = _at_mx_floors()
    for dtype_name, x in (("fp32", extremes), ("bf16", extremes.bfloat16())):
        x_scale = layout.fit_tensor_scale(x)
        decoded = layout.dequantize(layout.quantize(x, x_scale), x_scale)
        ratio, nonfinite, worst = _bound_excess(layout, x, decoded, x_scale)
        if nonfinite or not ratio <= 1:
            problems.append(f"subnormal/floor/huge {dtype_name} inputs: {nonfinite} NaN/Inf decodes, error "
                            f"{ratio:.3g}x bound (at {worst})")

    # beyond a fixed per-layer scale's range: saturate at the largest code, never NaN/Inf
    if layout.needs_tensor_scale:
        top = float(_saturation(layout, scale)[0])
        for value in (10 * top, 3e38):
            beyond = base.clone()
            beyond[7, :4] = torch.tensor([value, -value, top, -top])
            got = roundtrip(beyond)[7, :4].tolist()
            if got != [top, -top, top, -top]:
                problems.append(f"values beyond the scale's range ({value:.3g}) decode to {got[:2]}, "
                                f"expected the saturation value +-{top:.6g}")

        # the per-layer scale fitted to zeros, to subnormals (amax down to 1e-44), or to values holding NaN/Inf: one
        # the layout takes (finite, at least the smallest normal float32), NaN/Inf ignored (a zero scale divides by
        # zero; an Inf one flushes every value to 0)
        holding = base.clone()
        holding[1, 5], holding[2, NOPE_DIM + 3] = float("nan"), float("inf")
        finite_part = layout.fit_tensor_scale(torch.where(torch.isfinite(holding), holding, 0.0))
        tiny = base / base.abs().max() * 1e-44
        for what, x, expect in (("all-zero", torch.zeros_like(base), None), ("subnormal", base * 1e-40, None),
                                ("tiny", tiny, None), ("NaN/Inf-holding", holding, finite_part)):
            fitted = layout.fit_tensor_scale(x)
            try:
                check_tensor_scale(layout.name, fitted)
            except ValueError as exc:
                problems.append(f"the per-layer scale fitted to {what} values is {fitted!r}, not one it takes: {exc}")
                continue
            if expect is not None and fitted != expect:
                problems.append(f"the per-layer scale fitted to {what} values is {fitted!r}, not that of their "
                                f"finite values ({expect!r})")

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


def _byte_fields(layout: CacheLayout) -> tuple[tuple[str, int, int], ...]:
    """The layout's named byte fields ``(name, start, end)``, or its whole token as one."""
    return layout.fields or (("bytes", 0, layout.bytes_per_token),)


def check_device_codec(layout: CacheLayout, device: torch.device, seed: int) -> tuple[list[str], dict]:
    """The codec on ``device`` against the codec on the host: the same per-layer scale, the same bytes."""
    problems, differing = [], 0
    values = _with_tile_probes(latent_values(256, seed))
    values[7] = _at_mx_floors()
    nonfinite = values.clone()
    nonfinite[3, 5], nonfinite[9, NOPE_DIM + 18], nonfinite[11, 300] = float("nan"), float("inf"), -float("inf")
    for name, x, propagate in (("fp32", values, False), ("bf16", values.bfloat16(), False),
                               ("NaN/Inf", nonfinite, True)):
        scale = layout.fit_tensor_scale(x)
        fitted_there = layout.fit_tensor_scale(x.to(device))
        if fitted_there != scale:
            problems.append(f"{name} inputs: the per-layer scale fitted on {device} is {fitted_there!r}, on the host "
                            f"{scale!r}")
        on_host = layout.quantize(x, scale, propagate_nonfinite=propagate)
        wrong = layout.quantize(x.to(device), scale, propagate_nonfinite=propagate).cpu() != on_host
        tokens = wrong.any(dim=1)
        differing += int(tokens.sum())
        if bool(tokens.any()):
            fields = [field for field, start, end in _byte_fields(layout) if bool(wrong[:, start:end].any())]
            problems.append(f"{name} inputs: {int(tokens.sum())} of {len(x)} tokens encode differently on {device} "
                            f"than on the host, first token {int(tokens.nonzero()[0])}, in {', '.join(fields)}")
    return problems, {"differing_tokens": differing}


# ---- cache ops ------------------------------------------------------------------------------------------------------
def bit_mismatches(actual: torch.Tensor, expected: torch.Tensor) -> tuple[int, str | None]:
    """(values whose bits differ, how): a NaN matches any NaN; the first differing value, and how many are NaN where
    a number is expected (poisoned slots read); (0, None) when equal."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return expected.numel(), f"{describe(actual)} instead of {describe(expected)}"
    actual, expected = actual.cpu(), expected.cpu()
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[actual.dtype]
    wrong = (actual.view(as_int) != expected.view(as_int)) & ~(torch.isnan(actual) & torch.isnan(expected))
    if not bool(wrong.any()):
        return 0, None
    token, column = (int(i) for i in wrong.nonzero()[0])
    count, poison = int(wrong.sum()), int((torch.isnan(actual) & ~torch.isnan(expected)).sum())
    text = (f"{count} values differ from the reference dequantization, first at {_at(token, column)}: "
            f"{actual[token, column].item():.6g} instead of {expected[token, column].item():.6g}")
    return count, text + (f", {poison} NaN where a number is expected (poisoned slots read)" if poison else "")


def byte_mismatches(got: PagedCache, expect: PagedCache, slots: torch.Tensor) -> tuple[int, str | None]:
    """(bytes in which ``got`` differs from ``expect``, where): slots no token goes to that changed (padding written,
    or a wrong slot -> (page, offset) mapping), and per byte field of the layout the written slots that differ,
    with the first one's slot and token; (0, None) when equal."""
    wrong = got.rows().cpu() != expect.rows().cpu()
    if not bool(wrong.any()):
        return 0, None
    slots = slots.cpu()
    written = torch.zeros(wrong.shape[0], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    parts = []
    stray = wrong.any(dim=1) & ~written
    if bool(stray.any()):
        parts.append(f"{int(stray.sum())} slots no token goes to changed, first slot {int(stray.nonzero()[0])} "
                     f"(padding written, or a wrong slot -> (page, offset) mapping)")
    layout = got.layout
    for field, start, end in _byte_fields(layout):
        rows = (wrong[:, start:end].any(dim=1) & written).nonzero().flatten()
        if rows.numel():
            token = int((slots == rows[0]).nonzero()[0])
            parts.append(f"{field} (bytes {start}-{end - 1}) in {rows.numel()} written slots, first slot "
                         f"{int(rows[0])} (token {token})")
    count = int(wrong.sum())
    return count, f"{count} bytes differ from the reference codec's: " + ", ".join(parts)


def _cache_pair(layout: CacheLayout, num_blocks: int, values: torch.Tensor, device: torch.device):
    scale = layout.fit_tensor_scale(values)
    return (PagedCache.empty(layout, num_blocks, WRITE_PAGE_SIZE, device, scale),
            PagedCache.empty(layout, num_blocks, WRITE_PAGE_SIZE, device, scale))


def _write_case(device: torch.device, seed: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(num_blocks, values fp32 [N, 576], slots with two -1 paddings and the rest distinct and permuted over at least
    8 pages, so that a wrong slot -> (page, offset) mapping moves them; slot 0 and the last slot are never written,
    so that a -1 clamped to 0 or wrapped to the end shows)."""
    n = 1024 if device.type == "cuda" else 6  # the interpreter runs one program in tens of milliseconds
    num_blocks = max(-(-2 * n // WRITE_PAGE_SIZE), 8)
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * WRITE_PAGE_SIZE - 2, generator=gen)[:n] + 1
    slots[[1, n - 2]] = -1
    values = latent_values(n, derive_seed(seed, 2))
    values[0, :128] = 0
    values[2, 7] = 1e-40
    return num_blocks, values, slots


def check_write(layout: CacheLayout, write: Callable, gather: Callable, device: torch.device,
                seed: int) -> tuple[list[str], dict]:
    problems, mismatched = [], 0
    num_blocks, values, slots = _write_case(device, seed)
    # rows 600 apart: sliced after the cast and the move to the device, each of which would make a contiguous copy
    strided = torch.cat([values, values[:, :24]], dim=1).clamp(-6e4, 6e4).half().to(device)[:, :LATENT_DIM]
    assert strided.stride(0) != LATENT_DIM, f"the strided fp16 input has contiguous rows: strides {strided.stride()}"
    for name, x in (("fp32", values.to(device)), ("bf16", values.bfloat16().to(device)), ("strided fp16", strided)):
        host = x.cpu()
        expect, got = _cache_pair(layout, num_blocks, host, device)
        write_cache(expect, host, slots)
        write(got, x, slots.to(device))
        wrong, where = byte_mismatches(got, expect, slots)
        mismatched += wrong
        if wrong:
            problems.append(f"{name} inputs: {where}")

    # padding rows (slot -1) may hold anything, NaN/Inf too (CUDA-graph padding): never refused, never written
    garbage = values.clone()
    padding = (slots < 0).nonzero().flatten()
    garbage[padding[:, None], torch.arange(0, LATENT_DIM, 7)] = float("nan")
    garbage[padding[:, None], torch.arange(3, LATENT_DIM, 7)] = float("-inf")
    expect, got = _cache_pair(layout, num_blocks, values, device)
    write_cache(expect, values, slots)
    try:
        write(got, garbage.to(device), slots.to(device))
    except ValueError as exc:
        problems.append(f"NaN/Inf in padding rows (slot -1, never written) refused: {exc}")
    else:
        wrong, where = byte_mismatches(got, expect, slots)
        mismatched += wrong
        if wrong:
            problems.append(f"NaN/Inf in padding rows (slot -1): {where}")

    # an empty step (no token) writes nothing and raises nothing
    before = got.data.clone()
    try:
        write(got, values[:0].to(device), slots[:0].to(device))
    except BaseException as exc:  # noqa: BLE001 - any exception is the finding
        reraise_interrupt(exc)
        problems.append(f"an empty write (0 tokens) raised {type(exc).__name__}: {exc}")
    else:
        if not torch.equal(got.data, before):
            problems.append("an empty write (0 tokens) changed the cache")

    # a NaN in kv_c and an Inf in k_pe, each alone in a written row (rows 1 and n - 2 are padding): refused
    bad = values.clone()
    expect, got = _cache_pair(layout, num_blocks, values, device)
    before = got.data.clone()
    for token, column, value in ((3, 9, float("nan")), (2, NOPE_DIM + 1, float("-inf"))):
        alone = values.clone()
        alone[token, column] = bad[token, column] = value
        try:
            write(got, alone.to(device), slots.to(device))
            problems.append(f"NaN/Inf input written without propagate_nonfinite (at {_at(token, column)})")
        except ValueError as exc:
            if "NaN/Inf" not in str(exc):
                problems.append(f"NaN/Inf input refused with an unclear message: {exc}")
        if not torch.equal(got.data, before):
            problems.append(f"a refused write changed the cache (NaN/Inf at {_at(token, column)})")
    expect.rows()[slots[slots >= 0]] = layout.quantize(bad[slots >= 0], expect.tensor_scale,
                                                       propagate_nonfinite=True).to(device)
    write(got, bad.to(device), slots.to(device), propagate_nonfinite=True)
    wrong, where = byte_mismatches(got, expect, slots)
    mismatched += wrong
    if wrong:
        problems.append(f"propagated NaN/Inf: {where}")
    return problems, {"mismatched_bytes": mismatched, "tokens": values.shape[0]}


def check_gather(layout: CacheLayout, write: Callable, gather: Callable, device: torch.device,
                 seed: int) -> tuple[list[str], dict]:
    problems, mismatched = [], 0
    num_blocks, values, slots = _write_case(device, seed)
    _, cache = _cache_pair(layout, num_blocks, values, device)
    write(cache, values.to(device), slots.to(device))
    written = slots[slots >= 0].flip(0)
    gen = torch.Generator().manual_seed(seed)
    random_bytes = PagedCache(layout, torch.randint(0, 256, cache.data.shape, dtype=torch.uint8,
                                                    generator=gen).to(device), cache.tensor_scale)
    # 8 x 576 random codes: every byte value, many times; drawn from the seed, so that a failure reproduces
    some_slots = torch.randperm(random_bytes.num_slots, generator=gen)[:8]
    for name, source, token_slots in (("written tokens", cache, written), ("random bytes", random_bytes, some_slots)):
        decoded = gather_cache(source, token_slots)
        for dtype in (torch.float32, torch.bfloat16):
            got = gather(source, token_slots.to(device), dtype)
            wrong, how = bit_mismatches(got, decoded.float().to(dtype))
            mismatched += wrong
            if wrong:
                problems.append(f"{name}, {dtype}: {how}")
    try:  # no slot (an empty step): an empty answer, no error
        empty = gather(cache, written[:0].to(device), torch.float32)
        if empty.shape != (0, LATENT_DIM):
            problems.append(f"gathering no slot gives shape {list(empty.shape)}, expected [0, {LATENT_DIM}]")
    except BaseException as exc:  # noqa: BLE001 - any exception is the finding
        reraise_interrupt(exc)
        problems.append(f"gathering no slot raised {type(exc).__name__}: {exc}")
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
        workload = Workload(mode=Mode.SPARSE_PREFILL, q_lens=(2, 3, 0, 1, 1, 2), kv_lens=(40, 97, 0, 0, 5, 2), topk=16,
                            index_transform=transform, layout=layout, page_size=16, seed=ctx.seed)
        p = build_problem(workload, "cpu")
        meta = p.meta
        if transform == "paged":
            rows = gather_cache(p.cache, torch.arange(p.cache.num_slots))  # every slot, poisoned ones too
            fast_indices = fast.transform_indices_paged(p.topk_indices.to(ctx.device),
                                                        meta.query_start_loc.to(ctx.device),
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
