"""The HTML report: self-contained, every plot present, nothing from a results file becomes markup, and it
renders in headless Chromium with every plot loaded."""

from __future__ import annotations

import html.parser
import io
import math
import os
import random
import re
import shutil
import subprocess

import pytest
from rich.console import Console

from mla_bench.hidden_costs import COST_METRICS
from mla_bench.results import Device, Result, Run, load_run, save_run
from reports.console import compare_table, failures_table, gate_table, summary_table
from reports.gate import Finding
from reports.hidden_costs import hidden_cost_rows, hidden_cost_table
from reports.html import render, write_report
from reports.plots import (MAX_IMPLS_PER_FIGURE, _ceiling, all_plots, error_heatmaps, latency_plots, roofline,
                           roofline_panels)

EVIL = '<script>alert(1)</script>"><img src=x onerror=alert(2)><iframe src="http://evil.example/">$\\alpha$'
ALLOWED_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "code", "b", "table", "tr",
                "th", "td", "thead", "tbody", "caption", "figure", "img", "details", "summary", "pre", "br"}


def _workload(kv: int, layout: str = "bf16", batch: int = 2, mode: str = "decode", preset: str = "tiny") -> dict:
    return {"mode": mode, "q_lens": [1] * batch, "kv_lens": [kv] * batch, "preset": preset, "num_heads": None,
            "layout": layout, "page_size": 64, "dtype": "bfloat16", "topk": None, "index_transform": None,
            "dcp_world": 1, "dcp_interleave": 1, "chunk_size": None, "seed": 0}


H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def _latency(impl: str, kv: int, ms: float, batch: int = 2, cold_l2: bool = True, spread: bool = True,
             device: str = H100) -> Result:
    """A passed latency result as the latency suite makes it, measured on the GPU model ``device``."""
    w = _workload(kv, batch=batch, preset="deepseek-v3-tp8")
    nbytes, flops = 1152 * kv * batch, 2 * 16 * 1088 * kv * batch
    return Result("latency", "latency", "passed", impl=impl, workload=w, label=f"decode b{batch} ctx{kv}",
                  metrics={"run_ms": ms, "run_ms_iqr": ms / 50, "plan_ms": 0.05, "bytes": nbytes, "flops": flops,
                           "gbps": nbytes / ms / 1e6, "tflops": flops / ms / 1e9, "copy_fraction": 0.5,
                           "matmul_fraction": 0.1, "iterations": 1000} | ({"run_ms_spread": ms / 20} if spread else {}),
                  details={"timer": "cuda_graph", "cold_l2": cold_l2, "host_behind": 32 if kv == 8192 else 0,
                           "device": device})


def rich_run(evil: str = "") -> Run:
    """A run with every section of the report: accuracy over layouts and contexts (a failure among them),
    latency of two impls, a capability matrix, hidden costs, a bench check. ``evil`` goes into every string."""
    results = []
    for impl in (f"alpha{evil}", "beta"):
        for layout in ("bf16", f"fp8{evil}"):
            for kv in (64, 512, 4096):
                status = "failed" if (impl == "beta" and kv == 4096) else "passed"
                results.append(Result("accuracy", "accuracy", status, impl=impl, workload=_workload(kv, layout),
                                      label=f"decode ctx{kv} {layout}", message=f"kernel: rel_l2 {evil}",
                                      metrics={"kernel.rel_l2": 1e-3 * kv ** 0.3, "e2e.rel_l2": 2e-3 * kv ** 0.3,
                                               "replay_max_abs": 0.0 if impl == "beta" or kv < 512 else kv / 1e6}))
        for kv in (4096, 8192, 16384):
            results.append(_latency(impl, kv, 0.01 * kv / 4096 * (2 if impl == "beta" else 1), cold_l2=kv > 4096,
                                    spread=kv != 16384, device=f"NVIDIA H100{evil}"))
            if evil and kv == 8192:
                results[-1].details["host_behind"] = evil
    results += [
        Result("roundtrip", f"capability {evil}", "passed", impl="beta", label=f"fp8 x paged {evil}"),
        Result("roundtrip", "capability", "unsupported", impl=f"alpha{evil}", label=f"fp8 x paged {evil}",
               message=f"refused {evil}"),
        Result("placement", "hidden_cost", "passed", impl=f"beta{evil}", label=f"decode {evil}",
               metrics={name: 1.0 for name in COST_METRICS}),
        Result("placement", f"graph_safe{evil}", "failed", impl=f"beta{evil}", label=f"decode {evil}",
               message=f"run synced {evil}"),
        Result("metadata", f"max_qo_len{evil}", "error", label=f"varlen{evil}",
               message=f"Traceback (most recent call last):\n  File x\nValueError: {evil}"),
    ]
    return Run(environment={"gpu": f"NVIDIA H100{evil}", "torch": "2.11", "git_commit": evil},
               ceilings={f"NVIDIA H100{evil}": {"copy_gbps": 3000.0, "matmul_tflops": 700.0}},
               results=results, created=f"2026{evil}", command=["mla-bench", "run", evil])


TWO_GPU_CEILINGS = {H100: {"copy_gbps": 3000.0, "matmul_tflops": 700.0, "l2_bytes": 52428800},
                    H200: {"copy_gbps": 4400.0, "matmul_tflops": 800.0, "l2_bytes": 62914560}}


def two_gpu_run() -> Run:
    """A ``--devices 0,1`` run on a host of an H100 (GPU 0) and an H200 (GPU 1): the workloads sharded round robin,
    each latency result measured on its shard's GPU, the ceilings of both models."""
    results = [_latency(impl, kv, 0.01 * kv / 4096, device=(H100, H200)[i % 2])
               for i, kv in enumerate((4096, 8192, 16384, 32768)) for impl in ("alpha", "beta")]
    return Run(environment={"gpu": f"{H100} + {H200}"}, results=results, ceilings=TWO_GPU_CEILINGS)


def _point(r: Result) -> tuple[float, float]:
    """A latency result's roofline point: (FLOP/byte, TFLOP/s)."""
    return r.metrics["flops"] / r.metrics["bytes"], r.metrics["flops"] / (r.metrics["run_ms"] * 1e-3) / 1e12


class TagCollector(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.attrs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += [(tag, name, value) for name, value in attrs]


def test_crafted_results_file_injects_no_markup(tmp_path):
    run = rich_run(EVIL)
    run.devices = [Device(f"cuda:0{EVIL}", f"NVIDIA H100{EVIL}", f"9.0{EVIL}")]
    path = save_run(run, tmp_path / "evil.json")
    run = load_run(path)  # structurally valid: it is accepted, and must be rendered harmlessly
    page = render(run, all_plots(run))
    assert "<script" not in page.lower() and "<iframe" not in page.lower()
    parser = TagCollector()
    parser.feed(page)
    assert set(parser.tags) <= ALLOWED_TAGS, set(parser.tags) - ALLOWED_TAGS
    assert not [a for a in parser.attrs if a[1].startswith("on")]
    sources = [value for tag, name, value in parser.attrs if name == "src"]
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    # The strings are shown (escaped), not dropped.
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") > 10


def test_report_sections_and_png_files(tmp_path):
    target = write_report(rich_run(), tmp_path / "report.html")
    page = target.read_text()
    for heading in ("Environment", "Ceilings measured", "Pass/fail matrix", "Error heatmaps", "Latency, bandwidth",
                    "Impls side by side", "Capability matrix", "Hidden costs", "Replays of one plan",
                    "Failures and errors"):
        assert heading in page, heading
    replays = page[page.index("Replays of one plan"):page.index("Failures and errors")]
    assert re.findall(r"<td>([a-z]+)</td><td class=\"num\">(\d+)</td><td class=\"num\">(\d+)</td>", replays) == [
        ("alpha", "6", "4"), ("beta", "6", "0")]  # alpha's ctx512 and ctx4096 in both layouts differed
    pngs = sorted(p.name for p in tmp_path.glob("report-*.png"))
    assert pngs == ["report-errors-0.png", "report-errors-1.png", "report-latency.png", "report-roofline.png"]
    assert len(re.findall(r'src="data:image/png;base64,', page)) == len(pngs)
    assert "http://" not in page and "https://" not in page  # nothing to fetch: self-contained
    assert page.count("&middot; warm L2") == 2  # the ctx4096 cells, whose rotation stayed within the L2
    assert page.count(", spread 0.0") == 4  # not the ctx16384 cells: their results predate the spread
    assert page.count("host behind in 32 of 1000 samples") == 2  # the ctx8192 cells


def test_a_report_written_over_another_leaves_none_of_its_figures_beside_it(tmp_path):
    """Two runs into one folder: the first run's heatmap of an impl the second did not test, and its latency and
    roofline figures, stayed beside the second run's report as if they were its own. Others' PNGs stay."""
    first = rich_run()
    write_report(first, tmp_path / "report.html")
    kept = [tmp_path / "report-mine.png", tmp_path / "other-latency.png", tmp_path / "report-x-latency.png"]
    for path in kept:
        path.write_bytes(b"not ours")
    impl = random.choice(sorted({r.impl for r in first.results if r.suite == "accuracy"}))
    second = Run(environment=first.environment, ceilings=first.ceilings,
                 results=[r for r in first.results if r.suite == "accuracy" and r.impl == impl])
    write_report(second, tmp_path / "report.html")
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(["report-errors-0.png"] + [p.name for p in kept])
    assert all(p.read_bytes() == b"not ours" for p in kept)


def test_the_capability_matrix_puts_each_combination_on_one_row_across_impls(tmp_path):
    """The suite labels a cell "<impl>: <combination>": rows keyed by that label gave each impl rows of its own and
    '-' under every other impl, as if untested; the summary result was a cell of a "(bench)" column."""
    results = [Result("roundtrip", "capability", status, impl=impl, label=f"{impl}: decode / {layout}",
                      details={"row": "decode", "column": layout})
               for impl, layout, status in (("torch_eager", "bf16", "passed"), ("triton_decode", "bf16", "passed"),
                                            ("torch_eager", "fp8_ds_mla", "unsupported"),
                                            ("triton_decode", "fp8_ds_mla", "passed"))]
    results.append(Result("roundtrip", "capability matrix", "passed", label="capability matrix"))
    page = write_report(Run(environment={}, results=results), tmp_path / "r.html").read_text()
    matrix = page[page.index("<h2>Capability matrix</h2>"):].split("</table>")[0]
    rows = re.findall(r"<tr><td>([^<]*)</td>(.*?)</tr>", matrix)
    assert [(label, re.findall(r'class="(\w+)"', cells)) for label, cells in rows] == [
        ("decode / bf16", ["passed", "passed"]), ("decode / fp8_ds_mla", ["unsupported", "passed"])]
    assert "(bench)" not in matrix


def test_a_message_with_undecodable_path_bytes_writes_the_report(tmp_path):
    """A traceback naming a path that is not UTF-8 holds lone surrogates: writing the page raised
    UnicodeEncodeError and left an empty report.html."""
    path = os.fsdecode(b"/tmp/\xff")
    bad = Result("accuracy", "accuracy", "error", impl="x", label="w", message=f"File {path}")
    page = write_report(Run(environment={}, results=[bad]), tmp_path / "r.html").read_bytes().decode("utf-8")
    assert "/tmp/\\udcff" in page


def test_replays_count_a_nan_difference_as_the_largest(tmp_path):
    results = [Result("accuracy", "accuracy", "passed", impl="x", label=f"w{i}", metrics={"replay_max_abs": v})
               for i, v in enumerate((0.0, float("nan")))]
    page = write_report(Run(environment={}, results=results), tmp_path / "r.html").read_text()
    assert re.search(r"<td>x</td><td class=\"num\">2</td><td class=\"num\">1</td><td class=\"num\">nan", page)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PROBE = ("<script>window.addEventListener('load', () => { for (const img of document.images) "
         "img.setAttribute('data-natural-width', img.naturalWidth); "
         "document.body.setAttribute('data-images', document.images.length); });</script>")


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (apt-get install chromium)")
def test_report_renders_in_chromium_with_every_plot_loaded(tmp_path):
    report = write_report(rich_run(EVIL), tmp_path / "report.html")
    page = report.read_text()
    # The report forbids scripts (CSP); this copy drops the policy and adds a probe that records each image's size.
    probe = tmp_path / "probe.html"
    probe.write_text(re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", page).replace(
        "</body>", PROBE + "</body>"))
    flags = CHROMIUM_FLAGS + [f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000"]
    done = subprocess.run([_chromium(), *flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True,
                          timeout=120)
    widths = [int(w) for w in re.findall(r'data-natural-width="(\d+)"', done.stdout)]
    assert re.search(r'data-images="4"', done.stdout), done.stderr[-2000:]
    assert len(widths) == 4 and all(w > 100 for w in widths), widths
    assert done.stdout.count("<script") == 1 and "<iframe" not in done.stdout  # only the probe runs
    shot = tmp_path / "shot.png"
    subprocess.run([_chromium(), *flags, "--window-size=1400,3000", f"--screenshot={shot}", report.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 20_000


# ---- odd numbers and odd runs: a correct report or a visible gap, never a crash or a silently wrong figure ----------
def _figures(monkeypatch) -> list:
    """Capture the figures the plots render (their PNG bytes are not inspectable)."""
    import reports.plots as plots

    figures = []
    monkeypatch.setattr(plots, "_png", lambda fig: figures.append(fig) or b"png")
    return figures


@pytest.mark.parametrize("step", [1, 2])  # every result, or every other one (odd values among ordinary ones)
@pytest.mark.parametrize("metric", ["run_ms", "gbps", "bytes", "flops", "kernel.rel_l2"])
@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -1.0, 1e300])
def test_odd_metric_values_still_render(metric, value, step):
    run = rich_run()
    for r in [r for r in run.results if metric in r.metrics][::step]:
        r.metrics[metric] = value
    page = render(run, all_plots(run))
    assert "Latency, bandwidth" in page and "Error heatmaps" in page


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -5.0, 1e300])
def test_odd_ceilings_are_not_drawn(value):
    run = rich_run()
    run.ceilings = {H100: {"copy_gbps": value, "matmul_tflops": value}}
    assert _ceiling(run, H100, "copy_gbps") is None  # was drawn as "copy ceiling nan GB/s" (or crashed the roofline)
    render(run, all_plots(run))


def test_heatmap_writes_nan_and_zero_errors_visibly(monkeypatch):
    """A NaN error is the cell's worst (not lost to a finite one, not shown as 'no result'); uncoloured cells
    (NaN, 0) get dark text, not white on white."""
    figures = _figures(monkeypatch)
    run = rich_run()
    first = [r for r in run.results if r.suite == "accuracy" and r.impl == "alpha"]
    first[0].metrics["kernel.rel_l2"] = 0.0
    first[1].metrics["kernel.rel_l2"] = math.nan
    twin = Result(**{**vars(first[1]), "metrics": {"kernel.rel_l2": 0.5}})  # same cell, finite, after the NaN
    run.results.append(twin)
    error_heatmaps(run)
    texts = {t.get_text(): t.get_color() for t in figures[0].axes[0].texts}
    assert texts["nan"] == "black" and texts["0.0e+00"] == "black"
    assert "5.0e-01" not in texts


def test_latency_figures_say_what_they_leave_out(monkeypatch):
    figures = _figures(monkeypatch)
    run = rich_run()
    latency = [r for r in run.results if r.suite == "latency"]
    latency[0].metrics["run_ms"] = math.nan
    latency[1].metrics["flops"] = 0
    all_plots(run)
    notes = {fig.get_suptitle() for fig in figures}
    assert "1 passed latency result(s) not drawn: no positive finite median or context" in notes
    assert any(n.startswith("2 passed latency result(s) not drawn") for n in notes)  # the roofline


def test_roofline_title_says_when_impls_are_left_out(monkeypatch):
    figures = _figures(monkeypatch)
    run = Run(environment={}, results=[_latency(f"impl{i:02}", 4096, 0.01) for i in range(MAX_IMPLS_PER_FIGURE + 3)])
    roofline(run)
    assert f"first {MAX_IMPLS_PER_FIGURE} of {MAX_IMPLS_PER_FIGURE + 3} impls" in figures[0].axes[0].get_title()


def test_each_latency_result_is_on_the_roofline_of_its_own_gpu_model():
    """The roofline drew every result of a run over an H100 and an H200 under the H100's ceilings (the first in the
    file): each model now has its panel, its own ceilings and only the results measured on it. A result naming a
    model the run measured no ceilings for, or none, is drawn under no other model's roofline."""
    run = two_gpu_run()
    run.results += [_latency("alpha", 1024, 0.005, device="NVIDIA B200"), _latency("beta", 1024, 0.005)]
    del run.results[-1].details["device"]
    panels = roofline_panels(run)
    assert [(p.model, p.copy_gbps, p.matmul_tflops) for p in panels] == [
        ("NVIDIA B200", None, None), (H100, 3000.0, 700.0), (H200, 4400.0, 800.0), (None, None, None)]
    for panel in panels:
        mine = [r for r in run.results if r.details.get("device") == panel.model]
        assert panel.points == {impl: [_point(r) for r in mine if r.impl == impl] for impl in {r.impl for r in mine}}
    assert sum(len(points) for points in panels[1].points.values()) == 4


def test_the_roofline_figure_draws_a_panel_per_gpu_model_under_its_own_ceilings(monkeypatch):
    figures = _figures(monkeypatch)
    run = two_gpu_run()
    roofline(run)
    axes = figures[0].axes
    assert [ax.get_title() for ax in axes] == [f"Roofline of {H100} (ceilings measured in this run)",
                                               f"Roofline of {H200} (ceilings measured in this run)"]
    for ax, model in zip(axes, (H100, H200)):
        top = max(ax.lines[0].get_ydata())  # the roofline's flat part: the model's matmul rate
        assert top == TWO_GPU_CEILINGS[model]["matmul_tflops"]
        drawn = sorted(tuple(xy) for c in ax.collections for xy in c.get_offsets())
        assert drawn == sorted(_point(r) for r in run.results if r.details["device"] == model)


def test_latency_lines_and_copy_ceilings_are_split_by_gpu_model(monkeypatch):
    """A line's workloads are sharded over the GPUs: one line joined H100 and H200 points, under the H100's copy
    ceiling only."""
    figures = _figures(monkeypatch)
    latency_plots(two_gpu_run())
    bottom = figures[0].axes[1]
    lines = {line.get_label(): list(line.get_xdata()) for line in bottom.lines}
    assert lines == {f"alpha b2 bf16 ps64 on {H100}": [4096, 16384], f"alpha b2 bf16 ps64 on {H200}": [8192, 32768],
                     f"beta b2 bf16 ps64 on {H100}": [4096, 16384], f"beta b2 bf16 ps64 on {H200}": [8192, 32768],
                     f"copy ceiling of {H100} 3000 GB/s": [0, 1], f"copy ceiling of {H200} 4400 GB/s": [0, 1]}
    ceilings = {line.get_label(): line.get_ydata()[0] for line in bottom.lines if "ceiling" in line.get_label()}
    assert sorted(ceilings.values()) == [3000.0, 4400.0]


def test_a_long_line_name_keeps_its_gpu_model_in_the_legend(monkeypatch):
    """Labels are cut to 60 characters: cut whole, "<impl> b2 <layout> ps64 on <GPU>" of a long name lost its GPU, and
    its lines on the two GPUs read alike."""
    figures = _figures(monkeypatch)
    run = two_gpu_run()
    long = "triton_chunked_prefill_with_a_much_longer_name_x"
    for r in run.results:
        r.impl = long if r.impl == "alpha" else r.impl
    latency_plots(run)
    labels = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    cut = f"{long} b2 bf16 ps64"[:57] + "..."
    assert labels == [f"beta b2 bf16 ps64 on {H100}", f"beta b2 bf16 ps64 on {H200}", f"{cut} on {H100}",
                      f"{cut} on {H200}"]


def test_an_impl_named_with_a_leading_underscore_is_in_every_legend(monkeypatch):
    """matplotlib's automatic legend leaves out labels starting with "_": the lines and points of an impl named
    "_mine" were drawn, and named in no legend."""
    figures = _figures(monkeypatch)
    run = Run(environment={}, ceilings={H100: {"copy_gbps": 3000.0, "matmul_tflops": 700.0}},
              results=[_latency(impl, kv, 0.01 * kv / 4096) for impl in ("_mine", "beta") for kv in (4096, 8192)])
    latency_plots(run)
    roofline(run)
    legends = [[t.get_text() for t in ax.get_legend().get_texts()] for fig in figures for ax in fig.axes]
    assert legends == [["_mine b2 bf16 ps64", "beta b2 bf16 ps64"],
                       ["_mine b2 bf16 ps64", "beta b2 bf16 ps64", "copy ceiling 3000 GB/s"],
                       ["roofline: copy 3000 GB/s, bf16 matmul 700 TFLOP/s", "_mine", "beta"]]


def test_the_report_lists_the_devices_and_names_the_gpu_of_each_latency_result_of_a_mixed_run():
    run = two_gpu_run()
    run.devices = [Device("cuda:0", H100, "9.0"), Device("cuda:1", H200, "9.0")]
    page = render(run, [])
    devices = page[page.index("<h3>Devices that ran this run</h3>"):].split("</table>")[0]
    assert re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td></tr>", devices) == [
        ("cuda:0", H100, "9.0"), ("cuda:1", H200, "9.0")]
    assert page.count(f"<br>on {H100}</td>") == page.count(f"<br>on {H200}</td>") == 4
    assert "<br>on " not in render(rich_run(), [])  # one model: the environment says it


def test_hidden_cost_row_without_its_metrics():
    rows = hidden_cost_rows([Result("placement", "hidden_cost", "passed", impl="x", label="w")])
    assert rows[0][:4] == ["x", "w", "passed", "nan"]


@pytest.mark.parametrize("results, verdict", [
    ([], "this run has no results"),
    ([Result("latency", "latency", "unsupported", impl="x", message="no CUDA")] * 2,
     "nothing was tested: all 2 results are unsupported"),
])
def test_a_run_that_tested_nothing_does_not_read_as_passed(results, verdict):
    assert f"<b>{verdict}</b>" in render(Run(environment={}, results=results), [])


def _printed(renderable) -> str:
    out = io.StringIO()
    Console(file=out, width=400, force_terminal=False).print(renderable)
    return out.getvalue()


def test_compare_withholds_latency_changes_across_gpus_and_odd_ratios():
    a, b = rich_run(), rich_run()
    b.environment["gpu"] = "NVIDIA H200"
    acc_b = [r for r in b.results if r.suite == "accuracy"]
    acc_b[0].metrics["kernel.rel_l2"] = math.nan
    [r for r in a.results if r.suite == "accuracy"][1].metrics["kernel.rel_l2"] = -1.0
    lines = _printed(compare_table(a, b)).splitlines()
    latency = [line for line in lines if "│ latency" in line]
    assert latency and all("other GPU" in line and "%" not in line for line in latency)
    assert any("latency change(s) not shown: A ran on GPU 'NVIDIA H100" in line for line in lines)
    accuracy = [line for line in lines if "│ accuracy" in line]
    assert "nan" in accuracy[0] and "%" not in accuracy[0]  # was "+nan%"
    assert "%" not in accuracy[1]  # A negative: no meaningful ratio


def test_compare_names_the_check_and_notes_duplicates():
    run = rich_run()
    run.results.append(run.results[0])
    text = _printed(compare_table(run, rich_run()))
    assert "placement: graph_safe" in text  # several checks of one workload were indistinguishable rows
    assert "A has 1 key(s) shared by several results" in text


def test_console_tables_send_no_terminal_escapes():
    evil = "\x1b[2J\x1b]0;owned\x07[bold red]x[/]"
    run = rich_run(evil)
    for r in run.results:
        r.status = "failed"
    findings = [Finding("new failure", evil, evil, evil, evil, True)]
    for table in (compare_table(run, rich_run(), title=f"a{evil}.json -> b.json"), failures_table(run),
                  summary_table(run), gate_table(findings), hidden_cost_table(run.results)):
        text = _printed(table)
        assert "\x1b" not in text and "\\x1b[2J" in text and "[bold red]x[/]" in text


def test_names_with_undecodable_bytes_are_drawn_escaped(tmp_path, monkeypatch):
    """A name holding lone surrogates (bytes that are not UTF-8, as ``os.fsdecode`` gives them) made matplotlib's text
    layout raise TypeError: no figure, no report."""
    run = rich_run(os.fsdecode(b"\xff"))
    write_report(run, tmp_path / "r.html")
    assert sorted(p.name for p in tmp_path.glob("r-*.png")) == ["r-errors-0.png", "r-errors-1.png", "r-latency.png",
                                                                "r-roofline.png"]
    figures = _figures(monkeypatch)
    latency_plots(run)
    assert "alpha\\udcff b2 bf16 ps64" in [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]


def test_the_titles_of_an_error_heatmap_do_not_overlap(monkeypatch):
    """Each panel's title named the impl: for triton_chunked_prefill (the GPU baselines) the two titles ran into
    each other."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figures = _figures(monkeypatch)
    error_heatmaps(Run(environment={}, results=[
        Result("accuracy", "accuracy", "passed", impl="triton_chunked_prefill", workload=_workload(kv), label="w",
               metrics={"kernel.rel_l2": 1e-3, "e2e.rel_l2": 2e-3}) for kv in (64, 4096)]))
    canvas = FigureCanvasAgg(figures[0])
    canvas.draw()
    left, right = (ax.title.get_window_extent(canvas.get_renderer()) for ax in figures[0].axes[:2])
    assert left.x1 < right.x0
    titles = [figures[0].get_suptitle(), *(ax.get_title() for ax in figures[0].axes)]
    assert any("triton_chunked_prefill" in title for title in titles)
