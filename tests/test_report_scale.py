"""Large runs: the HTML report stays small and readable and hides no failure; compare lists every failure and
regression first, caps the rest and counts what it leaves out, in seconds."""

from __future__ import annotations

import random
import re
import time

import pytest

from test_report import _figures, _latency, _printed, _workload, rich_run

from mla_bench.cli import main
from mla_bench.results import Result, Run, save_run
from reports.console import compare_table
from reports.html import render
from reports.limits import REPORT_ROWS
from reports.plots import MAX_LINES_PER_PANEL, latency_plots

IMPLS = [f"impl{i:02}" for i in range(12)]
LAYOUTS = ("bf16", "fp8_e4m3", "fp8_ds_mla", "nvfp4")


def large_run(labels: int = 8000, seed: int = 0) -> Run:
    """A sparse sweep of about 20,000 results: each workload run by 1-3 of 12 impls, about 1.5% failed or errored,
    a third of the passed ones timed, on one GPU model."""
    rng = random.Random(seed)
    results = []
    for i in range(labels):
        w = _workload(64 << (i % 10), LAYOUTS[i % len(LAYOUTS)], batch=1 + i % 7, mode=("decode", "prefill")[i % 2])
        w["seed"] = i  # a workload of its own
        for impl in rng.sample(IMPLS, 1 + i % 3):
            status = rng.choices(["passed", "unsupported", "failed", "error"], [85, 13.5, 1, 0.5])[0]
            results.append(Result("accuracy", "accuracy", status, impl=impl, workload=w, label=f"w{i} {w['layout']}",
                                  metrics={"kernel.rel_l2": rng.uniform(1e-3, 1e-2)},
                                  message="" if status == "passed" else f"{status} w{i} {impl}"))
            if status == "passed" and i % 3 == 0:
                timed = _latency(impl, 64 << (i % 10), rng.uniform(0.01, 1.0))
                timed.workload, timed.label = w, f"w{i} {w['layout']}"
                results.append(timed)
    return Run(environment={"gpu": "NVIDIA H100"}, results=results)


def _section(page: str, heading: str) -> str:
    """The HTML of the ``<h2>`` section whose heading starts with ``heading``."""
    start = page.index(f"<h2>{heading}")
    end = page.find("<h2>", start + 4)
    return page[start:end if end >= 0 else len(page)]


def test_large_report_stays_small_and_names_every_failure():
    run = large_run()
    assert len(run.results) > 18_000
    started = time.perf_counter()
    page = render(run, [])
    assert time.perf_counter() - started < 5
    assert len(page) < 1_500_000, len(page)  # was 4.6 MB: the full 8000 x 12 grid, an 8000-row latency table
    matrix = _section(page, "Pass/fail matrix")
    failures = _section(page, "Failures and errors")
    bad = [r for r in run.results if r.status in ("failed", "error")]
    assert len(bad) > 200
    for r in bad:  # every failing workload keeps its row in the matrix, and its entry in the failure list
        assert f"<td>{r.label}</td>" in matrix and f": {r.message}</summary>" in failures
    accuracy = matrix[matrix.index("<h3>accuracy"):matrix.index("<h3>latency")]
    counted = re.findall(r'<tr><td>(?:decode|prefill) [^<]+</td><td class="num">(\d+)</td>', accuracy)
    assert sum(map(int, counted)) == 8000 - len({r.label for r in bad})  # every other workload is counted


def test_summarized_matrix_counts_passing_workloads_per_mode_and_layout():
    results = [Result("accuracy", "accuracy", "passed", impl="a", workload=_workload(64 + i), label=f"w{i}")
               for i in range(REPORT_ROWS)]
    results += [Result("accuracy", "accuracy", "unsupported", impl="b", workload=_workload(64), label="w0"),
                Result("accuracy", "accuracy", "failed", impl="b", workload=_workload(64, "nvfp4"), label="bad",
                       message="too far off")]
    matrix = _section(render(Run(environment={}, results=results), []), "Pass/fail matrix")
    assert "1 of 101 workloads have a failure or error" in matrix
    assert '<td>bad</td><td class="muted">-</td><td class="failed" title="too far off">FAIL</td>' in matrix
    assert ('<tr><td>decode bf16</td><td class="num">100</td><td class="passed num">100 pass</td>'
            '<td class="unsupported num">1 n/a</td></tr>') in matrix
    assert "<td>w7</td>" not in matrix  # passing workloads are counted, not listed


def test_small_matrix_lists_every_workload():
    results = [Result("accuracy", "accuracy", "passed", impl="a", workload=_workload(64 + i), label=f"w{i}")
               for i in range(REPORT_ROWS)]
    matrix = _section(render(Run(environment={}, results=results), []), "Pass/fail matrix")
    assert all(f"<td>w{i}</td>" in matrix for i in range(REPORT_ROWS)) and "mode and layout" not in matrix


def test_the_report_command_summarizes_over_rows_and_never_with_rows_0(tmp_path):
    results = [Result("accuracy", "accuracy", "passed", impl="a", workload=_workload(64 + i), label=f"w{i}")
               for i in range(30)]
    run = save_run(Run(environment={}, results=results), tmp_path / "run.json")
    for rows, summarized in (("20", True), ("30", False), ("0", False)):
        assert main(["report", str(run), "-o", str(tmp_path / f"r{rows}.html"), "--rows", rows]) == 0
        matrix = _section((tmp_path / f"r{rows}.html").read_text(), "Pass/fail matrix")
        assert ("mode and layout" in matrix) == summarized
        assert all(f"<td>w{i}</td>" in matrix for i in range(30)) != summarized


def test_latency_table_keeps_the_workloads_timed_on_most_impls():
    results = [_latency("a", 64 + i, 0.01) for i in range(3 * REPORT_ROWS)]
    results += [_latency("b", 64 + i, 0.02) for i in range(0, 3 * REPORT_ROWS, 3)]  # a third on two impls
    table = _section(render(Run(environment={}, results=results), []), "Latency")
    assert table.count("<tr>") == REPORT_ROWS + 1
    assert f"the {REPORT_ROWS} of {3 * REPORT_ROWS} workloads timed on the most impls" in table
    assert "<td>decode b2 ctx64</td>" in table and "<td>decode b2 ctx65</td>" not in table


def test_latency_panel_draws_the_lines_of_most_points(monkeypatch):
    figures = _figures(monkeypatch)
    lines = MAX_LINES_PER_PANEL + 8
    results = [_latency(f"impl{i:02}", 1024 << k, 0.01) for i in range(lines) for k in range(1 + (i < 3))]
    latency_plots(Run(environment={}, results=results))
    top = figures[0].axes[0]
    assert len(top.get_lines()) == MAX_LINES_PER_PANEL
    assert top.get_title().endswith(f", {MAX_LINES_PER_PANEL} of {lines} lines (most points)")
    assert {"impl00", "impl01", "impl02"} <= {line.get_label().split()[0] for line in top.get_lines()}


def _regressed(run: Run) -> tuple[Run, set[str]]:
    """A copy of ``run`` with planted changes: 60 new failures, 80 latencies 30% slower, 30 passed results and
    every failed one of the first 2000 gone, the rest unchanged. Returns it and the labels of what must be shown."""
    rng = random.Random(1)
    results = [Result(**{**vars(r), "metrics": dict(r.metrics)}) for r in run.results]
    passed = [r for r in results if r.status == "passed" and r.suite == "accuracy"]
    timed = [r for r in results if r.suite == "latency"]
    picked = rng.sample(passed, 90)
    gone = set(map(id, picked[:30] + [r for r in results[:2000] if r.status in ("failed", "error")]))
    planted = set()
    for r in picked[30:]:
        r.status = "failed"
        planted.add(("accuracy", r.impl, r.label))
    for r in rng.sample(timed, 80):
        r.metrics["run_ms"] *= 1.3
        planted.add(("latency", r.impl, r.label))
    shown = planted | {(r.suite, r.impl, r.label) for r in results if id(r) in gone or r.status in ("failed", "error")}
    return Run(environment=run.environment, results=[r for r in results if id(r) not in gone]), shown


def test_compare_of_large_runs_lists_every_failure_and_regression_and_counts_the_rest():
    a = large_run()
    b, shown = _regressed(a)
    started = time.perf_counter()
    text = _printed(compare_table(a, b))
    assert time.perf_counter() - started < 10  # was 15 s: all 20,000 rows laid out
    rows = [line for line in text.splitlines() if line.startswith("│ ") and "│ w" in line]
    found = {(cells[2], cells[3], cells[4]) for cells in (re.split(r"\s*│\s*", line) for line in rows)}
    assert found >= shown, sorted(shown - found)[:5]
    assert len(rows) < len(shown) + 210  # the cap: what must be shown, then at most the limit of other changes
    kinds = [re.split(r"\s*│\s*", line)[1] for line in rows]
    assert kinds[:60] == ["new failure"] * 60 and kinds[60] == "regression"
    assert re.search(r"unchanged \d{5} \(within 10% or not compared; not shown\)", text)


def test_compare_shows_failures_beyond_its_limit():
    a = large_run(labels=600)
    b, shown = _regressed(a)
    text = _printed(compare_table(a, b, limit=50))
    rows = [line for line in text.splitlines() if line.startswith("│ ") and "│ w" in line]
    assert len(rows) == len(shown) > 50


def test_small_compare_lists_every_result_in_run_order():
    run = rich_run()
    text = _printed(compare_table(run, rich_run()))
    rows = [line for line in text.splitlines() if line.startswith("│ ")]
    assert len(rows) == len(run.results) and "what" not in text and "unchanged" not in text


def test_the_compare_command_caps_its_rows_by_rows_and_lists_every_result_with_rows_0(tmp_path, capsys):
    a = save_run(large_run(labels=120), tmp_path / "a.json")
    b = save_run(large_run(labels=120, seed=1), tmp_path / "b.json")
    assert main(["compare", str(a), str(b), "--rows", "20"]) == 0
    capped = capsys.readouterr().out
    assert "what" in capped and "not shown" in capped
    assert main(["compare", str(a), str(b), "--rows", "0"]) == 0
    full = capsys.readouterr().out
    assert "what" not in full and all(f"w{i} " in full for i in range(120))
    with pytest.raises(SystemExit):
        main(["compare", str(a), str(b), "--rows", "-1"])
    assert "must be >= 0" in capsys.readouterr().err


def test_compare_calls_a_failure_fixed_only_when_it_passes_and_limit_0_lists_every_result():
    before = [Result("accuracy", "accuracy", "failed", impl="a", workload=_workload(64 + i), label=f"w{i}",
                     metrics={"kernel.rel_l2": 0.1}) for i in range(4)]
    after = [Result("accuracy", "accuracy", status, impl="a", workload=_workload(64 + i), label=f"w{i}",
                    metrics={"kernel.rel_l2": 0.001}) for i, status in enumerate(["passed", "unsupported"] * 2)]
    a, b = Run(environment={}, results=before), Run(environment={}, results=after)
    text = _printed(compare_table(a, b, limit=3))  # the two fixed rows, then one of the two changed
    assert re.search(r"fixed .* w0 ", text) and re.search(r"fixed .* w2 ", text) and re.search(r"changed .* w1 ", text)
    assert "fixed 2" in text and "changed 2 (1" in text
    full = _printed(compare_table(a, b, limit=0))
    assert "what" not in full and all(f" w{i} " in full for i in range(4))


def test_compare_calls_a_slowdown_a_regression_only_where_the_gate_would():
    """+12% within three IQRs is a change the gate lets pass; +60% is a regression."""
    a = [_latency("k", 1024 << i, 0.05) for i in range(3)]
    b = [_latency("k", 1024 << i, ms) for i, ms in enumerate((0.056, 0.08, 0.05))]
    for r in a + b:
        r.metrics["run_ms_iqr"] = 0.005
    text = _printed(compare_table(Run(environment={"gpu": "H100"}, results=a),
                                  Run(environment={"gpu": "H100"}, results=b), limit=2))
    assert re.search(r"changed .* ctx1024 ", text) and re.search(r"regression .* ctx2048 ", text), text
    assert "regression 1," in text and "changed 1 " in text
