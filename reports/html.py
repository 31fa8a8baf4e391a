"""One self-contained HTML report of a run: environment, the devices that ran it, ceilings, pass/fail matrices, error
heatmaps, latency and bandwidth with the roofline, impls side by side, the capability matrix, the hidden-cost table
and how each impl's plans replay.

A results file may come from anyone: every string taken from it goes through ``html.escape`` (text and
attributes), images are PNGs this module renders (embedded as base64 and also written beside the report), and
a Content-Security-Policy forbids scripts and any non-inline resource, so even a missed escape could not run
code or fetch anything.
"""

from __future__ import annotations

import base64
import glob
import html
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable

from mla_bench.results import STATUSES, Result, Run
from reports.gate import BAD
from reports.hidden_costs import hidden_cost_html
from reports.limits import REPORT_ROWS
from reports.pairing import measured_on
from reports.plots import PLOT_NAME, Plot, all_plots, layout_name

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
SHORT = {"passed": "pass", "failed": "FAIL", "unsupported": "n/a", "error": "ERROR"}
STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.passed { background: #c8ecc8; } .failed { background: #f7b6b6; font-weight: bold; }
.unsupported { background: #eeeeee; color: #777; } .error { background: #e05555; color: white; font-weight: bold; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.4em 0; }
pre { background: #f6f6f6; padding: 0.5em; overflow-x: auto; font-size: 0.8em; white-space: pre-wrap; }
.muted { color: #777; }
"""


def esc(value: object) -> str:
    """Text or attribute content from a results file, escaped."""
    return html.escape(str(value), quote=True)


def write_report(run: Run, path: str | Path, rows: int = REPORT_ROWS) -> Path:
    """Render the report to ``path``; each plot is also written as ``<stem>-<plot>.png`` beside it, and the PNGs of
    an earlier report at ``path`` that this one does not draw are removed (a second run into one ``--out`` folder
    left the first run's heatmaps and latency figures beside the second's report). ``rows``: see ``render``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plots = all_plots(run)
    written = {f"{path.stem}-{plot.name}.png" for plot in plots}
    for old in path.parent.glob(f"{glob.escape(path.stem)}-*.png"):
        if old.name not in written and PLOT_NAME.fullmatch(old.name[len(path.stem) + 1:-len(".png")]):
            old.unlink()
    for plot in plots:
        path.with_name(f"{path.stem}-{plot.name}.png").write_bytes(plot.png)
    # utf-8 as the page declares; a traceback's undecodable path bytes (lone surrogates) written escaped
    path.write_text(render(run, plots, rows), encoding="utf-8", errors="backslashreplace")
    return path


def render(run: Run, plots: list[Plot], rows: int = REPORT_ROWS) -> str:
    """The report's HTML; a pass/fail matrix or latency table of more than ``rows`` workloads is summarized (0:
    never)."""
    named = {p.name: p for p in plots}
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        "<title>mla-bench report</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>mla-bench report</h1>",
        f'<p class="muted">created {esc(run.created)} &middot; command <code>{esc(" ".join(run.command))}</code></p>',
        _summary(run),
        _environment(run),
    ]
    parts += _matrices(run, rows or len(run.results))
    parts.append(_bench_checks(run))
    heatmaps = [p for p in plots if p.name.startswith("errors-")]
    if heatmaps:
        parts.append("<h2>Error heatmaps (layout x context)</h2>")
        parts += [_img(p) for p in heatmaps]
    parts.append(_latency(run, [named[n] for n in ("latency", "roofline") if n in named], rows or len(run.results)))
    parts.append(_capability_matrix(run))
    parts.append(_hidden_costs(run))
    parts.append(_replays(run))
    parts.append(_failures(run))
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)


def _img(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    return f'<figure><img alt="{esc(plot.title)}" src="data:image/png;base64,{data}"></figure>'


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    """A table whose cells are already HTML (callers escape what they take from the results)."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell if cell.startswith("<td") else f"<td>{cell}</td>" for cell in row)
                   + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _status_cell(result: Result | None) -> str:
    if result is None:
        return '<td class="muted">-</td>'
    return f'<td class="{esc(result.status)}" title="{esc(result.brief)}">{SHORT[result.status]}</td>'


def _num(value: object) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    else:
        text = str(value)
    return f'<td class="num">{esc(text)}</td>'


# ---- sections ------------------------------------------------------------------------------------------------------
def _summary(run: Run) -> str:
    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for r in run.results:
        counts[(r.suite, r.impl or "(bench)")][r.status] += 1
    rows = [[esc(suite), esc(impl)] + [_num(count[s]) if not count[s] else f'<td class="{s} num">{count[s]}</td>'
                                      for s in STATUSES] for (suite, impl), count in sorted(counts.items())]
    return f"<h2>Summary</h2><p><b>{_verdict(run)}</b></p>" + _table(["suite", "impl", *STATUSES], rows)


def _verdict(run: Run) -> str:
    """The run in one phrase; a run that tested nothing does not read as passed."""
    if not run.results:
        return "this run has no results"
    if not run.ok:
        return "some checks FAILED or errored"
    if all(r.status == "unsupported" for r in run.results):
        return f"nothing was tested: all {len(run.results)} results are unsupported"
    return "all supported checks passed"


def _environment(run: Run) -> str:
    rows = [[esc(k), esc(v)] for k, v in run.environment.items()]
    out = "<h2>Environment</h2>" + _table(["", "value"], rows)
    if run.devices:
        drow = [[esc(d.id), esc(d.name or "-"), esc(d.compute_capability or "-")] for d in run.devices]
        out += "<h3>Devices that ran this run</h3>" + _table(["device", "model", "compute capability"], drow)
    if run.ceilings:
        crow = [[esc(model), _num(c.get("copy_gbps", "")), _num(c.get("matmul_tflops", "")),
                 _num(c.get("l2_bytes", ""))] for model, c in run.ceilings.items()]
        out += "<h3>Ceilings measured in this run</h3>" + _table(
            ["model", "copy GB/s (read + write)", "bf16 matmul TFLOP/s", "L2 bytes"], crow)
    return out


def _matrices(run: Run, limit: int) -> list[str]:
    """A pass/fail matrix (workload x impl) per suite and check, for results that name an impl; one of more than
    ``limit`` workloads is summarized (``_summarized_matrix``)."""
    groups: dict[tuple[str, str], list[Result]] = defaultdict(list)
    for r in run.results:
        if r.impl and "capab" not in r.check.lower():
            groups[(r.suite, r.check)].append(r)
    if not groups:
        return []
    out = ["<h2>Pass/fail matrix (impl x workload)</h2>",
           '<p class="muted">hover a cell for its message; pass / FAIL / n/a (unsupported) / ERROR</p>']
    for (suite, check), results in sorted(groups.items()):
        impls = sorted({r.impl for r in results})
        rows = _by_label(results)
        title = esc(suite) if suite == check else f"{esc(suite)}: {esc(check)}"
        table = _matrix(rows, impls) if len(rows) <= limit else _summarized_matrix(rows, impls)
        out.append(f"<h3>{title}</h3>" + table)
    return out


def _by_label(results: list[Result]) -> dict[str, dict[str, Result]]:
    """Results by workload label (in run order) and impl; a later duplicate wins."""
    rows: dict[str, dict[str, Result]] = defaultdict(dict)
    for r in results:
        rows[r.label][r.impl or "(bench)"] = r
    return rows


def _matrix(rows: dict[str, dict[str, Result]], impls: list[str], first: str = "workload") -> str:
    """A row per label, a status cell per impl."""
    return _table([first, *[esc(i) for i in impls]],
                  [[esc(label)] + [_status_cell(cells.get(impl)) for impl in impls] for label, cells in rows.items()])


def _summarized_matrix(rows: dict[str, dict[str, Result]], impls: list[str]) -> str:
    """A matrix too long to read: every workload with a failure or error in full, the others (all passed or
    unsupported) as counts per impl for each mode and layout, so the page stays small and no failure is hidden."""
    failing = {label: cells for label, cells in rows.items() if any(r.status in BAD for r in cells.values())}
    counts: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    sizes: Counter = Counter()
    for label, cells in rows.items():
        if label not in failing:
            group = _group_name(next(iter(cells.values())))
            sizes[group] += 1
            for impl, r in cells.items():
                counts[group][impl][r.status] += 1
    out = (f"<p>{len(failing)} of {len(rows)} workloads have a failure or error: "
           + ("each is shown in full, then " if failing else "")
           + f"the other {len(rows) - len(failing)} (every result passed or unsupported) are counted per mode and "
           "layout.</p>")
    if failing:
        out += _matrix(failing, impls)
    body = [[esc(group), _num(sizes[group])] + [_count_cell(counts[group].get(impl)) for impl in impls]
            for group in sorted(counts)]
    return out + _table(["mode and layout", "workloads", *[esc(i) for i in impls]], body)


def _group_name(result: Result) -> str:
    """The mode and cache layout of a result's workload, which the summarized matrix counts its workloads by."""
    if not isinstance(result.workload, dict):
        return "(no workload)"
    return f"{result.workload.get('mode', '?')} {layout_name(result)}"


def _count_cell(counts: Counter | None) -> str:
    """How many of a group's workloads an impl passed or did not support."""
    if not counts:
        return '<td class="muted">-</td>'
    text = " &middot; ".join(f"{counts[s]} {SHORT[s]}" for s in STATUSES if counts[s])
    return f'<td class="{"passed" if counts["passed"] else "unsupported"} num">{text}</td>'


def _bench_checks(run: Run) -> str:
    """Checks of the bench's own parts (no impl): codecs, metadata builders."""
    results = [r for r in run.results if not r.impl]
    if not results:
        return ""
    rows = [[esc(r.suite), esc(r.check), esc(r.label), _status_cell(r), esc(r.brief)] for r in results]
    return "<h2>Checks of the bench's own parts</h2>" + _table(["suite", "check", "what", "status", "message"], rows)


def _latency(run: Run, plots: list[Plot], limit: int) -> str:
    results = [r for r in run.results if r.suite == "latency" and r.impl and r.status == "passed"]
    if not results:
        notes = {r.brief for r in run.results if r.suite == "latency"}
        return ("<h2>Latency</h2><p class='muted'>" + esc("; ".join(sorted(notes))) + "</p>") if notes else ""
    impls = sorted({r.impl for r in results})
    rows = _by_label(results)
    out = "<h2>Latency, bandwidth and the roofline</h2>" + "".join(_img(p) for p in plots)
    out += ("<h3>Impls side by side</h3><p class='muted'>median run time &plusmn; IQR, the spread of the medians of "
            "its slices, bandwidth and compute as a fraction of the ceilings of its GPU measured in this run, plan "
            "time, timer; \"warm L2\" where the workload is so small that its rotating input sets stay within a few "
            "times the L2; the GPU where the run had several models</p>")
    if len(rows) > limit:
        shown = set(sorted(rows, key=lambda label: -len(rows[label]))[:limit])
        out += (f"<p>the {limit} of {len(rows)} workloads timed on the most impls (--rows); the run file holds every "
                "number</p>")
        rows = {label: cells for label, cells in rows.items() if label in shown}
    several = len({measured_on(r) for r in results}) > 1
    body = [[esc(label)] + [_latency_cell(cells.get(impl), several) for impl in impls]
            for label, cells in rows.items()]
    return out + _table(["workload", *[esc(i) for i in impls]], body)


def _latency_cell(r: Result | None, several: bool) -> str:
    """A latency result's median and IQR, bandwidth, compute, plan time and timer (and how many samples the host
    may have enqueued late: those can include the host's time), and the GPU model it ran on where the run's latency
    results span ``several``."""
    if r is None:
        return '<td class="muted">-</td>'
    m = r.metrics
    spread = f", spread {m['run_ms_spread']:.2g}" if "run_ms_spread" in m else ""  # older run files lack it
    text = (f"{m.get('run_ms', float('nan')):.4g} ms &plusmn; {m.get('run_ms_iqr', float('nan')):.2g}{spread}<br>"
            f"{m.get('gbps', float('nan')):.0f} GB/s ({m.get('copy_fraction', float('nan')):.0%} of copy)<br>"
            f"{m.get('tflops', float('nan')):.1f} TFLOP/s ({m.get('matmul_fraction', float('nan')):.0%})<br>"
            f"plan {m.get('plan_ms', float('nan')):.3g} ms &middot; {esc(r.details.get('timer', ''))}"
            + (" &middot; warm L2" if r.details.get("cold_l2") is False else "")
            + (f" &middot; host behind in {esc(r.details['host_behind'])} of {esc(m.get('iterations', '?'))} samples"
               if r.details.get("host_behind") else "")
            + (f"<br>on {esc(measured_on(r) or '(GPU not recorded)')}" if several else ""))
    return f'<td class="num">{text}</td>'


def _capability_matrix(run: Run) -> str:
    """Results whose check names a capability: which (layout, transform, op) each impl accepts or refuses. A row per
    combination: the suite labels a cell ``"<impl>: <combination>"``, so the impl's name is taken off (rows keyed by
    the whole label put each impl on rows of its own); the matrix's summary result is no cell."""
    rows: dict[str, dict[str, Result]] = defaultdict(dict)
    for r in run.results:
        if "capab" in r.check.lower() and r.check != "capability matrix":
            impl = r.impl or "(bench)"
            rows[r.label.removeprefix(f"{impl}: ")][impl] = r
    if not rows:
        return ""
    impls = sorted({impl for cells in rows.values() for impl in cells})
    return "<h2>Capability matrix</h2>" + _matrix(rows, impls, "combination")


def _hidden_costs(run: Run) -> str:
    """The placement suite's hidden-cost table (plan and run time, launches, copies, syncs, allocations)."""
    table = hidden_cost_html(run.results)
    return "<h2>Hidden costs (placement)</h2>" + table if table else ""


def _replays(run: Run) -> str:
    """Per impl: how many judged plans gave other values on their second run (``replay_max_abs``, see
    ``suites.judge``), and the largest difference: 0 of N is an impl deterministic run to run."""
    judged: dict[str, list[float]] = defaultdict(list)
    for r in run.results:
        if "replay_max_abs" in r.metrics:
            judged[r.impl or "(bench)"].append(r.metrics["replay_max_abs"])
    rows = [[esc(impl), _num(len(values)), _num(sum(v != 0 for v in values)),
             _num(max(values, key=lambda v: math.inf if math.isnan(v) else v))]  # NaN: differs, as the judge says
            for impl, values in sorted(judged.items())]
    return ("<h2>Replays of one plan (run to run)</h2>"
            + _table(["impl", "plans run twice", "second run differed", "largest difference"], rows)) if rows else ""


def _failures(run: Run) -> str:
    bad = [r for r in run.results if r.status in BAD]
    if not bad:
        return ""
    items = [f"<details><summary>{esc(r.status)} &middot; {esc(r.suite)} &middot; {esc(r.impl or '(bench)')} "
             f"&middot; {esc(r.label)}: {esc(r.brief)}</summary><pre>{esc(r.message)}</pre></details>" for r in bad]
    return f"<h2>Failures and errors ({len(bad)})</h2>" + "".join(items)
