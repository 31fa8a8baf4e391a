"""Equivalence suite: our Triton paths computing the same function two ways must agree.

Checks (one Result per pair of sides):

- ``absorbed == mha``: the absorbed decode (``triton_decode`` when registered, else ``torch_eager``; the one named
  with ``--impl``, filed under it) up-projected with W_UV, against ``triton_prefill`` on the same tokens (workloads
  that differ only in mode, with the same page size and seed, draw the same q, latent and weights: the block table
  is drawn first, from the page size);
- ``chunked == unchunked``: ``triton_chunked_prefill`` at several MCC (one token or half a page, a page minus
  one, a page plus one, the whole context) against ``triton_prefill`` over context and new tokens at once;
- ``dcp == single rank``: ``run_dcp`` over W ranks (gloo on CPU, NCCL on GPUs; unsupported without W GPUs)
  against the same run on one rank;
- ``sparse(all) == dense``: ``triton_sparse`` / ``triton_sparse_ragged`` with top-k covering every visible
  position against the dense absorbed decode.

How close is close enough: the two formulations round their bf16 inputs at different points (MHA gets
bf16 ``k_nope``, the absorbed path a bf16 absorbed query), so even their float64 references differ. Each
metric's bound is that inherent difference (the float64 references of both sides, compared the same way)
plus twice the dtype's kernel bound (cos_diff four times): two sides each within the kernel bound of their
reference. Both numbers are reported (``pair.*`` and ``inherent.*``); the references are computed before the sides
run, so a side that writes into its inputs cannot widen the bound by the error it makes. Each side is also held to
its own float64 reference, since two sides sharing a bug agree: NaN/Inf where the reference has none, an lse in
another base than its capabilities declare (each impl's lse is read in its declared convention). A failure names
the two sides and the row (token, request, head) where they differ most; an out or lse of the wrong shape fails its
check, an out not in the problem's dtype is an error.

``--impl`` selects the comparisons filed under the impls it names (each has one, so a run with ``--isolate``, one
worker an impl, makes each once). Shapes: the ``tiny`` preset with short requests on CPU (Triton interpreter);
serving-size shapes on a GPU (``--preset`` picks the model, default DeepSeek V3 under TP8).
"""

from __future__ import annotations

import bisect
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch

from impls.triton.dcp import run_dcp
from mla_bench.compare import LN2, ErrorMetrics, compare, normalize_lse
from mla_bench.errors import UnsupportedConfig, reraise_interrupt
from mla_bench.metadata.reference import cumulative
from mla_bench.problem import Problem, build_problem
from mla_bench.registry import ImplNotInstalled, discover
from mla_bench.results import Result
from mla_bench.tolerances import Tolerance, tolerance_for
from mla_bench.workload import Mode, Workload
from reference.expected import expected
from suites.base import RunContext, refusal
from suites.judge import check_outputs

SUITE = "equivalence"
DENSE_DECODE_IMPLS = ("triton_decode", "torch_eager")
Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Shapes:
    """Request mixes per check (q_lens, kv_lens), and the page size."""

    preset: str
    page_size: int
    absorbed: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    chunked: tuple[tuple[int, ...], tuple[int, ...]]
    dcp: tuple[tuple[int, ...], tuple[int, ...]]
    sparse: tuple[tuple[int, ...], tuple[int, ...]]


CPU_SHAPES = Shapes("tiny", 8, absorbed=(((1, 1, 1), (9, 24, 3)), ((3, 1, 4), (20, 7, 4))),
                    chunked=((4, 6, 2), (29, 6, 17)), dcp=((1, 2, 1, 1), (21, 30, 1, 0)),
                    sparse=((1, 1, 2), (20, 9, 13)))
GPU_SHAPES = Shapes("deepseek-v3-tp8", 64, absorbed=(((1,) * 32, (4096,) * 32), ((4, 1, 2), (2048, 777, 4096))),
                    chunked=((512, 1024, 256), (8192, 1024, 4096)), dcp=((1,) * 16, (8192,) * 14 + (1, 0)),
                    sparse=((1,) * 8 + (3,), (2048,) * 8 + (1500,)))


@dataclass
class Side:
    """One way of computing: ``run`` gives ``(out, lse)`` on ``problem``; ``post`` maps an output (the impl's, or
    the float64 reference's) into the space both sides are compared in; ``refuse`` raises UnsupportedConfig where the
    side's impl declines a problem by its declared capabilities, asked before any reference is computed."""

    name: str
    problem: Problem
    run: Callable[[Problem], Pair]
    post: Callable[[torch.Tensor, Problem], torch.Tensor] = lambda out, problem: out
    refuse: Callable[[Problem], None] = lambda problem: None

    def result(self) -> Pair:
        out, lse = check_outputs(self.run(self.problem), self.problem)
        return self.post(out.double(), self.problem), lse.double()

    def reference(self) -> Pair:
        ref = expected(self.problem)
        return self.post(ref.out, self.problem), ref.lse


def pair_tolerance(dtype: str, inherent: ErrorMetrics) -> Tolerance:
    """Twice the kernel bound (cos_diff four times) on top of what the float64 references already differ by."""
    k = tolerance_for(dtype, "bf16")
    return Tolerance(rel_l2=2 * k.rel_l2 + inherent.rel_l2, max_row_rel=2 * k.max_row_rel + inherent.max_row_rel,
                     cos_diff=4 * k.cos_diff + inherent.cos_diff, lse_abs=2 * k.lse_abs + inherent.lse_max_abs)


@dataclass(frozen=True)
class Comparison:
    """One Result of the suite: ``check`` filed under ``impl`` (the impl it tests, which ``--impl`` names to select
    it) and ``workload``, whose other side runs ``other``. ``dense``: the absorbed decode of ``absorbed == mha`` (None:
    ours when registered, else the torch baseline)."""

    check: str
    impl: str
    workload: Workload
    other: Workload
    dense: str | None = None


class EquivalenceSuite:
    name = SUITE
    # --impl picks the comparisons filed under the impls it names; the checks bring their own shapes.
    unapplied_filters = ("modes", "layouts", "page_sizes", "sweep", "dcp_world")

    def __init__(self, dcp_worlds: tuple[int, ...] = (2, 3), dcp_interleaves: tuple[int, ...] = (1, 2),
                 mccs: tuple[int, ...] | None = None) -> None:
        """``mccs``: the chunk sizes of the chunked check (None: the defaults); empty ``dcp_worlds`` or
        ``dcp_interleaves`` leave the DCP check out. ValueError names a bad value before anything runs."""
        given = f"EquivalenceSuite(dcp_worlds={dcp_worlds!r}, dcp_interleaves={dcp_interleaves!r}, mccs={mccs!r})"
        for name, values in (("dcp_worlds", dcp_worlds), ("dcp_interleaves", dcp_interleaves), ("mccs", mccs or ())):
            if not isinstance(values, (tuple, list)) or not all(type(v) is int for v in values):
                raise ValueError(f"{given}: {name} must be a tuple of ints")
        self.dcp_worlds = tuple(dcp_worlds)
        self.dcp_interleaves = tuple(dcp_interleaves)
        self.mccs = mccs
        if mccs is not None and not mccs:
            raise ValueError(f"{given}: mccs is empty; give chunk sizes, or None for the defaults")
        if 1 in self.dcp_worlds:
            raise ValueError(f"{given}: W=1 is the single-rank side itself; DCP worlds start at 2")
        try:  # the workloads check every value (the CPU shapes stand in for the device's)
            self._chunked_vs_unchunked(CPU_SHAPES, 0)
            self._dcp_vs_single_rank(CPU_SHAPES, 0)
        except ValueError as exc:
            raise ValueError(f"{given}: {exc}") from None

    def workloads(self, ctx: RunContext) -> list[Comparison]:
        """The comparisons ``run`` makes: those of the checks whose impls are named (all when none is)."""
        shapes = CPU_SHAPES if ctx.device.type == "cpu" else GPU_SHAPES
        if ctx.preset:
            shapes = replace(shapes, preset=ctx.preset)
        every = [*self._absorbed_vs_mha(shapes, ctx.seed), *self._chunked_vs_unchunked(shapes, ctx.seed),
                 *self._dcp_vs_single_rank(shapes, ctx.seed), *self._sparse_vs_dense(shapes, ctx.seed)]
        wanted = {entry.name for entry in ctx.impls}
        # one owner a comparison: each runs once, also when --isolate gives every impl a worker of its own
        return [c for c in every if c.impl in wanted] if wanted else [c for c in every if c.dense is None]

    def run(self, ctx: RunContext) -> Iterator[Result]:
        memo: dict[tuple, Pair] = {}
        for comparison in self.workloads(ctx):
            ctx.progress(f"{SUITE}: {comparison.check} {comparison.workload.label}")
            yield _compare(comparison, ctx.device, memo)

    # ---- comparisons --------------------------------------------------------------------------------------------
    def _absorbed_vs_mha(self, shapes: Shapes, seed: int) -> list[Comparison]:
        """Filed under ``triton_prefill`` (the MHA side) against the default dense decode, and under each dense
        decode impl, which is then the absorbed side (what ``--impl torch_eager`` asks for)."""
        common = dict(preset=shapes.preset, page_size=shapes.page_size, seed=seed)
        return [Comparison("absorbed == mha", owner, Workload(Mode.DECODE, q_lens, kv_lens, **common),
                           Workload(Mode.PREFILL, q_lens, kv_lens, **common), dense)
                for owner, dense in (("triton_prefill", None), *((name, name) for name in DENSE_DECODE_IMPLS))
                for q_lens, kv_lens in shapes.absorbed]

    def _chunked_vs_unchunked(self, shapes: Shapes, seed: int) -> list[Comparison]:
        q_lens, kv_lens = shapes.chunked
        total, page = sum(kv - q for q, kv in zip(q_lens, kv_lens)), shapes.page_size
        mccs = self.mccs or sorted({1 if total < 64 else page // 2, page - 1, page + 1, total})
        common = dict(preset=shapes.preset, page_size=page, seed=seed)
        prefill = Workload(Mode.PREFILL, q_lens, kv_lens, **common)
        return [Comparison("chunked == unchunked", "triton_chunked_prefill",
                           Workload(Mode.CHUNKED_PREFILL, q_lens, kv_lens, chunk_size=mcc, **common), prefill)
                for mcc in mccs]

    def _dcp_vs_single_rank(self, shapes: Shapes, seed: int) -> list[Comparison]:
        q_lens, kv_lens = shapes.dcp
        out = []
        for world in self.dcp_worlds:
            for interleave in self.dcp_interleaves:
                w = Workload(Mode.DCP, q_lens, kv_lens, preset=shapes.preset, page_size=shapes.page_size,
                             dcp_world=world, dcp_interleave=interleave, seed=seed)
                out.append(Comparison("dcp == single rank", "triton_dcp", w, w.replace(dcp_world=1, dcp_interleave=1)))
        return out

    def _sparse_vs_dense(self, shapes: Shapes, seed: int) -> list[Comparison]:
        q_lens, kv_lens = shapes.sparse
        common = dict(preset=shapes.preset, page_size=shapes.page_size, seed=seed)
        decode = Workload(Mode.DECODE, q_lens, kv_lens, **common)
        mode = Mode.SPARSE_DECODE if max(q_lens) == 1 else Mode.SPARSE_PREFILL
        return [Comparison("sparse(all) == dense", impl, Workload(mode, q_lens, kv_lens, topk=max(kv_lens),
                                                                  index_transform=transform, **common), decode)
                for impl, transform in (("triton_sparse", "paged"), ("triton_sparse_ragged", "ragged"))]


def _compare(c: Comparison, device: torch.device, memo: dict[tuple, Pair]) -> Result:
    """The Result of one comparison (a DCP check over more ranks than GPUs is ``unsupported``)."""
    world = c.workload.dcp_world
    if c.check == "dcp == single rank" and device.type == "cuda" and torch.cuda.device_count() < world:
        return Result(SUITE, c.check, "unsupported", c.impl, c.workload.to_dict(), c.workload.label,
                      message=f"W={world} needs {world} GPUs, {torch.cuda.device_count()} visible")
    return _paired(c.check, c.workload, c.impl, lambda: _sides(c, device), memo)


def _sides(c: Comparison, device: torch.device) -> tuple[Side, Side]:
    """The two sides of ``c`` in the order they are compared (built when the comparison runs: building may raise)."""
    mine, other = build_problem(c.workload, device), build_problem(c.other, device)
    if c.check == "absorbed == mha":  # filed under the decode workload, with MHA's prefill as the first side
        dense = c.dense or _dense_decode_impl()
        return _impl_side("triton_prefill", other), _impl_side(dense, mine, post=_up_project)
    if c.check == "dcp == single rank":
        return (Side(f"triton_dcp W={c.workload.dcp_world}", mine, _dcp_runner()),
                Side("triton_dcp W=1", other, _dcp_runner()))
    reference = "triton_prefill" if c.check == "chunked == unchunked" else _dense_decode_impl()
    return _impl_side(c.impl, mine), _impl_side(reference, other)


def _impl_side(name: str, problem: Problem, **fields: Any) -> Side:
    """A side the registered impl ``name`` runs (``fields``: Side's others, as ``post``), refused by its
    capabilities before any reference is computed."""
    return Side(name, problem, _impl_runner(name), refuse=lambda p: discover()[name].load().refuse_undeclared(p),
                **fields)


def _up_project(latent: torch.Tensor, problem: Problem) -> torch.Tensor:
    """An absorbed output ``[T, H, 512]`` in MHA's value space ``[T, H, 128]``: ``out @ W_UV`` per head."""
    return torch.einsum("thc,hcd->thd", latent.double(), problem.w_uv.double())


def _dense_decode_impl() -> str:
    """The absorbed dense decode to compare against: ours when registered, else the torch baseline."""
    known = discover()
    for name in DENSE_DECODE_IMPLS:
        if name in known:
            try:
                known[name].load()
            except ImplNotInstalled:
                continue
            return name
    raise ImplNotInstalled(f"none of {DENSE_DECODE_IMPLS} is available")


def _impl_runner(name: str) -> Callable[[Problem], Pair]:
    """Runs the registered impl ``name``; its lse is read in the convention its capabilities declare."""
    def run(problem: Problem) -> Pair:
        impl = discover()[name].load()
        out, lse = impl.run(impl.plan(problem))
        if problem.device.type == "cuda":
            torch.cuda.synchronize(problem.device)
        return out, normalize_lse(lse, impl.capabilities.lse_base, impl.capabilities.empty_lse)
    return run


def _dcp_runner() -> Callable[[Problem], Pair]:
    def run(problem: Problem) -> Pair:
        outcome = run_dcp(problem)
        return outcome.out.to(problem.device), outcome.lse.to(problem.device)
    return run


def _paired(check: str, workload: Workload, impl: str, make_sides: Callable[[], tuple[Side, Side]],
            memo: dict[tuple, Pair]) -> Result:
    """Ask both sides' capabilities, compute their references, then run the sides, and judge the difference; a
    refusal (by capabilities or by plan) is ``unsupported``, a crash (``sys.exit`` too) or an ``(out, lse)`` that
    ``check_outputs`` refuses (``out`` not in the problem's dtype) ``error``. ``memo`` keeps results of a side
    shared by several checks, keyed by side, workload and ``post`` (the dense decode is up-projected in one check
    and compared as it is in another)."""
    def cached(key: tuple, compute: Callable[[], Pair]) -> Pair:
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    try:
        a, b = make_sides()
        for s in (a, b):  # a refusal its capabilities give needs no reference (minutes each at serving shapes)
            s.refuse(s.problem)
        # references first: what a side writes into its problem's inputs cannot move its reference, nor the bound
        refs = [cached(("ref", s.name, s.post, s.problem.workload.key), s.reference) for s in (a, b)]
        results = [cached((s.name, s.post, s.problem.workload.key), s.result) for s in (a, b)]
    except UnsupportedConfig as exc:
        status, message = refusal(exc)
        return Result(SUITE, check, status, impl, workload.to_dict(), workload.label, message=message)
    except BaseException as exc:  # noqa: BLE001 - one side's crash (sys.exit too) is this check's result
        reraise_interrupt(exc)
        return Result(SUITE, check, "error", impl, workload.to_dict(), workload.label,
                      message=traceback.format_exc())
    try:
        own = [_own_findings(side, result, ref) for side, result, ref in zip((a, b), results, refs)]
        pair, inherent = compare(*results[0], *results[1]), compare(*refs[0], *refs[1])
    except ValueError as exc:  # out or lse of a shape the other side (or its own reference) does not have
        return Result(SUITE, check, "failed", impl, workload.to_dict(), workload.label,
                      details={"sides": [a.name, b.name]}, message=f"{a.name} vs {b.name}: {exc}")
    tolerance = pair_tolerance(workload.dtype, inherent)
    violations = tolerance.violations(pair)
    if violations:
        out_broken = any(not v.startswith("lse_max_abs") for v in violations)
        violations = [f"{a.name} vs {b.name}: {'; '.join(violations)}; "
                      f"{_worst_row(*results[0], *results[1], a.problem, out_broken)}"]
    violations += [finding for findings in own for finding in findings]
    metrics = {f"pair.{k}": v for k, v in pair.to_dict().items()}
    metrics.update({f"inherent.{k}": v for k, v in inherent.to_dict().items()})
    return Result(SUITE, check, "failed" if violations else "passed", impl, workload.to_dict(), workload.label,
                  metrics=metrics, details={"sides": [a.name, b.name], "tolerance": {"pair": tolerance.to_dict()}},
                  message="; ".join(violations))


def _own_findings(side: Side, result: Pair, ref: Pair) -> list[str]:
    """What one side gets wrong against its own float64 reference whatever the other side does: NaN/Inf where the
    reference has none (both sides may share the bug and agree), and an lse in another base than declared.
    ValueError (naming the side) for an out or lse shaped unlike the reference."""
    try:
        own = compare(*result, *ref)
    except ValueError as exc:
        raise ValueError(f"{side.name}'s {exc}") from None
    findings = [f"{side.name}: {own.nonfinite_mismatch} NaN/Inf positions differ from its float64 reference"] \
        if own.nonfinite_mismatch else []
    lse, ref_lse = result[1], ref[1]
    live = torch.isfinite(lse) & torch.isfinite(ref_lse)
    close = lambda factor: bool(live.any()) and torch.allclose(lse[live], ref_lse[live] * factor,  # noqa: E731
                                                              rtol=1e-2, atol=2e-2)
    if close(1.0):
        return findings  # lses near 0 are close to their reference in any base: only a wrong base is a finding
    for factor, what in ((1 / LN2, "base 2 read as natural log"), (LN2, "natural log read as base 2")):
        if close(factor):
            findings.append(f"{side.name}: its lse is its reference's times {factor:.4f}, a {what} "
                            f"(the lse base its capabilities declare is not the one it returns)")
    return findings


def _worst_row(out: torch.Tensor, lse: torch.Tensor, other_out: torch.Tensor, other_lse: torch.Tensor,
               problem: Problem, by_output: bool) -> str:
    """Where two sides differ most (by output relative to the second, else by lse): token, request, query, head."""
    if by_output:
        error = (out - other_out).norm(dim=-1) / other_out.norm(dim=-1).clamp_min(1e-30)
    else:
        error = torch.where(lse == other_lse, 0.0, (lse - other_lse).abs())  # equal infinities agree
    token, head = divmod(int(error.nan_to_num(nan=float("inf")).flatten().argmax()), out.shape[1])
    starts = cumulative(list(problem.meta.q_lens))
    request = bisect.bisect_right(starts, token) - 1
    return (f"worst {'output' if by_output else 'lse'} row: token {token} (request {request}, query "
            f"{token - starts[request]} of {problem.meta.q_lens[request]}), head {head}")
