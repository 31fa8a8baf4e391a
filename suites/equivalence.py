"""Equivalence suite: our Triton paths computing the same function two ways must agree.

Checks (one Result per pair of sides):

- ``absorbed == mha``: the absorbed decode (``triton_decode`` when registered, else ``torch_eager``) up-projected
  with W_UV, against ``triton_prefill`` on the same tokens (workloads that differ only in mode, with the same
  page size and seed, draw the same q, latent and weights: the block table is drawn first, from the page size);
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
reference. Both numbers are reported (``pair.*`` and ``inherent.*``).

Shapes: the ``tiny`` preset with short requests on CPU (Triton interpreter); serving-size shapes on a GPU
(``--preset`` picks the model, default DeepSeek V3 under TP8).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch

from impls.triton.dcp import run_dcp
from mla_bench.compare import ErrorMetrics, compare
from mla_bench.errors import UnsupportedConfig
from mla_bench.problem import Problem, build_problem
from mla_bench.registry import ImplNotInstalled, discover
from mla_bench.results import Result
from mla_bench.tolerances import Tolerance, tolerance_for
from mla_bench.workload import Mode, Workload
from reference.expected import expected
from suites.base import RunContext

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
                    chunked=((512, 1024, 256), (8192, 1024, 4096)), dcp=((1,) * 16, (8192,) * 15 + (1,)),
                    sparse=((1,) * 8 + (3,), (2048,) * 8 + (1500,)))


@dataclass
class Side:
    """One way of computing: ``run`` gives ``(out, lse)`` on ``problem``; ``post`` maps an output (the impl's, or
    the float64 reference's) into the space both sides are compared in."""

    name: str
    problem: Problem
    run: Callable[[Problem], Pair]
    post: Callable[[torch.Tensor, Problem], torch.Tensor] = lambda out, problem: out

    def result(self) -> Pair:
        out, lse = self.run(self.problem)
        return self.post(out.double(), self.problem), lse.double()

    def reference(self) -> Pair:
        ref = expected(self.problem)
        return self.post(ref.out, self.problem), ref.lse


def pair_tolerance(dtype: str, inherent: ErrorMetrics) -> Tolerance:
    """Twice the kernel bound (cos_diff four times) on top of what the float64 references already differ by."""
    k = tolerance_for(dtype, "bf16")
    return Tolerance(rel_l2=2 * k.rel_l2 + inherent.rel_l2, max_row_rel=2 * k.max_row_rel + inherent.max_row_rel,
                     cos_diff=4 * k.cos_diff + inherent.cos_diff, lse_abs=2 * k.lse_abs + inherent.lse_max_abs)


class EquivalenceSuite:
    name = SUITE

    def __init__(self, dcp_worlds: tuple[int, ...] = (2, 3), dcp_interleaves: tuple[int, ...] = (1, 2),
                 mccs: tuple[int, ...] | None = None) -> None:
        self.dcp_worlds = dcp_worlds
        self.dcp_interleaves = dcp_interleaves
        self.mccs = mccs

    def run(self, ctx: RunContext) -> Iterator[Result]:
        shapes = CPU_SHAPES if ctx.device.type == "cpu" else GPU_SHAPES
        if ctx.preset:
            shapes = replace(shapes, preset=ctx.preset)
        wanted = {entry.name for entry in ctx.impls}
        memo: dict[str, Pair] = {}
        checks: list[tuple[set[str], Callable[[], Iterator[Result]]]] = [
            ({"triton_prefill", *DENSE_DECODE_IMPLS}, lambda: self._absorbed_vs_mha(ctx, shapes, memo)),
            ({"triton_chunked_prefill", "triton_prefill"}, lambda: self._chunked_vs_unchunked(ctx, shapes, memo)),
            ({"triton_dcp"}, lambda: self._dcp_vs_single_rank(ctx, shapes, memo)),
            ({"triton_sparse", "triton_sparse_ragged"}, lambda: self._sparse_vs_dense(ctx, shapes, memo)),
        ]
        for impls, check in checks:
            if not wanted or wanted & impls:
                yield from check()

    # ---- checks -------------------------------------------------------------------------------------------------
    def _absorbed_vs_mha(self, ctx: RunContext, shapes: Shapes, memo: dict) -> Iterator[Result]:
        for q_lens, kv_lens in shapes.absorbed:
            common = dict(preset=shapes.preset, page_size=shapes.page_size, seed=ctx.seed)
            decode = Workload(Mode.DECODE, q_lens, kv_lens, **common)
            prefill = Workload(Mode.PREFILL, q_lens, kv_lens, **common)
            ctx.progress(f"{SUITE}: absorbed == mha {decode.label}")
            yield _paired("absorbed == mha", decode, "triton_prefill", lambda decode=decode, prefill=prefill: (
                Side("triton_prefill", build_problem(prefill, ctx.device), _impl_runner("triton_prefill")),
                Side(_dense_decode_impl(), build_problem(decode, ctx.device), _impl_runner(_dense_decode_impl()),
                     _up_project)), memo)

    def _chunked_vs_unchunked(self, ctx: RunContext, shapes: Shapes, memo: dict) -> Iterator[Result]:
        q_lens, kv_lens = shapes.chunked
        total, page = sum(kv - q for q, kv in zip(q_lens, kv_lens)), shapes.page_size
        mccs = self.mccs or sorted({1 if total < 64 else page // 2, page - 1, page + 1, total})
        common = dict(preset=shapes.preset, page_size=page, seed=ctx.seed)
        prefill = Workload(Mode.PREFILL, q_lens, kv_lens, **common)
        for mcc in mccs:
            chunked = Workload(Mode.CHUNKED_PREFILL, q_lens, kv_lens, chunk_size=mcc, **common)
            ctx.progress(f"{SUITE}: chunked == unchunked {chunked.label}")
            yield _paired("chunked == unchunked", chunked, "triton_chunked_prefill", lambda chunked=chunked: (
                Side("triton_chunked_prefill", build_problem(chunked, ctx.device),
                     _impl_runner("triton_chunked_prefill")),
                Side("triton_prefill", build_problem(prefill, ctx.device), _impl_runner("triton_prefill"))), memo)

    def _dcp_vs_single_rank(self, ctx: RunContext, shapes: Shapes, memo: dict) -> Iterator[Result]:
        q_lens, kv_lens = shapes.dcp
        for world in self.dcp_worlds:
            for interleave in self.dcp_interleaves:
                w = Workload(Mode.DCP, q_lens, kv_lens, preset=shapes.preset, page_size=shapes.page_size,
                             dcp_world=world, dcp_interleave=interleave, seed=ctx.seed)
                ctx.progress(f"{SUITE}: dcp == single rank {w.label}")
                if ctx.device.type == "cuda" and torch.cuda.device_count() < world:
                    yield Result(SUITE, "dcp == single rank", "unsupported", "triton_dcp", w.to_dict(), w.label,
                                 message=f"W={world} needs {world} GPUs, {torch.cuda.device_count()} visible")
                    continue
                yield _paired("dcp == single rank", w, "triton_dcp", lambda w=w: (
                    Side(f"triton_dcp W={w.dcp_world}", build_problem(w, ctx.device), _dcp_runner()),
                    Side("triton_dcp W=1", build_problem(w.replace(dcp_world=1, dcp_interleave=1), ctx.device),
                         _dcp_runner())), memo)

    def _sparse_vs_dense(self, ctx: RunContext, shapes: Shapes, memo: dict) -> Iterator[Result]:
        q_lens, kv_lens = shapes.sparse
        common = dict(preset=shapes.preset, page_size=shapes.page_size, seed=ctx.seed)
        decode = Workload(Mode.DECODE, q_lens, kv_lens, **common)
        mode = Mode.SPARSE_DECODE if max(q_lens) == 1 else Mode.SPARSE_PREFILL
        for impl, transform in (("triton_sparse", "paged"), ("triton_sparse_ragged", "ragged")):
            sparse = Workload(mode, q_lens, kv_lens, topk=max(kv_lens), index_transform=transform, **common)
            ctx.progress(f"{SUITE}: sparse(all) == dense {sparse.label}")
            yield _paired("sparse(all) == dense", sparse, impl, lambda sparse=sparse, impl=impl: (
                Side(impl, build_problem(sparse, ctx.device), _impl_runner(impl)),
                Side(_dense_decode_impl(), build_problem(decode, ctx.device), _impl_runner(_dense_decode_impl()))),
                memo)


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
    def run(problem: Problem) -> Pair:
        impl = discover()[name].load()
        out, lse = impl.run(impl.plan(problem))
        if problem.device.type == "cuda":
            torch.cuda.synchronize(problem.device)
        return out, lse
    return run


def _dcp_runner() -> Callable[[Problem], Pair]:
    def run(problem: Problem) -> Pair:
        outcome = run_dcp(problem)
        return outcome.out.to(problem.device), outcome.lse.to(problem.device)
    return run


def _paired(check: str, workload: Workload, impl: str, make_sides: Callable[[], tuple[Side, Side]],
            memo: dict[str, Pair]) -> Result:
    """Run both sides and their references and judge the difference; a refusal is ``unsupported``, a crash
    ``error``. ``memo`` keeps results of a side shared by several checks (keyed by side and workload)."""
    def cached(key: str, compute: Callable[[], Pair]) -> Pair:
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    try:
        a, b = make_sides()
        results = [cached(f"{s.name}|{s.problem.workload.key}", s.result) for s in (a, b)]
        refs = [cached(f"ref|{s.name}|{s.problem.workload.key}", s.reference) for s in (a, b)]
    except UnsupportedConfig as exc:
        return Result(SUITE, check, "unsupported", impl, workload.to_dict(), workload.label, message=str(exc))
    except Exception:  # noqa: BLE001 - one side's crash is this check's result, not the suite's end
        return Result(SUITE, check, "error", impl, workload.to_dict(), workload.label,
                      message=traceback.format_exc())
    pair = compare(*results[0], *results[1])
    inherent = compare(*refs[0], *refs[1])
    tolerance = pair_tolerance(workload.dtype, inherent)
    violations = tolerance.violations(pair)
    metrics = {f"pair.{k}": v for k, v in pair.to_dict().items()}
    metrics.update({f"inherent.{k}": v for k, v in inherent.to_dict().items()})
    return Result(SUITE, check, "failed" if violations else "passed", impl, workload.to_dict(), workload.label,
                  metrics=metrics, details={"sides": [a.name, b.name], "tolerance": tolerance.to_dict()},
                  message="; ".join(violations))
