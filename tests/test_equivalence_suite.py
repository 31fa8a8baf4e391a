"""The equivalence suite (CPU: interpreter, tiny shapes; GPU: full shapes): every check passes for our impls,
and fails for a planted chunked impl that drops its last chunk."""

from __future__ import annotations

import torch

import impls.triton  # noqa: F401
from impls.triton.chunked import TritonChunkedPrefill
from mla_bench.registry import ImplEntry, discover
from mla_bench.results import Result
from suites.base import RunContext
from suites.equivalence import EquivalenceSuite


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # tiny shapes on CPU, full ones on a GPU


def run_suite(impls=(), **kw) -> list[Result]:
    ctx = RunContext(impls=[discover()[name] for name in impls], device=DEVICE)
    return list(EquivalenceSuite(**kw).run(ctx))


def test_every_equivalence_holds_on_cpu():
    results = run_suite(dcp_worlds=(2,), dcp_interleaves=(2,))
    checks = {r.check for r in results}
    assert checks == {"absorbed == mha", "chunked == unchunked", "dcp == single rank", "sparse(all) == dense"}
    # without W GPUs a DCP check is unsupported (and says so); everything else must pass
    bad = [(r.check, r.label, r.message) for r in results
           if r.status != "passed" and not (r.status == "unsupported" and r.check == "dcp == single rank")]
    assert not bad, bad
    for r in results:
        assert r.suite == "equivalence" and r.metrics.get("pair.nonfinite_mismatch", 0) == 0
        Result.from_dict(r.to_dict())  # JSON-safe
    assert sum(r.check == "chunked == unchunked" for r in results) >= 4


class DropsTheLastChunk(TritonChunkedPrefill):
    name = "triton_chunked_prefill"

    def plan(self, problem):
        plan = super().plan(problem)
        plan.chunks = plan.chunks[:-1]
        return plan


def test_a_chunked_impl_that_drops_a_chunk_breaks_the_equivalence(monkeypatch):
    planted = ImplEntry("triton_chunked_prefill", "planted", "path", DropsTheLastChunk)
    real = discover()
    monkeypatch.setattr("suites.equivalence.discover", lambda: {**real, "triton_chunked_prefill": planted})
    results = run_suite(impls=("triton_chunked_prefill",), mccs=(7,))
    assert [r.check for r in results] == ["chunked == unchunked"]
    assert results[0].status == "failed" and results[0].message  # the broken bounds are named


def test_the_impl_filter_selects_checks():
    results = run_suite(impls=("triton_sparse",))
    assert {r.check for r in results} == {"sparse(all) == dense"} and all(r.status == "passed" for r in results)
