"""The regression gate on hand-made runs: each rule fires on its regression and stays quiet on noise."""

from __future__ import annotations

import pytest

from mla_bench.cli import main
from mla_bench.results import Result, Run, save_run
from reports.gate import GateLimits, gate

TOL = {"tolerance": {"kernel": {"rel_l2": 8e-3, "max_row_rel": 2e-2, "cos_diff": 2e-5, "lse_abs": 5e-3}}}


def _acc(impl="k", status="passed", rel=2e-3, label="w1", nonfinite=0, seed=0) -> Result:
    return Result("accuracy", "accuracy", status, impl=impl, workload={"label": label, "seed": seed}, label=label,
                  metrics={"kernel.rel_l2": rel, "kernel.nonfinite_mismatch": nonfinite}, details=TOL,
                  message={"passed": "", "unsupported": "no fp8 cache"}.get(status, "kernel: rel_l2 too large"))


def _lat(median, iqr=0.001, impl="k", label="w1", spread=None) -> Result:
    metrics = {"run_ms": median, "run_ms_iqr": iqr} | ({} if spread is None else {"run_ms_spread": spread})
    return Result("latency", "latency", "passed", impl=impl, workload={"label": label}, label=label, metrics=metrics)


def _run(*results, gpu="NVIDIA H100 80GB HBM3") -> Run:
    return Run(environment={"gpu": gpu}, results=list(results))


def _fatal(baseline, run, **limits):
    return gate(baseline, run, GateLimits(**limits)).fatal


def test_unchanged_run_passes():
    base = _run(_acc(), _lat(0.100))
    assert _fatal(base, _run(_acc(), _lat(0.100))) == []


def test_new_failure_and_error_are_fatal_but_old_failures_are_not():
    base = _run(_acc(label="a"), _acc(label="b", status="failed"))
    findings = gate(base, _run(_acc(label="a", status="failed"), _acc(label="b", status="failed"),
                               _acc(label="c", status="error"))).findings
    fatal = {(f.kind, f.label) for f in findings if f.fatal}
    assert fatal == {("new failure", "a"), ("new failure", "c")}
    assert ("still failing", "b") in {(f.kind, f.label) for f in findings if not f.fatal}


def test_error_metric_worse_beyond_its_slack_is_fatal():
    base = _run(_acc(rel=2e-3))
    assert _fatal(base, _run(_acc(rel=2e-3 + 0.2 * 8e-3))) == []          # within a quarter of the bound
    found = _fatal(base, _run(_acc(rel=2e-3 + 0.3 * 8e-3)))                # still passing, but worse
    assert [f.kind for f in found] == ["accuracy"] and "kernel.rel_l2" in found[0].message
    assert [f.kind for f in _fatal(base, _run(_acc(nonfinite=2)))] == ["accuracy"]


def _pair(rel, tolerance, inherent=1e-3) -> Result:
    return Result("equivalence", "absorbed == mha", "passed", impl="a vs b", workload={"label": "w1"}, label="w1",
                  metrics={"pair.rel_l2": rel, "pair.nonfinite_mismatch": 0, "inherent.rel_l2": inherent},
                  details={"tolerance": tolerance})


def test_the_equivalence_suites_pair_errors_are_gated_by_their_bound_in_either_format():
    """Its tolerance per kind (``{"pair": ...}``) or, in files before session 67, one table for every kind: neither
    was read before, so a pair error 3.5x worse (still under its own bound) passed the gate."""
    for tolerance in ({"pair": {"rel_l2": 0.021}}, {"rel_l2": 0.021}):
        base = _run(_pair(0.0057, tolerance))
        assert _fatal(base, _run(_pair(0.0057 + 0.2 * 0.021, tolerance))) == []
        found = _fatal(base, _run(_pair(0.0198, tolerance)))
        assert [f.kind for f in found] == ["accuracy"] and "pair.rel_l2 0.0198" in found[0].message, tolerance
    # the float64 references' own difference has no bound of its own: context, not gated
    keyed = {"pair": {"rel_l2": 0.021}}
    assert _fatal(_run(_pair(0.0057, keyed)), _run(_pair(0.0057, keyed, inherent=0.5))) == []


def test_capability_cells_and_codec_bound_ratios_are_gated():
    """The roundtrip suite's capability cells record the judge's tolerances; a codec's ``bound_ratio`` is its error
    over its stated bound, so its own bound is 1."""
    def cell(rel):
        return Result("roundtrip", "capability", "passed", impl="k", workload={"label": "c"}, label="k: decode bf16",
                      metrics={"kernel.rel_l2": rel}, details={"row": "decode", "column": "bf16", **TOL})

    def codec(ratio):
        return Result("roundtrip", "codec bounds", "passed", label="fp8_ds_mla",
                      metrics={"fp32.bound_ratio": ratio, "fp32.rel_l2": 1e-3})

    base = _run(cell(2e-3), codec(0.5))
    assert _fatal(base, _run(cell(2e-3 + 0.2 * 8e-3), codec(0.7))) == []
    found = _fatal(base, _run(cell(5e-3), codec(0.8)))
    assert sorted(f.message.split()[0] for f in found) == ["fp32.bound_ratio", "kernel.rel_l2"], found
    without_ratio = Result("roundtrip", "codec bounds", "passed", label="fp8_ds_mla", metrics={"fp32.rel_l2": 1e-3})
    assert [f.kind for f in _fatal(base, _run(cell(2e-3), without_ratio))] == ["metric missing"]


def test_a_plan_that_no_longer_replays_bit_for_bit_is_noted_not_fatal():
    def replayed(difference):
        result = _acc()
        result.metrics["replay_max_abs"] = difference
        return result

    outcome = gate(_run(replayed(0.0)), _run(replayed(3e-4)))
    assert not outcome.fatal
    assert [(f.kind, f.fatal) for f in outcome.findings] == [("replay", False)]
    assert "by up to 0.0003" in outcome.findings[0].message
    for base, new in ((0.0, 0.0), (1e-4, 3e-4), (0.0, None)):  # unchanged, never bit for bit, not run twice
        assert gate(_run(replayed(base)), _run(replayed(new) if new is not None else _acc())).findings == []


def test_latency_slowdown_beyond_noise_is_fatal():
    base = _run(_lat(0.100, iqr=0.001))
    assert _fatal(base, _run(_lat(0.108, iqr=0.001))) == []               # within the 10% floor
    assert [f.kind for f in _fatal(base, _run(_lat(0.130, iqr=0.001)))] == ["latency"]
    # The baseline's noisy timings widen the threshold: 3 IQRs of 0.02 ms allow up to 0.160 ms, for a quiet run too.
    noisy = _run(_lat(0.100, iqr=0.020))
    assert _fatal(noisy, _run(_lat(0.150, iqr=0.001))) == []
    assert [f.kind for f in _fatal(noisy, _run(_lat(0.170, iqr=0.001)))] == ["latency"]


def test_a_regression_that_brings_jitter_does_not_widen_its_own_bound():
    """A kernel 2x slower and bimodal passed: the run's own IQR (3 x 0.05 ms) allowed up to 0.25 ms. The bound is
    the baseline's; the finding names the run's larger noise, so a busy machine is told from a slower kernel."""
    base = _run(_lat(0.100, iqr=0.001, spread=0.001))
    (found,) = _fatal(base, _run(_lat(0.200, iqr=0.050, spread=0.100)))
    assert found.kind == "latency" and "> 0.11 ms" in found.message
    assert found.message.endswith("; the run was noisier than the baseline: IQR 0.05 ms against 0.001, spread 0.1 ms "
                                  "against 0.001; re-run before believing it")
    (found,) = _fatal(base, _run(_lat(0.130, iqr=0.002, spread=0.005)))  # noisier, but within the 10% it allows
    assert "noisier" not in found.message


def test_latencies_of_a_mixed_gpu_run_compare_only_between_results_of_one_model():
    """Runs over an H100 and an H200 (--devices) name both; their shards may put one workload on either model."""
    def on(model, median, label):
        result = _lat(median, label=label)
        result.details = {"device": model}
        return result

    mix = "NVIDIA H100 80GB HBM3 + NVIDIA H200"
    base = _run(on("NVIDIA H200", 0.100, "a"), on("NVIDIA H100 80GB HBM3", 0.100, "b"), gpu=mix)
    outcome = gate(base, _run(on("NVIDIA H100 80GB HBM3", 0.140, "a"), on("NVIDIA H100 80GB HBM3", 0.140, "b"),
                              gpu=mix))
    assert [(f.kind, f.label) for f in outcome.fatal] == [("latency", "b")]  # "a" was 40% slower on the other model
    assert ("not compared", "a") in {(f.kind, f.label) for f in outcome.findings if not f.fatal}
    assert outcome.compared == 1


def test_a_slowdown_timed_with_the_host_behind_says_so():
    base = _run(_lat(0.100))
    late = _lat(0.130)
    late.details = {"host_behind": 64}
    (found,) = _fatal(base, _run(late))
    assert "the host was behind in 64 samples" in found.message
    assert "host" not in _fatal(base, _run(_lat(0.130)))[0].message


def test_the_baselines_spread_widens_the_latency_threshold_once():
    """128 heads b1 ctx4096 on an H100: 22.2 us in the baseline, 26.1 in a run. The baseline's spread (a range of
    slice medians) counts once, not noise_factor times as the IQR does; the run's spread, a slower spell it met,
    fails it and is named."""
    base = _run(_lat(0.0222, iqr=0.0007))
    assert [f.kind for f in _fatal(base, _run(_lat(0.0261, iqr=0.0007, spread=0.0002)))] == ["latency"]
    spread = _run(_lat(0.0222, iqr=0.0007, spread=0.0040))
    assert _fatal(spread, _run(_lat(0.0261, iqr=0.0007, spread=0.0002))) == []  # 22.2 + 4.0 = 26.2 us allowed
    found = _fatal(spread, _run(_lat(0.0270, iqr=0.0007, spread=0.0002)))
    assert [f.kind for f in found] == ["latency"] and "spread 0.004 ms" in found[0].message
    (found,) = _fatal(base, _run(_lat(0.0261, iqr=0.0007, spread=0.0040)))
    assert found.kind == "latency" and "noisier than the baseline: spread 0.004 ms against 0;" in found.message
    assert [f.kind for f in _fatal(base, _run(_lat(0.0222, spread=-1.0)))] == ["impossible value"]


def test_a_passed_result_without_its_gated_metrics_or_with_impossible_ones_is_fatal():
    base = _run(_acc(label="a"), _lat(0.100, label="b"))
    stripped = _run(_acc(label="a"), _lat(0.100, label="b"))
    stripped.results[0].metrics = {}
    del stripped.results[1].metrics["run_ms"]
    assert sorted((f.kind, f.label) for f in _fatal(base, stripped)) == [("metric missing", "a"),
                                                                        ("metric missing", "a"),
                                                                        ("metric missing", "b")]
    for value in (-1.0, float("nan"), float("inf")):
        found = _fatal(base, _run(_acc(label="a", rel=value), _lat(value, label="b")))
        assert [(f.kind, f.label) for f in found] == [("impossible value", "a"), ("impossible value", "b")], value
    assert [f.kind for f in _fatal(base, _run(_acc(label="a", nonfinite=float("nan")), _lat(0.0, label="b")))] \
        == ["impossible value", "impossible value"]
    unmeasured = _run(_acc(label="a"), _lat(0.100, label="b"))
    unmeasured.results[0].metrics = {"kernel.rel_l2": 2e-3, "kernel.nonfinite_mismatch": 0, "extra": -5.0}
    assert _fatal(base, unmeasured) == []  # metrics the gate does not compare may be anything


def test_latency_is_compared_only_on_the_same_gpu_model():
    """Against another GPU's baseline latencies are not compared, and they no longer count as compared: a
    latency-only run gated against the wrong file printed "passed (1 of 1 results compared)"."""
    base = _run(_acc(label="a"), _lat(0.100), gpu="NVIDIA H200")
    outcome = gate(base, _run(_acc(label="a"), _lat(0.500), gpu="NVIDIA H100 80GB HBM3"))
    assert not outcome.fatal and [f.kind for f in outcome.findings] == ["not compared"] and outcome.compared == 1
    latency_only = gate(_run(_lat(0.100), gpu="NVIDIA H200"), _run(_lat(0.500), gpu="NVIDIA H100 80GB HBM3"))
    assert latency_only.compared == 0 and [f.kind for f in latency_only.fatal] == ["nothing compared"]
    no_gpu = gate(_run(_acc(label="a"), _lat(0.1), gpu=None), _run(_acc(label="a"), _lat(0.5), gpu=None))
    assert not no_gpu.fatal and no_gpu.compared == 1  # no GPU model named: CPU latencies are never compared


def test_a_baseline_metric_no_measurement_gives_is_fatal_not_a_free_pass():
    """A NaN median or an infinite IQR in the baseline allowed any latency; an infinite bound any error."""
    for field, value in (("run_ms", float("nan")), ("run_ms_iqr", float("inf"))):
        base = _run(_lat(0.100))
        base.results[0].metrics[field] = value
        assert [f.kind for f in _fatal(base, _run(_lat(5.0)))] == ["impossible value"], field
    base = _run(_acc(label="a"))
    base.results[0].metrics["kernel.rel_l2"] = float("inf")
    found = _fatal(base, _run(_acc(label="a", rel=0.5)))
    assert [f.kind for f in found] == ["impossible value"] and "in the baseline" in found[0].message


def test_compare_calls_a_nan_baseline_headline_not_comparable_not_a_regression(tmp_path, capsys):
    base = _run(*[_acc(label=f"w{i}") for i in range(4)])
    base.results[1].metrics["kernel.rel_l2"] = float("nan")
    a, b = save_run(base, tmp_path / "a"), save_run(_run(*[_acc(label=f"w{i}") for i in range(4)]), tmp_path / "b")
    for rows in ("0", "1"):  # every row; a summary that shows only what it never leaves out
        assert main(["compare", str(a), str(b), "--rows", rows]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines() if "│ accuracy" in line]
        assert len(lines) == (4 if rows == "0" else 1)
        (row,) = [line for line in lines if "│ w1 " in line]
        assert "not comparable" in row and "regression" not in row and "%" not in row


def test_a_run_that_loosens_its_own_tolerance_is_judged_by_the_baselines_bound():
    """The bound came from the run being judged: loosening a tolerance loosened the gate with it."""
    base, loose = _run(_acc(label="a", rel=2e-3)), _run(_acc(label="a", rel=0.2))
    loose.results[0].details = {"tolerance": {"kernel": {"rel_l2": 1.0}}}
    found = _fatal(base, loose)
    assert [f.kind for f in found] == ["accuracy"] and "x bound 0.008" in found[0].message


def test_results_that_passed_and_are_absent_are_fatal_unless_allowed():
    base = _run(_acc(label="a"), *[_acc(label=f"b{i}") for i in range(5)], _acc(label="c", status="failed"))
    findings = gate(base, _run(_acc(label="a"))).findings
    assert [(f.kind, f.fatal) for f in findings] == [("missing", True)]  # one finding for the impl, not five
    assert findings[0].label == "b0, b1, b2 and 2 more" and findings[0].message.startswith("5 result(s)")
    assert "workloads did not run" in findings[0].message  # the absent failed result "c" is no coverage lost
    assert _fatal(base, _run(_acc(label="a")), allow_missing=True) == []


def test_a_missing_finding_says_why_the_results_are_absent():
    base = _run(_acc(impl="peer", label="a"), _acc(label="a"), _lat(0.1))
    not_installed = Result("accuracy", "accuracy", "unsupported", impl="peer", label="(all workloads)",
                           message="not installed: No module named 'peer_kernels'\ntraceback")
    whys = {f.impl: f.message for f in gate(base, _run(_acc(label="a"), not_installed, _lat(0.1))).findings}
    assert whys["peer"].endswith("peer is not installed: No module named 'peer_kernels'")
    whys = {(f.suite, f.impl): f.message for f in gate(base, _run(_acc(label="a"))).findings}
    assert whys[("accuracy", "peer")].endswith("peer did not run in suite accuracy")
    assert whys[("latency", "k")].endswith("suite latency did not run")


def test_the_gate_command_hints_at_allow_missing(tmp_path, capsys):
    base = save_run(_run(_acc(label="a"), _acc(label="b")), tmp_path / "b")
    run = save_run(_run(_acc(label="a")), tmp_path / "r")
    assert main(["gate", "--baseline", str(base), str(run)]) == 1
    assert "--allow-missing" in capsys.readouterr().out
    assert main(["gate", "--baseline", str(base), str(run), "--allow-missing"]) == 0


def test_an_unusable_tolerance_in_a_file_does_not_crash_the_gate():
    base = _run(_acc(rel=2e-3))
    run = _run(_acc(rel=5e-3))
    run.results[0].details = {"tolerance": {"kernel": {"rel_l2": "<script>"}}}
    base.results[0].details = {"tolerance": {"kernel": {"rel_l2": float("inf")}}}
    assert _fatal(base, run) == []  # no usable bound: that metric is not gated (status still is)


def test_a_gate_that_compares_nothing_fails():
    base = _run(_acc(label="a"), _acc(label="b"))
    nothing = [_run(), _run(_acc(label="a", seed=1), _acc(label="b", seed=1))]  # no results; another seed
    for baseline, run in [(base, nothing[0]), (base, nothing[1]), (_run(), base)]:
        assert gate(baseline, run).compared == 0
        assert [f.kind for f in _fatal(baseline, run, allow_missing=True)] == ["nothing compared"]
    # Results unsupported in both runs (an impl not installed on either machine) compare nothing either.
    refused = _run(_acc(status="unsupported"))
    assert [f.kind for f in _fatal(refused, refused)] == ["nothing compared"]
    assert gate(base, _run(_acc(label="a"), _acc(label="c"))).compared == 1 and _fatal(base, base) == []


def test_passed_then_unsupported_is_fatal_other_status_changes_to_unsupported_are_not():
    base = _run(_acc(label="a"), _acc(label="b", status="failed"), _acc(label="c", status="unsupported"))
    findings = gate(base, _run(_acc(label="a", status="unsupported"), _acc(label="b", status="unsupported"),
                               _acc(label="c"))).findings
    assert [(f.kind, f.label, f.fatal) for f in findings] == [("now unsupported", "a", True),
                                                              ("now unsupported", "b", False)]
    assert "was passed" in findings[0].message and "no fp8 cache" in findings[0].message


def test_duplicate_keys_in_either_file_are_fatal():
    base = _run(_acc(label="a"), _acc(label="b"))
    hidden = _run(_acc(label="a", status="failed"), _acc(label="a"), _acc(label="b"))  # the passed copy came last
    found = _fatal(base, hidden)
    assert [(f.kind, f.label) for f in found] == [("duplicate", "a")]
    assert "in the run" in found[0].message and "failed, passed" in found[0].message
    assert [(f.kind, f.label) for f in _fatal(hidden, base)] == [("duplicate", "a")]


def test_results_of_one_workload_told_apart_by_label_are_distinct():
    """Placement's metadata_sync gives one result per builder for a workload, the builder named in the label."""
    def sync(builder, status="passed"):
        return Result("placement", "metadata_sync", status, workload={"mode": "sparse_decode"},
                      label=f"{builder} | sparse_decode", message="" if status == "passed" else "synced 1x")

    base = _run(sync("build_step"), sync("transform_paged"))
    assert _fatal(base, base) == []
    found = _fatal(base, _run(sync("build_step", "failed"), sync("transform_paged")))
    assert [(f.kind, f.label) for f in found] == [("new failure", "build_step | sparse_decode")]


def test_the_summary_says_how_many_results_were_compared(tmp_path, capsys):
    base = save_run(_run(_acc(label="a"), _acc(label="b"), _acc(label="c", status="unsupported")), tmp_path / "b")
    run = save_run(_run(_acc(label="a"), _acc(label="b"), _acc(label="c", status="unsupported"), _acc(label="d")),
                   tmp_path / "r")
    assert main(["gate", "--baseline", str(base), str(run)]) == 0
    assert f"gate: passed (2 of 4 results compared against {base})" in capsys.readouterr().out


@pytest.mark.parametrize("option", ["--error-slack", "--latency-slack", "--noise-factor"])
@pytest.mark.parametrize("value", ["-5", "nan", "inf", "1e400", "lots"])
def test_gate_options_must_be_finite_and_non_negative(option, value, tmp_path, capsys):
    path = save_run(_run(_acc()), tmp_path / "run.json")
    assert main(["gate", "--baseline", str(path), str(path), option, "0"]) == 0  # the strictest limit is valid
    with pytest.raises(SystemExit) as info:
        main(["gate", "--baseline", str(path), str(path), f"{option}={value}"])
    assert info.value.code == 2
    assert f"argument {option}: must be a finite number >= 0, got '{value}'" in capsys.readouterr().err
