"""The external adapters: absent packages are listed and skipped as not installed; with stand-in packages
(written from the real APIs, in plain torch) each adapter's plumbing (shapes, page lists, lse base and empty-row
conventions) passes the conformance sweep on CPU."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch

from mla_bench.registry import ImplNotInstalled, resolve
from mla_bench.runner import RunOptions, execute
from mla_bench.workload import Workload
from suites import sweeps
from suites.judge import judge

EXTERNAL = ["vllm_triton_mla", "flashinfer_mla", "flashmla", "flashmla_sparse"]
FAKES = Path(__file__).parent / "fake_kernels"


def _installed(name: str) -> bool:
    try:
        resolve(name).load()
    except ImplNotInstalled:
        return False
    return True


@pytest.mark.skipif(any(_installed(n) for n in EXTERNAL), reason="a real external package is installed here")
def test_absent_packages_are_not_installed_and_skipped_with_the_reason(capsys):
    from mla_bench.cli import main

    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    for name in EXTERNAL:
        line = next(line for line in listing.splitlines() if name in line)
        assert "not installed" in line
    run = execute(RunOptions(impls=EXTERNAL, device="cpu", preset="tiny", modes=["decode"]))
    assert sorted((r.impl, r.status) for r in run.results) == sorted((n, "unsupported") for n in EXTERNAL)
    assert all(r.message.startswith("not installed:") for r in run.results) and run.ok


@pytest.fixture
def fake_packages(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES))
    yield
    for name in list(sys.modules):
        if name.split(".")[0] in ("vllm", "flashinfer", "flash_mla") or name.startswith("impls.external."):
            monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.mark.parametrize("name, expect", [("vllm_triton_mla", 6), ("flashinfer_mla", 7), ("flashmla", 5),
                                          ("flashmla_sparse", 6)])  # 64 heads, and 128 once per mode
def test_adapter_plumbing_passes_conformance_on_stand_in_kernels(fake_packages, name, expect):
    impl = resolve(name).load()
    # The adapters declare CUDA only; the stand-ins run anywhere.
    impl.capabilities = dataclasses.replace(impl.capabilities, devices=frozenset({"cpu", "cuda"}))
    from mla_bench.problem import build_problem

    verdicts = []
    for workload in sweeps.conformance(impl.capabilities):
        if impl.capabilities.refusal(workload, "cpu") is None:
            verdicts.append((workload.label, judge(impl, build_problem(workload, "cpu"))))
    bad = [(label, v.status, v.violations or v.message[-400:]) for label, v in verdicts if v.status != "passed"
           and v.status != "unsupported"]
    assert not bad
    assert sum(v.status == "passed" for _, v in verdicts) == expect


def test_flashinfer_lse_base_is_normalized(fake_packages):
    """Declaring the wrong base must fail: the conversion is what makes the stand-in pass."""
    impl = resolve("flashinfer_mla").load()
    impl.capabilities = dataclasses.replace(impl.capabilities, devices=frozenset({"cpu"}), lse_base="e")
    from mla_bench.problem import build_problem

    workload = sweeps.tiny()[0]
    verdict = judge(impl, build_problem(workload, torch.device("cpu")))
    assert verdict.status == "failed" and any("lse" in v for v in verdict.violations)


def test_flashinfer_empty_requests_get_lse_minus_inf(fake_packages):
    """FlashInfer writes a finite lse for a request with no keys (stand-in: the value seen on an H200); the adapter
    gives those rows -inf, the bench's convention, and only those rows."""
    impl = resolve("flashinfer_mla").load()
    impl.capabilities = dataclasses.replace(impl.capabilities, devices=frozenset({"cpu"}))
    from mla_bench.problem import build_problem
    from mla_bench.workload import Workload

    problem = build_problem(Workload(mode="decode", preset="tiny", q_lens=(1, 2, 1), kv_lens=(9, 0, 5), seed=4))
    verdict = judge(impl, problem)
    assert verdict.status == "passed", verdict.violations
    out, lse = impl.run(impl.plan(problem))
    assert bool(torch.isneginf(lse[1:3]).all()) and bool(torch.isfinite(lse[[0, 3]]).all())
    assert bool((out[1:3] == 0).all())


def test_vllm_splits_follow_vllm_033_rule():
    """One split per 512 keys of the longest request, rounded up to a power of two, at most two per SM."""
    from impls.external.vllm_triton import _kv_splits

    assert [_kv_splits(n, 132) for n in (1, 511, 512, 1024, 1600, 4096, 8192)] == [1, 1, 1, 2, 4, 8, 16]
    assert _kv_splits(131072, 132) == 256 and _kv_splits(1 << 20, 132) == 264 and _kv_splits(1 << 20, 2) == 4


def test_vllm_plan_takes_vllm_033_split_count(fake_packages, monkeypatch):
    """With ``is_mla`` the kernel gets vLLM's split count for the batch's longest request, not the old fixed 4: on the
    CPU (one SM, at most two splits) 1100 keys ask for 2, 700 for 1."""
    import importlib

    from mla_bench.problem import build_problem
    from mla_bench.workload import Workload

    module = importlib.import_module("vllm.v1.attention.ops.triton_decode_attention")
    current, calls = module.decode_attention_fwd, []

    @functools.wraps(current)  # the adapter reads the API from the signature
    def recording(*args, **kwargs):
        calls.append(args[8])
        current(*args, **kwargs)

    monkeypatch.setattr(module, "decode_attention_fwd", recording)
    impl = resolve("vllm_triton_mla").load()
    impl.capabilities = dataclasses.replace(impl.capabilities, devices=frozenset({"cpu"}))
    for kv_lens, splits in (((1100, 40), 2), ((700, 40), 1)):
        verdict = judge(impl, build_problem(Workload(mode="decode", preset="tiny", q_lens=(1, 1), kv_lens=kv_lens)))
        assert verdict.status == "passed" and calls[-1] == splits, (verdict.violations, calls)


def test_vllm_before_is_mla_runs_as_that_backend_did(fake_packages, monkeypatch):
    """A vLLM whose kernel has no ``is_mla``: 4 splits, ``k_scale`` only with an fp8 cache, one query per request
    (uniform multi-token decode refused), and the adapter's plumbing still passes conformance."""
    import importlib

    module = importlib.import_module("vllm.v1.attention.ops.triton_decode_attention")
    current = module.decode_attention_fwd
    calls = []

    def legacy(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale,
               page_size=1, logit_cap=0.0, k_scale=None):
        assert (k_scale is not None) == (k_buffer.dtype == torch.float8_e4m3fn), "k_scale goes with an fp8 cache"
        calls.append(num_kv_splits)
        scale = k_scale if k_scale is not None else torch.tensor(1.0)
        current(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits, num_kv_splits, sm_scale,
                page_size, logit_cap, scale, scale, is_mla=True)

    monkeypatch.setattr(module, "decode_attention_fwd", legacy)
    impl = resolve("vllm_triton_mla").load()
    assert impl.capabilities.query_len_kinds == frozenset({"single"}) and "before is_mla" in impl.description
    impl.capabilities = dataclasses.replace(impl.capabilities, devices=frozenset({"cpu"}))
    from mla_bench.problem import build_problem

    verdicts = [judge(impl, build_problem(w, "cpu")) for w in sweeps.conformance(impl.capabilities)
                if impl.capabilities.refusal(w, "cpu") is None]
    assert [v.status for v in verdicts] == ["passed"] * 5 and set(calls) == {4}


def test_flashmla_sparse_decode_takes_power_of_two_scales_and_64_or_128_heads(fake_packages):
    """Its Hopper kernel rounds each tile scale to bf16 (a correct kernel failed on exact fp32 scales, lse off by
    0.01-0.03), and it stops with 'Unsupported h_q' below 64 heads (an error, not a refusal)."""
    from mla_bench.problem import build_problem

    impl = resolve("flashmla").load()
    impl.capabilities = dataclasses.replace(impl.capabilities, devices=frozenset({"cpu", "cuda"}))

    def problem(preset, layout):
        return build_problem(Workload(mode="sparse_decode", q_lens=(1, 1), kv_lens=(80, 40), preset=preset,
                                      layout=layout, page_size=64, topk=16), "cpu")

    assert impl.refusal(problem("kimi-k2", "fp8_ds_mla_pow2")) is None
    assert "takes fp8_ds_mla_pow2; its kernel rounds tile scales to bf16" in impl.refusal(problem("kimi-k2",
                                                                                                  "fp8_ds_mla"))
    assert "16 heads in mode sparse_decode (FlashMLA's sparse decode runs 64 or 128)" in impl.refusal(
        problem("deepseek-v3-tp8", "fp8_ds_mla_pow2"))
