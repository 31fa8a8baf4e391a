"""The roundtrip suite end to end on this machine, its capability matrix, and the planted bugs it must flag."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from mla_bench.errors import UnsupportedConfig
from mla_bench.layouts import NOPE_DIM
from mla_bench.layouts.formats import e4m3_encode, f32_bytes
from mla_bench.layouts.fp8 import FP8DSMLALayout
from mla_bench.registry import Capabilities, ImplEntry, discover
from mla_bench.workload import Mode
from impls.torch_eager import TorchEager
from suites.base import RunContext
from suites.capability import capability_table, print_capability_matrix, run_matrix
from suites.roundtrip import RoundtripSuite

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CHECKS = {"codec bounds", "edge inputs", "triton write", "triton gather", "conversions", "paged vs ragged",
          "capability", "capability matrix"}


@pytest.fixture(scope="module")
def results():
    ctx = RunContext(impls=list(discover().values()), device=DEVICE)
    return list(RoundtripSuite().run(ctx))


def test_every_check_passes_for_every_layout(results):
    assert {r.check for r in results} == CHECKS
    assert [f"{r.check} {r.label}: {r.message[:200]}" for r in results if not r.ok] == []
    triton = [r for r in results if r.check.startswith("triton")]
    assert len(triton) == 14 and all(r.status == "passed" for r in triton)
    assert all(r.metrics["mismatched_bytes"] == 0 for r in triton if r.check == "triton write")


def test_results_are_labelled_and_serializable(results):
    for result in results:
        assert result.suite == "roundtrip" and result.label
        assert type(result).from_dict(result.to_dict()) == result


def test_the_capability_matrix_covers_every_layout_and_transform(results):
    summary = next(r for r in results if r.check == "capability matrix")
    details = summary.details
    assert details["columns"] == ["bf16", "fp8_e4m3", "fp8_ds_mla", "fp8_ds_mla_pow2", "fp4_mx16", "mxfp4_nsa",
                                  "nvfp4", "no cache"]
    rows = {(row["impl"], row["op"]): row["cells"] for row in details["rows"]}
    assert rows[("torch_eager", "decode")]["bf16"] == "passed"
    assert rows[("torch_eager", "decode")]["fp8_ds_mla"] == "unsupported"
    assert rows[("torch_eager", "prefill")]["no cache"] == "passed"
    assert ("torch_eager", "sparse_prefill (ragged)") in rows
    out = io.StringIO()
    print_capability_matrix(results, Console(file=out, width=250))
    text = out.getvalue()
    assert "capability matrix" in text and "sparse_decode (paged)" in text and "refused" in text


# ---- planted codec bugs -------------------------------------------------------------------------------------------
class NoScaleFloor(FP8DSMLALayout):
    """SGLang's fast path: tile scale amax / 448 with no floor, so an all-zero tile gets 0/0 = NaN."""

    def __init__(self) -> None:
        super().__init__(pow2=False)
        self.name = "planted_no_scale_floor"

    def _encode(self, x, tensor_scale):
        raw = super()._encode(x, tensor_scale)
        tiles = x[:, :NOPE_DIM].float().reshape(-1, 4, 128)
        scale = tiles.abs().amax(dim=-1) / 448
        codes = e4m3_encode(tiles / scale[..., None]).reshape(-1, NOPE_DIM)
        return torch.cat([codes, f32_bytes(scale), raw[:, NOPE_DIM + 16:]], dim=1)


class TruncatedRope(FP8DSMLALayout):
    """Rope values cut to bfloat16 by dropping the low 16 bits instead of rounding to nearest even."""

    def __init__(self) -> None:
        super().__init__(pow2=False)
        self.name = "planted_truncated_rope"

    def _encode(self, x, tensor_scale):
        raw = super()._encode(x, tensor_scale)
        truncated = (x[:, NOPE_DIM:].float().contiguous().view(torch.int32) >> 16).to(torch.int16)
        return torch.cat([raw[:, :NOPE_DIM + 16], truncated.view(torch.uint8)], dim=1)


@pytest.mark.parametrize("layout, check, says", [
    (NoScaleFloor(), "edge inputs", "all-zero blocks decode to"),
    (TruncatedRope(), "codec bounds", "the stated bound"),
])
def test_planted_codec_bugs_are_flagged(layout, check, says):
    suite = RoundtripSuite(layouts={layout.name: layout}, matrix=False)
    results = list(suite.run(RunContext(impls=[], device=DEVICE, page_sizes=[16])))
    flagged = [r for r in results if r.check == check]
    assert len(flagged) == 1 and flagged[0].status == "failed" and says in flagged[0].message
    # the Triton kernels do not claim a layout they do not implement
    assert {r.status for r in results if r.check.startswith("triton")} == {"unsupported"}


# ---- planted impls: the matrix has no crash cell and no wrong answer ----------------------------------------------
class CrashesOnFP8(TorchEager):
    name = "planted_crash"
    capabilities = Capabilities(modes=frozenset({Mode.DECODE}), layouts=frozenset({"bf16", "fp8_ds_mla"}),
                                dtypes=frozenset({"bfloat16"}))

    def run(self, plan):
        if plan.problem.workload.layout != "bf16":
            raise RuntimeError("illegal memory access")
        return super().run(plan)


class ReturnsZeros(TorchEager):
    name = "planted_zeros"

    def run(self, plan):
        out, lse = super().run(plan)
        return torch.zeros_like(out), lse


class RefusesWithoutSaying(TorchEager):
    name = "planted_mumble"
    capabilities = Capabilities(modes=frozenset(Mode), layouts=frozenset({"bf16"}), dtypes=frozenset({"bfloat16"}))

    def plan(self, problem):
        raise UnsupportedConfig("not supported")


def test_crashes_wrong_answers_and_unnamed_refusals_are_failures():
    entries = [ImplEntry(cls.name, f"tests:{cls.__name__}", "path", cls)
               for cls in (CrashesOnFP8, ReturnsZeros, RefusesWithoutSaying, TorchEager)]
    results = list(run_matrix(entries, ["bf16", "fp8_ds_mla"], DEVICE))
    status = {(r.impl, r.details["row"], r.details["column"]): r.status for r in results if r.check == "capability"}
    assert status[("planted_crash", "decode", "bf16")] == "passed"
    assert status[("planted_crash", "decode", "fp8_ds_mla")] == "error"
    assert status[("planted_crash", "dcp", "fp8_ds_mla")] == "unsupported"
    assert status[("planted_zeros", "decode", "bf16")] == "failed"
    assert status[("planted_mumble", "decode", "bf16")] == "failed"
    assert status[("torch_eager", "decode", "bf16")] == "passed"
    summary = results[-1]
    assert summary.check == "capability matrix" and summary.status == "failed"
    assert "planted_crash: decode / fp8_ds_mla: error" in summary.message
    assert "CRASH" in _render(capability_table(summary.details))


def _render(table) -> str:
    out = io.StringIO()
    Console(file=out, width=250).print(table)
    return out.getvalue()
