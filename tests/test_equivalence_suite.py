"""The equivalence suite (CPU: interpreter, tiny shapes; GPU: full shapes): every check passes for our impls,
and fails for planted bugs (a chunk dropped or merged twice, an lse base mixed up, a causal offset missed, a DCP
combine that gives NaN), each naming the problem; bad inputs give clear results or errors."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import impls.triton  # noqa: F401
import suites.equivalence
from impls.triton import chunked
from impls.triton.chunked import TritonChunkedPrefill
from impls.triton.dcp.attention import TorchShardAttention
from impls.triton.dcp.launch import DcpOutcome
from impls.triton.dcp.shard import build_shard
from impls.triton.merge import LOG2E, rescale_partial
from mla_bench.registry import ImplEntry, discover
from mla_bench.results import Result
from suites.base import RunContext
from suites.equivalence import EquivalenceSuite


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # tiny shapes on CPU, full ones on a GPU


def run_suite(impls=(), **kw) -> list[Result]:
    ctx = RunContext(impls=[discover()[name] for name in impls], device=DEVICE)
    return list(EquivalenceSuite(**kw).run(ctx))


def plant(monkeypatch, cls) -> None:
    """Make the suite load ``cls`` under its name (a planted bug in place of the registered impl)."""
    real = discover()
    monkeypatch.setattr("suites.equivalence.discover", lambda: {**real, cls.name: ImplEntry(cls.name, "planted",
                                                                                             "path", cls)})


def chunked_result(monkeypatch, cls=TritonChunkedPrefill, mcc=7) -> Result:
    plant(monkeypatch, cls)
    (result,) = run_suite(impls=("triton_chunked_prefill",), mccs=(mcc,))
    return result


def test_every_equivalence_holds_on_cpu():
    results = run_suite(dcp_worlds=(2,), dcp_interleaves=(2,))
    checks = {r.check for r in results}
    assert checks == {"absorbed == mha", "chunked == unchunked", "dcp == single rank", "sparse(all) == dense"}
    # on the CPU the DCP ranks are gloo processes: every check must pass; on a GPU host W needs W GPUs, and with
    # fewer the DCP check is unsupported, saying so
    too_few_gpus = DEVICE.type == "cuda" and torch.cuda.device_count() < 2
    bad = [(r.check, r.label, r.message) for r in results if r.status != "passed"
           and not (too_few_gpus and r.check == "dcp == single rank" and r.status == "unsupported"
                    and "W=2 needs 2 GPUs" in r.message)]
    assert not bad, bad
    for r in results:
        assert r.suite == "equivalence" and r.metrics.get("pair.nonfinite_mismatch", 0) == 0
        Result.from_dict(r.to_dict())  # JSON-safe
    assert sum(r.check == "chunked == unchunked" for r in results) >= 4


def test_the_impl_filter_selects_checks():
    results = run_suite(impls=("triton_sparse",))
    assert {r.check for r in results} == {"sparse(all) == dense"} and all(r.status == "passed" for r in results)


def test_a_named_dense_decode_is_the_absorbed_side_filed_under_it():
    """``--impl torch_eager`` ran the check against triton_decode, filed under triton_prefill: torch_eager never ran
    and the run passed."""
    results = run_suite(impls=("torch_eager",))
    assert {(r.check, r.impl) for r in results} == {("absorbed == mha", "torch_eager")}
    assert all(r.status == "passed" and "torch_eager" in r.details["sides"] for r in results), \
        [(r.status, r.details) for r in results]


def test_each_comparison_runs_in_one_impls_selection_only():
    """With --isolate each impl's worker runs the comparisons it selects: triton_prefill's, triton_decode's and
    torch_eager's workers each filed 'absorbed == mha' under triton_prefill, a duplicate the gate refuses."""
    suite = EquivalenceSuite(dcp_worlds=(2,), dcp_interleaves=(1,))
    keys = [(c.check, c.impl, c.workload) for name in discover()
            for c in suite.workloads(RunContext(impls=[discover()[name]], device=DEVICE))]
    assert len(keys) == len(set(keys))
    assert len(suite.workloads(RunContext(impls=[], device=DEVICE))) == \
        len([key for key in keys if key[1] not in ("triton_decode", "torch_eager")])


def test_a_dense_decode_shared_by_two_checks_is_up_projected_only_where_its_check_asks(monkeypatch):
    """The memo kept a side's result by name and workload only: where the sparse check's mix was one of the absorbed
    check's, the sparse check got the dense decode's output up-projected to [T, H, 128] and failed on its shape."""
    name = "CPU_SHAPES" if DEVICE.type == "cpu" else "GPU_SHAPES"
    shapes = getattr(suites.equivalence, name)
    monkeypatch.setattr(suites.equivalence, name,
                        dataclasses.replace(shapes, absorbed=shapes.absorbed[:1], sparse=shapes.absorbed[0]))
    results = run_suite(impls=("triton_prefill", "triton_sparse"), dcp_worlds=())
    assert sorted(r.check for r in results) == ["absorbed == mha", "sparse(all) == dense"]
    assert all(r.status == "passed" for r in results), [(r.check, r.message) for r in results]


# ---- planted bugs the suite must flag, each naming the problem ----------------------------------------------------
class DropsTheLastChunk(TritonChunkedPrefill):
    name = "triton_chunked_prefill"

    def plan(self, problem):
        plan = super().plan(problem)
        plan.chunks = plan.chunks[:-1]
        return plan


class CountsAChunkTwice(TritonChunkedPrefill):
    name = "triton_chunked_prefill"

    def plan(self, problem):
        plan = super().plan(problem)
        plan.chunks = plan.chunks + plan.chunks[-1:]
        return plan


@pytest.mark.parametrize("bug", [DropsTheLastChunk, CountsAChunkTwice])
def test_a_chunk_dropped_or_merged_twice_is_flagged_at_the_request_it_belongs_to(monkeypatch, bug):
    """With MCC 7 the last chunk is the tail of request 2 (CPU and GPU shapes alike): the worst row is there."""
    result = chunked_result(monkeypatch, bug)
    assert result.check == "chunked == unchunked" and result.status == "failed"
    assert "triton_chunked_prefill vs triton_prefill: " in result.message
    assert re.search(r"worst output row: token \d+ \(request 2,", result.message), result.message


def patch_chunk_kernel(monkeypatch, planted) -> None:
    """Route the chunked impl's context-chunk attention (its non-causal kernel calls) through
    ``planted(kernel, *args, **kwargs)``."""
    real = chunked.mha_prefill
    monkeypatch.setattr(chunked, "mha_prefill", lambda *args, **kwargs: real(*args, **kwargs)
                        if kwargs.get("causal", True) else planted(real, *args, **kwargs))


def base2_lse(kernel, *args, **kwargs):
    out, lse = kernel(*args, **kwargs)
    return out, lse.mul_(LOG2E)


def test_chunk_partials_merged_with_a_base_2_lse_are_flagged(monkeypatch):
    """Planted bug: the chunk kernel returns a base-2 lse (FlashInfer's default) and the merge takes it as natural."""
    patch_chunk_kernel(monkeypatch, base2_lse)
    result = chunked_result(monkeypatch)
    assert result.status == "failed" and "triton_chunked_prefill vs triton_prefill" in result.message
    assert "worst output row: token" in result.message


def test_a_context_chunk_masked_causally_misses_the_offset_and_is_flagged(monkeypatch):
    """Planted bug: the context chunks get the causal mask, aligned to the chunk's end instead of offset by the new
    tokens after it, so early queries lose context keys every query should see."""
    patch_chunk_kernel(monkeypatch, lambda kernel, *args, **kwargs: kernel(*args, **{**kwargs, "causal": True}))
    result = chunked_result(monkeypatch)
    assert result.status == "failed" and "worst output row: token" in result.message


class LseHeadsFirst(TritonChunkedPrefill):
    """Planted bug: returns lse ``[heads, tokens]`` (the layout vLLM's merge_attn_states takes), not ``[T, H]``."""

    name = "triton_chunked_prefill"

    def run(self, plan):
        out, lse = super().run(plan)
        return out, lse.t()


def test_an_lse_in_the_wrong_layout_fails_its_check_without_ending_the_suite(monkeypatch):
    result = chunked_result(monkeypatch, LseHeadsFirst)
    assert result.status == "failed"
    assert re.search(r"triton_chunked_prefill's lse shape \[\d+, \d+\] differs from the reference's", result.message)


class Base2Lse(TritonChunkedPrefill):
    """Right answers with a base-2 lse (FlashInfer's default), its capabilities saying natural log."""

    name = "triton_chunked_prefill"

    def run(self, plan):
        out, lse = super().run(plan)
        return out, lse * LOG2E


class DeclaresBase2(Base2Lse):
    capabilities = dataclasses.replace(TritonChunkedPrefill.capabilities, lse_base="2")


def test_an_lse_is_read_in_the_base_its_capabilities_declare(monkeypatch):
    result = chunked_result(monkeypatch, DeclaresBase2)
    assert result.status == "passed", result.message


def test_an_lse_in_another_base_than_declared_is_named(monkeypatch):
    result = chunked_result(monkeypatch, Base2Lse)
    assert result.status == "failed"
    assert "triton_chunked_prefill: its lse is its reference's times 1.4427, a base 2 read as natural log" \
        in result.message


class ZeroesItsQuery(TritonChunkedPrefill):
    """Planted bug: zeroes the problem's queries in place and attends with them (uniform weights over the keys)."""

    name = "triton_chunked_prefill"

    def run(self, plan):
        plan.problem.q.zero_()
        return super().run(plan)


def test_a_side_that_writes_into_its_queries_is_flagged(monkeypatch):
    """The references were computed after the runs, on the zeroed queries: the bound took in the whole error (rel_l2
    0.8 both pair and inherent) and the check passed."""
    result = chunked_result(monkeypatch, ZeroesItsQuery)
    assert result.status == "failed" and "triton_chunked_prefill vs triton_prefill" in result.message
    assert result.metrics["inherent.rel_l2"] < 0.05 < result.metrics["pair.rel_l2"], result.metrics


class RefusesThePageSize(TritonChunkedPrefill):
    """Declares page size 1 only: the suite's pages (8 tokens on CPU, 64 on GPU) are out of its capabilities."""

    name = "triton_chunked_prefill"
    capabilities = dataclasses.replace(TritonChunkedPrefill.capabilities, page_sizes=frozenset({1}))


def test_a_side_its_capabilities_refuse_is_unsupported_before_any_reference(monkeypatch):
    """Both sides' float64 references were computed before plan refused (minutes for nothing at 128 heads and long
    contexts); the record is the one plan's refusal gives."""
    computed, real = [], suites.equivalence.expected
    monkeypatch.setattr(suites.equivalence, "expected",
                        lambda problem: computed.append(problem.workload.label) or real(problem))
    result = chunked_result(monkeypatch, RefusesThePageSize)
    assert result.status == "unsupported", result.message
    assert result.message == f"triton_chunked_prefill: unsupported page size {result.workload['page_size']} " \
        f"({result.label})"
    assert computed == [], f"{len(computed)} float64 references computed for a refused side"


class Float32Out(TritonChunkedPrefill):
    """Planted bug: returns its float32 accumulator, not an out in the problem's dtype."""

    name = "triton_chunked_prefill"

    def run(self, plan):
        out, lse = super().run(plan)
        return out.float(), lse


class Exits(TritonChunkedPrefill):
    """Planted bug: calls ``sys.exit`` (as some libraries do on a failure)."""

    name = "triton_chunked_prefill"

    def run(self, plan):
        raise SystemExit(3)


class RaisesGeneratorExit(TritonChunkedPrefill):
    """Planted bug: raises GeneratorExit, a BaseException that is not an Exception nor sys.exit."""

    name = "triton_chunked_prefill"

    def run(self, plan):
        raise GeneratorExit("closed")


@pytest.mark.parametrize("bug, says", [(Float32Out, "ValueError: out is torch.float32"), (Exits, "SystemExit: 3"),
                                       (RaisesGeneratorExit, "GeneratorExit: closed")])
def test_a_side_that_exits_or_returns_another_dtype_is_an_error_of_its_check(monkeypatch, bug, says):
    """A float32 out passed (the comparison is in float64); sys.exit, or GeneratorExit, ended the suite and the
    run."""
    result = chunked_result(monkeypatch, bug)
    assert result.status == "error" and says in result.message, result.message


def naive_rescale(part: torch.Tensor, all_lse: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Planted bug (DCP combine): ``part * exp(lse_r - logsumexp_r lse_r)`` with no guard, so a request that no
    rank holds a token of gets NaN (-inf - -inf) instead of out 0 / lse -inf."""
    total = torch.logsumexp(all_lse, dim=0)
    return part * torch.exp(all_lse[rank] - total)[..., None], total


def dcp_in_process(problem, rescale=naive_rescale) -> DcpOutcome:
    """DCP with its ranks one after another in this process (a test double for ``run_dcp``'s processes): each rank
    attends its shard, the lses are stacked (the all-gather), each partial rescaled and summed (reduce-scatter)."""
    w, attention = problem.workload, TorchShardAttention()
    parts = [attention(problem.q, attention.prepare(build_shard(problem, r, w.dcp_world, w.dcp_interleave),
                                                   problem.scale, problem.q.shape[1])) for r in range(w.dcp_world)]
    all_lse = torch.stack([lse for _, lse in parts])
    scaled = [rescale(out.contiguous(), all_lse, r) for r, (out, _) in enumerate(parts)]
    return DcpOutcome(sum(out for out, _ in scaled).to(problem.q.dtype), scaled[0][1])


def dcp_results(monkeypatch, rescale) -> list[Result]:
    monkeypatch.setattr("suites.equivalence.run_dcp", lambda problem: dcp_in_process(problem, rescale))
    return run_suite(impls=("triton_dcp",), dcp_worlds=(2,), dcp_interleaves=(1,))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU shapes hold an empty request; on GPUs DCP needs W of them")
def test_a_dcp_combine_that_gives_nan_for_an_empty_request_is_flagged_though_both_sides_agree(monkeypatch):
    """Both sides run the same broken combine, so they agree NaN for NaN: each side is held to its own reference."""
    assert all(r.status == "passed" for r in dcp_results(monkeypatch, rescale_partial))  # the double is sound
    (result,) = dcp_results(monkeypatch, naive_rescale)
    assert result.status == "failed", result.metrics
    positions = 4 * 512  # the empty request's one query row: 4 heads of 512
    for side in ("triton_dcp W=2", "triton_dcp W=1"):
        assert f"{side}: {positions} NaN/Inf positions differ from its float64 reference" in result.message


# ---- inputs the suite must survive or refuse clearly -------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(mccs=(0,)), r"mccs=\(0,\)\): chunk_size must be a positive int, got 0"),
    (dict(mccs=()), "mccs is empty"),
    (dict(dcp_worlds=(2, 1)), "W=1 is the single-rank side itself"),
    (dict(dcp_interleaves=(-1,)), "dcp_interleave must be a positive int, got -1"),
    (dict(dcp_worlds=2), "dcp_worlds must be a tuple of ints"),
    (dict(mccs=(64.0,)), "mccs must be a tuple of ints"),
])
def test_bad_suite_options_are_refused_before_anything_runs(kw, message):
    with pytest.raises(ValueError, match=message):
        EquivalenceSuite(**kw)


def test_lses_near_zero_in_the_right_base_are_not_taken_for_another_base():
    """|lse| < 0.05 is within the tolerance of its reference times 1.44 too: only a wrong base is a finding."""
    from types import SimpleNamespace

    from suites.equivalence import _own_findings

    out = torch.randn(6, 4, 128, dtype=torch.float64)
    lse = torch.empty(6, 4, dtype=torch.float64).uniform_(-0.04, 0.04)
    side = SimpleNamespace(name="near_zero")
    assert _own_findings(side, (out, lse), (out, lse)) == []
    wide = lse * 100
    assert "a base 2 read as natural log" in _own_findings(side, (out, wide / 0.6931471805599453), (out, wide))[0]
