"""The regression gate: is ``run`` worse than ``baseline``?

A finding is fatal when:

- no result of the run pairs with one of the baseline (other than ones unsupported in both): nothing compared;
- several results of the run, or of the baseline, share one key: which of them counts is ambiguous;
- a result fails or errors in the run but passed, was unsupported or was absent in the baseline: a new failure;
- a result passed in the baseline and is unsupported in the run: a case lost its coverage;
- results that passed in the baseline are absent from the run (one finding per suite and impl, saying why: the
  impl is not installed here, did not run, or the workloads were not run): coverage lost, unless
  ``allow_missing`` (a run meant to cover part of the baseline: another sweep, filters, a machine without a peer);
- a passed result lacks a gated metric (error metrics, NaN/Inf count, latency median, IQR and spread) that the
  baseline's passed result has, or either of them holds a value no measurement gives (not finite, negative, a
  median <= 0): it would pass every comparison below;
- an error metric got worse than the baseline's by more than ``error_slack`` times its accuracy bound (the smaller
  of the bounds the two runs recorded in the result's details, ``tolerance[kind][field]``, or ``tolerance[field]``
  for every kind of the result: a change that loosens a tolerance does not loosen the gate with it), a codec's
  ``bound_ratio`` (its error over its stated bound, so its bound is 1) by more than ``error_slack``, or NaN/Inf
  positions appeared. Metrics of a kind with no recorded bound are context, not gated (the equivalence suite's
  ``inherent.*``: the two float64 references' own difference);
- a latency median got slower than the baseline's by more than ``max(latency_slack * baseline median,
  noise_factor * IQR, spread)``, the IQR and spread the baseline's (the spread, already a range of slice medians: see
  ``mla_bench.timing.TimingStats``): the run's own noise does not loosen its bound, or a regression that also brings
  jitter would pass; the finding says where the run's noise alone would allow more (re-run on a quieter machine).
  Latencies are compared only when both runs ran on the same GPU model, and both results on one model where they
  say which (runs over several models shard a workload onto either); else a latency result counts as compared
  only where its status is, so a latency-only run against another GPU's baseline compares nothing.

Results that failed in both runs, failed results now unsupported, allowed missing results, incomparable latencies and
plans that replayed bit for bit in the baseline but not in the run (``replay_max_abs``: no longer deterministic run
to run, which is no error, but worth knowing) are reported but not fatal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mla_bench.results import Result, Run
from reports.pairing import duplicates, measured_on, measured_on_one_model, pair, same_gpu

BAD = ("failed", "error")
MISSING_SHOWN = 3  # workload labels a missing finding names
LATENCY_METRICS = ("run_ms", "run_ms_iqr", "run_ms_spread")
# Error metrics and the Tolerance field that bounds each.
ERROR_BOUNDS = {"rel_l2": "rel_l2", "max_row_rel": "max_row_rel", "cos_diff": "cos_diff", "lse_max_abs": "lse_abs"}
BOUND_RATIO = "bound_ratio"  # a codec's largest error over its stated bound (the roundtrip suite): bounded by 1


@dataclass
class Finding:
    kind: str  # nothing compared, duplicate, new failure, now unsupported, accuracy, latency, still failing,
    #            missing, not compared, replay
    suite: str
    impl: str
    label: str
    message: str
    fatal: bool


@dataclass(frozen=True)
class GateLimits:
    error_slack: float = 0.25
    latency_slack: float = 0.10
    noise_factor: float = 3.0
    allow_missing: bool = False  # results that passed in the baseline may be absent from the run


@dataclass
class GateOutcome:
    """The gate's findings, and how many results of the run it compared against the baseline: those that pair with
    one of the baseline's, unless both are unsupported (two refusals, e.g. of an impl not installed, compare
    nothing)."""

    findings: list[Finding]
    compared: int

    @property
    def fatal(self) -> list[Finding]:
        return [f for f in self.findings if f.fatal]


def gate(baseline: Run, run: Run, limits: GateLimits = GateLimits()) -> GateOutcome:
    """Every finding of ``run`` against ``baseline``; the gate passes when none is fatal."""
    pairs = [(base, new) for _, base, new in pair(baseline, run)]
    same_models = same_gpu(baseline, run)

    def latency_comparable(base: Result | None, new: Result | None) -> bool:
        return same_models and measured_on_one_model(base, new)

    compared = sum(base is not None and new is not None and not base.status == new.status == "unsupported"
                   and (latency_comparable(base, new) or new.suite != "latency" or base.status != new.status)
                   for base, new in pairs)
    findings = _duplicates(baseline, "baseline") + _duplicates(run, "run")
    if not compared:
        findings.append(Finding("nothing compared", "", "", "", f"none of the run's {len(run.results)} results "
                                f"pairs with one of the baseline's {len(baseline.results)} (same suite, check, impl "
                                "and workload, seed included) other than ones unsupported in both, and latencies "
                                "of another GPU model", True))
    if not same_models and any(r.suite == "latency" and r.status == "passed" for r in run.results):
        findings.append(Finding("not compared", "latency", "", "", "latency not compared: baseline GPU "
                                f"{baseline.environment.get('gpu')!r}, run GPU {run.environment.get('gpu')!r}",
                                False))
    for base, new in pairs:
        other_model = same_models and not latency_comparable(base, new)
        if other_model and new.suite == "latency" and new.status == "passed":
            findings.append(_finding("not compared", new, f"latency measured on {measured_on(new)!r}, the "
                                     f"baseline's on {measured_on(base)!r}", False))
        findings += compare_pair(base, new, limits, latency_comparable(base, new))
    return GateOutcome(findings + _missing(pairs, run, limits.allow_missing), compared)


def _duplicates(run: Run, which: str) -> list[Finding]:
    """A fatal finding per key that several results of ``run`` share: the gate would see only the last of them,
    so a failed copy followed by a passed one would hide the failure."""
    return [_finding("duplicate", group[0], f"{len(group)} results of check {group[0].check!r} in the {which} share "
                     f"this key (statuses {', '.join(r.status for r in group)}): the {which} is ambiguous", True)
            for group in duplicates(run).values()]


def compare_pair(base: Result | None, new: Result | None, limits: GateLimits, compare_latency: bool) -> list[Finding]:
    """The findings of one result: its status against the baseline's, then its metrics where both passed (absent
    results are the whole run's business: see ``gate``)."""
    if new is None:
        return []  # absent from the run: see _missing
    if new.status in BAD:
        if base is None or base.status not in BAD:
            was = "absent from" if base is None else f"{base.status} in"
            return [_finding("new failure", new, f"{new.status} (was {was} the baseline): {new.brief}", True)]
        return [_finding("still failing", new, new.brief, False)]
    if new.status == "unsupported":
        if base is None or base.status == "unsupported":
            return []
        # passed -> unsupported loses a case the impl handled; failed -> unsupported refuses one it got wrong.
        return [_finding("now unsupported", new, f"unsupported (was {base.status} in the baseline): {new.brief}",
                         base.status == "passed")]
    if base is None or base.status != "passed":
        return []
    found = _unusable_metrics(base, new)
    if found:
        return found
    found = _accuracy(base, new, limits) + _replay(base, new)
    if new.suite == "latency" and compare_latency:
        found += _latency(base, new, limits)
    return found


def _missing(pairs: list[tuple[Result | None, Result | None]], run: Run, allowed: bool) -> list[Finding]:
    """One finding per suite and impl whose results that passed in the baseline are absent from ``run`` (``pairs``:
    the two runs' paired results), naming a few of their workloads and why they are absent; fatal unless
    ``allowed``."""
    absent: dict[tuple[str, str], list[Result]] = {}
    for base, new in pairs:
        if new is None and base.status == "passed":
            absent.setdefault((base.suite, base.impl or ""), []).append(base)
    findings = []
    for (suite, impl), group in absent.items():
        shown = ", ".join(r.label for r in group[:MISSING_SHOWN])
        more = f" and {len(group) - MISSING_SHOWN} more" if len(group) > MISSING_SHOWN else ""
        findings.append(Finding("missing", suite, impl, f"{shown}{more}", f"{len(group)} result(s) that passed in "
                                f"the baseline are absent from this run: {_why_absent(run, suite, impl)}",
                                not allowed))
    return findings


def _why_absent(run: Run, suite: str, impl: str) -> str:
    """Why the run has none of some results of ``impl`` in ``suite``, as far as the run file tells."""
    mine = [r for r in run.results if (r.impl or "") == impl]
    refusal = next((r.message for r in mine if r.message.startswith("not installed")), None)
    if refusal:
        return f"{impl} is {refusal.splitlines()[0]}"
    if not any(r.suite == suite for r in run.results):
        return f"suite {suite} did not run"
    if impl and not any(r.suite == suite for r in mine):
        return f"{impl} did not run in suite {suite}"
    return "their workloads did not run (another sweep, preset, seed or filters)"


def _gated(name: str) -> bool:
    """Whether the gate compares metric ``name`` (``kind.rel_l2``, ``kind.nonfinite_mismatch``, ``kind.bound_ratio``,
    ``run_ms``...)."""
    return name.partition(".")[2] in (*ERROR_BOUNDS, "nonfinite_mismatch", BOUND_RATIO) or name in LATENCY_METRICS


def measured(name: str, value: float) -> bool:
    """Whether ``value`` of metric ``name`` is one a measurement gives: finite, not negative, a median above 0."""
    return math.isfinite(value) and value >= 0 and (name != "run_ms" or value > 0)


def _unusable_metrics(base: Result, new: Result) -> list[Finding]:
    """A fatal finding per gated metric of the baseline's passed result that ``new`` (passed too) lacks, and per
    gated metric of either that no measurement gives: a NaN, an infinity, a negative value, a median of 0 or less.
    Each would pass every comparison (a missing metric is not compared; -1 is below any threshold; a baseline
    median of NaN or an IQR of inf allows anything)."""
    found = [_finding("metric missing", new, f"{name} is in the baseline's result, not in this run's", True)
             for name in base.metrics if _gated(name) and name not in new.metrics]
    for which, result in (("this run", new), ("the baseline", base)):
        for name, value in result.metrics.items():
            if _gated(name) and not measured(name, value):
                found.append(_finding("impossible value", new, f"{name} is {value!r} in {which}: no measurement "
                                      "gives that", True))
    return found


def _accuracy(base: Result, new: Result, limits: GateLimits) -> list[Finding]:
    found = []
    for name, value in new.metrics.items():
        kind, _, metric = name.partition(".")
        if metric == "nonfinite_mismatch" and value > base.metrics.get(name, 0):
            found.append(_finding("accuracy", new, f"{name} {value:g} > baseline {base.metrics.get(name, 0):g}", True))
        if metric not in (*ERROR_BOUNDS, BOUND_RATIO) or name not in base.metrics:
            continue
        bounds = [1.0] if metric == BOUND_RATIO else [
            b for b in (_bound(new, kind, metric), _bound(base, kind, metric)) if b is not None]
        if not bounds:
            continue
        bound = min(bounds)
        allowed = base.metrics[name] + limits.error_slack * bound
        if not value <= allowed:
            found.append(_finding("accuracy", new, f"{name} {value:.3g} > baseline {base.metrics[name]:.3g} + "
                                  f"{limits.error_slack:g} x bound {bound:.3g}", True))
    return found


def _replay(base: Result, new: Result) -> list[Finding]:
    """A note where the baseline's plan gave the same bits on its second run and the run's plan did not."""
    before, now = base.metrics.get("replay_max_abs"), new.metrics.get("replay_max_abs")
    if before == 0 and now is not None and now != 0:
        return [_finding("replay", new, f"the second run of a plan now differs from the first by up to {now:.3g} "
                         "(bit for bit in the baseline): no longer deterministic run to run", False)]
    return []


def _latency(base: Result, new: Result, limits: GateLimits) -> list[Finding]:
    """A fatal finding where the median is slower than the baseline's median and noise allow. The noise terms are
    the baseline's only (recorded on a quiet machine): a regression that also brings jitter would excuse itself."""
    median, base_median = new.metrics.get("run_ms"), base.metrics.get("run_ms")
    if median is None or base_median is None:
        return []
    iqr, spread = (base.metrics.get(name, 0.0)  # files written before the spread existed lack it
                   for name in ("run_ms_iqr", "run_ms_spread"))
    allowed = max(limits.latency_slack * base_median, limits.noise_factor * iqr, spread)
    threshold = base_median + allowed
    if median > threshold or math.isnan(median):
        behind = new.details.get("host_behind")
        host = f"; the host was behind in {behind} samples, which may time the host" if behind else ""
        return [_finding("latency", new, f"median {median:.4g} ms > {threshold:.4g} ms (baseline {base_median:.4g} "
                         f"ms, IQR {iqr:.3g} ms, spread {spread:.3g} ms){host}"
                         f"{_noisier(base, new, limits.noise_factor, allowed)}", True)]
    return []


def _noisier(base: Result, new: Result, noise_factor: float, allowed: float) -> str:
    """A note naming the run's IQR and spread that would each allow more than the baseline's ``allowed`` slowdown
    (ms): the run's machine may have been busy, so a flaky machine is told from a slower kernel (it still fails)."""
    louder = [f"{name} {new.metrics.get(metric, 0.0):.3g} ms against {base.metrics.get(metric, 0.0):.3g}"
              for name, metric, factor in (("IQR", "run_ms_iqr", noise_factor), ("spread", "run_ms_spread", 1.0))
              if factor * new.metrics.get(metric, 0.0) > allowed]
    return f"; the run was noisier than the baseline: {', '.join(louder)}; re-run before believing it" if louder else ""


def _bound(result: Result, kind: str, metric: str) -> float | None:
    """The accuracy bound of ``kind.metric`` recorded in ``result.details['tolerance']``, per kind (``[kind]
    [field]``) or one table for every kind (``[field]``: equivalence results before session 67), if it is a finite
    number."""
    tolerance = result.details.get("tolerance")
    if not isinstance(tolerance, dict):
        return None
    table = tolerance.get(kind) if isinstance(tolerance.get(kind), dict) else tolerance
    value = table.get(ERROR_BOUNDS[metric])
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def _finding(kind: str, result: Result, message: str, fatal: bool) -> Finding:
    return Finding(kind, result.suite, result.impl or "", result.label, message, fatal)

