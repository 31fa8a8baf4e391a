"""The regression gate on hand-made runs: each rule fires on its regression and stays quiet on noise."""

from __future__ import annotations

from mla_bench.results import Result, Run
from reports.gate import GateLimits, gate

TOL = {"tolerance": {"kernel": {"rel_l2": 8e-3, "max_row_rel": 2e-2, "cos_diff": 2e-5, "lse_abs": 5e-3}}}


def _acc(impl="k", status="passed", rel=2e-3, label="w1", nonfinite=0) -> Result:
    return Result("accuracy", "accuracy", status, impl=impl, workload={"label": label}, label=label,
                  metrics={"kernel.rel_l2": rel, "kernel.nonfinite_mismatch": nonfinite}, details=TOL,
                  message="" if status == "passed" else "kernel: rel_l2 too large")


def _lat(median, iqr=0.001, impl="k", label="w1") -> Result:
    return Result("latency", "latency", "passed", impl=impl, workload={"label": label}, label=label,
                  metrics={"run_ms": median, "run_ms_iqr": iqr})


def _run(*results, gpu="NVIDIA H100 80GB HBM3") -> Run:
    return Run(environment={"gpu": gpu}, results=list(results))


def _fatal(baseline, run, **limits):
    return [f for f in gate(baseline, run, GateLimits(**limits)) if f.fatal]


def test_unchanged_run_passes():
    base = _run(_acc(), _lat(0.100))
    assert _fatal(base, _run(_acc(), _lat(0.100))) == []


def test_new_failure_and_error_are_fatal_but_old_failures_are_not():
    base = _run(_acc(label="a"), _acc(label="b", status="failed"))
    findings = gate(base, _run(_acc(label="a", status="failed"), _acc(label="b", status="failed"),
                               _acc(label="c", status="error")))
    fatal = {(f.kind, f.label) for f in findings if f.fatal}
    assert fatal == {("new failure", "a"), ("new failure", "c")}
    assert ("still failing", "b") in {(f.kind, f.label) for f in findings if not f.fatal}


def test_error_metric_worse_beyond_its_slack_is_fatal():
    base = _run(_acc(rel=2e-3))
    assert _fatal(base, _run(_acc(rel=2e-3 + 0.2 * 8e-3))) == []          # within a quarter of the bound
    found = _fatal(base, _run(_acc(rel=2e-3 + 0.3 * 8e-3)))                # still passing, but worse
    assert [f.kind for f in found] == ["accuracy"] and "kernel.rel_l2" in found[0].message
    assert [f.kind for f in _fatal(base, _run(_acc(nonfinite=2)))] == ["accuracy"]


def test_latency_slowdown_beyond_noise_is_fatal():
    base = _run(_lat(0.100, iqr=0.001))
    assert _fatal(base, _run(_lat(0.108, iqr=0.001))) == []               # within the 10% floor
    assert [f.kind for f in _fatal(base, _run(_lat(0.130, iqr=0.001)))] == ["latency"]
    # Noisy timings widen the threshold: 3 IQRs of 0.02 ms allow up to 0.160 ms.
    assert _fatal(base, _run(_lat(0.150, iqr=0.020))) == []
    assert [f.kind for f in _fatal(base, _run(_lat(0.170, iqr=0.020)))] == ["latency"]


def test_latency_is_compared_only_on_the_same_gpu_model():
    base = _run(_lat(0.100), gpu="NVIDIA H200")
    findings = gate(base, _run(_lat(0.500), gpu="NVIDIA H100 80GB HBM3"))
    assert not [f for f in findings if f.fatal]
    assert [f.kind for f in findings] == ["not compared"]
    assert _fatal(_run(_lat(0.1), gpu=None), _run(_lat(0.5), gpu=None)) == []


def test_missing_results_are_reported_not_fatal():
    findings = gate(_run(_acc(label="a"), _acc(label="b")), _run(_acc(label="a")))
    assert [(f.kind, f.label, f.fatal) for f in findings] == [("missing", "b", False)]


def test_an_unusable_tolerance_in_a_file_does_not_crash_the_gate():
    base = _run(_acc(rel=2e-3))
    run = _run(_acc(rel=5e-3))
    run.results[0].details = {"tolerance": {"kernel": {"rel_l2": "<script>"}}}
    base.results[0].details = {"tolerance": {"kernel": {"rel_l2": float("inf")}}}
    assert _fatal(base, run) == []  # no usable bound: that metric is not gated (status still is)
