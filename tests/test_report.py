"""The HTML report: self-contained, every plot present, nothing from a results file becomes markup, and it
renders in headless Chromium with every plot loaded."""

from __future__ import annotations

import html.parser
import re
import shutil
import subprocess

import pytest

from mla_bench.hidden_costs import COST_METRICS
from mla_bench.results import Result, Run, load_run, save_run
from reports.html import render, write_report
from reports.plots import all_plots

EVIL = '<script>alert(1)</script>"><img src=x onerror=alert(2)><iframe src="http://evil.example/">$\\alpha$'
ALLOWED_TAGS = {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "p", "code", "b", "table", "tr",
                "th", "td", "thead", "tbody", "caption", "figure", "img", "details", "summary", "pre", "br"}


def _workload(kv: int, layout: str = "bf16", batch: int = 2, mode: str = "decode", preset: str = "tiny") -> dict:
    return {"mode": mode, "q_lens": [1] * batch, "kv_lens": [kv] * batch, "preset": preset, "num_heads": None,
            "layout": layout, "page_size": 64, "dtype": "bfloat16", "topk": None, "index_transform": None,
            "dcp_world": 1, "dcp_interleave": 1, "chunk_size": None, "seed": 0}


def _latency(impl: str, kv: int, ms: float, batch: int = 2, cold_l2: bool = True) -> Result:
    w = _workload(kv, batch=batch, preset="deepseek-v3-tp8")
    nbytes, flops = 1152 * kv * batch, 2 * 16 * 1088 * kv * batch
    return Result("latency", "latency", "passed", impl=impl, workload=w, label=f"decode b{batch} ctx{kv}",
                  metrics={"run_ms": ms, "run_ms_iqr": ms / 50, "plan_ms": 0.05, "bytes": nbytes, "flops": flops,
                           "gbps": nbytes / ms / 1e6, "tflops": flops / ms / 1e9, "copy_fraction": 0.5,
                           "matmul_fraction": 0.1},
                  details={"timer": "cuda_graph", "cold_l2": cold_l2})


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
                                      metrics={"kernel.rel_l2": 1e-3 * kv ** 0.3, "e2e.rel_l2": 2e-3 * kv ** 0.3}))
        for kv in (4096, 8192, 16384):
            results.append(_latency(impl, kv, 0.01 * kv / 4096 * (2 if impl == "beta" else 1), cold_l2=kv > 4096))
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


class TagCollector(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.attrs = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += [(tag, name, value) for name, value in attrs]


def test_crafted_results_file_injects_no_markup(tmp_path):
    path = save_run(rich_run(EVIL), tmp_path / "evil.json")
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
                    "Impls side by side", "Capability matrix", "Hidden costs", "Failures and errors"):
        assert heading in page, heading
    pngs = sorted(p.name for p in tmp_path.glob("report-*.png"))
    assert pngs == ["report-errors-0.png", "report-errors-1.png", "report-latency.png", "report-roofline.png"]
    assert len(re.findall(r'src="data:image/png;base64,', page)) == len(pngs)
    assert "http://" not in page and "https://" not in page  # nothing to fetch: self-contained
    assert page.count("&middot; warm L2") == 2  # the ctx4096 cells, whose rotation stayed within the L2


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
