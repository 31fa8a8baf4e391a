"""The report's figures (matplotlib, rendered to PNG bytes): error heatmaps, latency and bandwidth against
context length with the copy ceiling, and the roofline.

A run's GPUs may be of several models (``--devices``): each latency result is drawn against the ceilings of the
model it was measured on (``measured_on``), the latency lines and the roofline split by model.

Figures are built with ``matplotlib.figure.Figure`` (no pyplot, no global backend). Labels come from results
files: ``_text`` escapes ``$`` so a crafted name is drawn as typed, never parsed as math text. Numbers too:
a value a log axis cannot draw (NaN, inf, <= 0, outside ``LOG_RANGE``) is written uncoloured in its heatmap cell,
a latency result with no drawable point is counted in its figure's note, and a bandwidth that cannot be drawn
leaves a gap in its line: none is drawn as another value. A panel of many lines draws those of most points and its
title says how many it left out.
"""

from __future__ import annotations

import io
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import matplotlib
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from mla_bench.results import Result, Run
from reports.pairing import measured_on

MAX_IMPLS_PER_FIGURE = 12  # impls a roofline panel draws
LOG_RANGE = (1e-200, 1e200)  # matplotlib's log-axis ticks overflow near the ends of the float range
PLOT_NAME = re.compile(r"errors-\d+|latency|roofline")  # every Plot.name this module makes


@dataclass
class Plot:
    name: str   # file-name part, made by this module (never from the results file): one PLOT_NAME matches
    title: str
    png: bytes


def all_plots(run: Run) -> list[Plot]:
    with matplotlib.rc_context({"font.size": 9}):
        return error_heatmaps(run) + latency_plots(run) + roofline(run)


def _text(value: object, limit: int = 60) -> str:
    """A string from a results file, safe for matplotlib (``$`` would start math text, a lone surrogate of bytes that
    are not UTF-8 fails its text layout) and cut to ``limit``."""
    text = str(value).encode("utf-8", "backslashreplace").decode("utf-8")
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return text.replace("$", r"\$")


def _loggable(value: float | None) -> bool:
    """A number a log axis can draw: positive, within ``LOG_RANGE`` (not None, NaN, inf, 0, negative, 1e300)."""
    return value is not None and LOG_RANGE[0] <= value <= LOG_RANGE[1]


def _worst(old: float | None, new: float) -> float:
    """The worse of two errors of one cell (``old`` None while it is empty); NaN is the worst."""
    if old is None:
        return new
    return math.nan if math.isnan(old) or math.isnan(new) else max(old, new)


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def _workload(result: Result) -> dict:
    return result.workload if isinstance(result.workload, dict) else {}


def _context(result: Result) -> int | None:
    """The longest context of the result's workload."""
    kv = _workload(result).get("kv_lens")
    if isinstance(kv, list) and kv and all(isinstance(k, int) and not isinstance(k, bool) for k in kv):
        return max(kv)
    return None


def layout_name(result: Result) -> str:
    """The cache layout of the result's workload, "(no cache)" for prefill (its keys are plain tensors)."""
    w = _workload(result)
    return str(w.get("layout", "?")) if w.get("mode") != "prefill" else "(no cache)"


# ---- accuracy ------------------------------------------------------------------------------------------------------
def error_heatmaps(run: Run) -> list[Plot]:
    """Per impl: the worst kernel and end-to-end relative L2 error per (layout, context length)."""
    by_impl: dict[str, list[Result]] = defaultdict(list)
    for r in run.results:
        if r.suite == "accuracy" and r.impl and "kernel.rel_l2" in r.metrics and _context(r) is not None:
            by_impl[r.impl].append(r)
    plots = []
    for index, (impl, results) in enumerate(sorted(by_impl.items())):
        layouts = sorted({layout_name(r) for r in results})
        contexts = sorted({_context(r) for r in results})
        row_of, col_of = {name: i for i, name in enumerate(layouts)}, {c: j for j, c in enumerate(contexts)}
        widest = max(len(_text(name)) for name in layouts)
        fig = Figure(figsize=(max(9.0, 1.2 * len(contexts) * 2 + 0.14 * widest), 2.5 + 0.4 * len(layouts)),
                     layout="constrained")
        axes = fig.subplots(1, 2, squeeze=True)
        for ax, kind in zip(axes, ("kernel", "e2e")):
            grid: list[list[float | None]] = [[None] * len(contexts) for _ in layouts]
            failed = set()
            for r in results:
                value = r.metrics.get(f"{kind}.rel_l2")
                if value is None:
                    continue
                cell = (row_of[layout_name(r)], col_of[_context(r)])
                grid[cell[0]][cell[1]] = _worst(grid[cell[0]][cell[1]], value)
                if r.status == "failed":
                    failed.add(cell)
            _heatmap(ax, grid, layouts, contexts, failed)
            ax.set_title(f"{kind} relative L2 error (worst per cell)")
            ax.set_xlabel("longest context in the workload")
        fig.suptitle(_text(impl))  # not in each panel's title: a long name ran the two titles together
        plots.append(Plot(f"errors-{index}", f"Error heatmap: {impl}", _png(fig)))
    return plots


def _heatmap(ax, grid: list[list[float | None]], rows: list[str], cols: list[int], failed: set) -> None:
    """Colour the loggable errors; write every value in its cell (NaN, inf, 0 and negatives uncoloured)."""
    finite = [v for row in grid for v in row if _loggable(v)]
    low, high = (min(finite), max(finite)) if finite else (1e-8, 1.0)
    if high <= low:
        high = low * 10
    shown = [[v if _loggable(v) else math.nan for v in row] for row in grid]
    norm = LogNorm(vmin=low, vmax=high)
    ax.imshow(shown, aspect="auto", cmap="viridis", norm=norm)
    ax.set_xticks(range(len(cols)), [str(c) for c in cols], rotation=45)
    ax.set_yticks(range(len(rows)), [_text(r) for r in rows])
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if value is None:
                continue
            text = f"{value:.1e}" + (" FAIL" if (i, j) in failed else "")
            dark = not _loggable(value) or float(norm(value)) > 0.55  # a blank cell, or viridis' yellow end
            ax.text(j, i, text, ha="center", va="center", fontsize=7,
                    color="red" if (i, j) in failed else ("black" if dark else "white"),
                    fontweight="bold" if (i, j) in failed else "normal")


# ---- latency -------------------------------------------------------------------------------------------------------
def _passed_latency(run: Run) -> list[Result]:
    return [r for r in run.results if r.suite == "latency" and r.status == "passed" and r.impl]


def _latency_results(run: Run) -> list[Result]:
    """The passed latency results a log-log plot can draw: a loggable median and context."""
    return [r for r in _passed_latency(run) if _loggable(r.metrics.get("run_ms")) and _loggable(_context(r))]


def _note_left_out(fig: Figure, left_out: int, why: str) -> None:
    """Say in the figure how many passed latency results it does not draw: a silent gap would read as complete."""
    if left_out:
        fig.suptitle(f"{left_out} passed latency result(s) not drawn: {why}", color="firebrick")


def _series_key(r: Result, by_model: bool) -> tuple[str, tuple[str, str | None]]:
    """(panel, line): a panel per mode and preset (and head override), a line per impl, batch, layout, page, and GPU
    model where ``by_model`` (a run over several: one line's workloads are sharded over its GPUs)."""
    w = _workload(r)
    panel = f"{w.get('mode', '?')} {w.get('preset', '?')}" + (f" h{w['num_heads']}" if w.get("num_heads") else "")
    line = f"{r.impl} b{len(w.get('kv_lens') or [])} {layout_name(r)} ps{w.get('page_size', '?')}"
    return panel, (line, measured_on(r) if by_model else None)


def _line_label(line: tuple[str, str | None]) -> str:
    """A line's legend entry, its GPU model cut apart from the rest: one cut whole could drop the model, and two
    lines of one impl on two GPUs would read alike."""
    name, model = line
    return _text(name) + (f" on {_text(model, 40)}" if model is not None else "")


PANELS_PER_ROW = 3  # panels (mode x preset) side by side before the figure wraps
MAX_LINES_PER_PANEL = 30  # more lines (and their legend) are unreadable and take minutes to lay out (gpu-quick: 15)
CEILING_STYLES = ("--", ":", "-.")  # a copy ceiling line per GPU model of a panel


def latency_plots(run: Run) -> list[Plot]:
    """Per panel: latency (top) and bandwidth with the copy ceiling of each GPU model measured on (bottom) against
    context."""
    results = _latency_results(run)
    if not results:
        return []
    models = _models(map(measured_on, results))
    panels: dict[str, dict[tuple, list[Result]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        panel, line = _series_key(r, len(models) > 1)
        panels[panel][line].append(r)
    names = sorted(panels)
    cols = min(PANELS_PER_ROW, len(names))
    rows = -(-len(names) // cols)
    fig = Figure(figsize=(6.5 * cols, 8 * rows), layout="constrained")
    axes = fig.subplots(2 * rows, cols, squeeze=False)
    for unused in range(len(names), rows * cols):
        axes[2 * (unused // cols)][unused % cols].set_visible(False)
        axes[2 * (unused // cols) + 1][unused % cols].set_visible(False)
    for i, panel in enumerate(names):
        top, bottom = axes[2 * (i // cols)][i % cols], axes[2 * (i // cols) + 1][i % cols]
        bottom.sharex(top)  # the contexts of the panel, even where no bandwidth is finite
        lines = _longest(panels[panel])
        drawn = {top: [], bottom: []}  # the legend's handles, passed explicitly (see _legend)
        for line, items in lines:
            items = sorted(items, key=_context)
            xs = [_context(r) for r in items]
            drawn[top] += top.plot(xs, [r.metrics["run_ms"] for r in items], marker="o", label=_line_label(line))
            gbps = [r.metrics.get("gbps") for r in items]  # a gap where absent, NaN, inf, <= 0 or absurd
            drawn[bottom] += bottom.plot(xs, [g if _loggable(g) else math.nan for g in gbps], marker="o",
                                         label=_line_label(line))
        for i, model in enumerate(_models(measured_on(r) for items in panels[panel].values() for r in items)):
            copy = _ceiling(run, model, "copy_gbps")
            if copy:
                name = f" of {_text(model, 40)}" if len(models) > 1 else ""
                drawn[bottom].append(bottom.axhline(copy, color="black",
                                                    linestyle=CEILING_STYLES[i % len(CEILING_STYLES)],
                                                    label=f"copy ceiling{name} {copy:.0f} GB/s"))
        left_out = len(panels[panel]) > len(lines)
        top.set_title(_text(f"{panel}: latency (median)")
                      + (f", {len(lines)} of {len(panels[panel])} lines (most points)" if left_out else ""))
        top.set_ylabel("ms")
        top.set_yscale("log")
        bottom.set_title(_text(f"{panel}: bandwidth"))
        bottom.set_ylabel("GB/s")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.grid(True, alpha=0.3)
            _legend(ax, drawn[ax])
    _note_left_out(fig, len(_passed_latency(run)) - len(results), "no positive finite median or context")
    return [Plot("latency", "Latency and bandwidth against context length", _png(fig))]


def _longest(lines: dict[tuple, list[Result]]) -> list[tuple[tuple, list[Result]]]:
    """The ``MAX_LINES_PER_PANEL`` lines of most points (ties by name), in name order."""
    ranked = sorted(lines.items(), key=lambda item: (-len(item[1]), item[0]))
    return sorted(ranked[:MAX_LINES_PER_PANEL])


@dataclass
class RooflinePanel:
    """The roofline of one GPU model: its ceilings (None where the run has none a log axis can draw) and, per impl,
    the (FLOP/byte, TFLOP/s) points of the latency results measured on it."""

    model: str | None  # None: results that do not say which model they were measured on
    copy_gbps: float | None
    matmul_tflops: float | None
    points: dict[str, list[tuple[float, float]]]


def roofline_panels(run: Run) -> list[RooflinePanel]:
    """A panel per GPU model that drawable latency results were measured on (``_models`` order), each result placed
    against the ceilings of its own model, never another's."""
    points: dict[str | None, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for r in _latency_results(run):
        if point := _roofline_point(r):
            points[measured_on(r)][r.impl].append(point)
    return [RooflinePanel(model, _ceiling(run, model, "copy_gbps"), _ceiling(run, model, "matmul_tflops"),
                          dict(points[model])) for model in _models(points)]


def roofline(run: Run) -> list[Plot]:
    """Achieved TFLOP/s against arithmetic intensity, under min(copy bandwidth x intensity, matmul rate): a panel per
    GPU model (``roofline_panels``)."""
    panels = roofline_panels(run)
    if not panels:
        return []
    fig = Figure(figsize=(8 * len(panels), 5.5), layout="constrained")
    for ax, panel in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        _roofline_panel(ax, panel)
    drawn = sum(len(items) for panel in panels for items in panel.points.values())
    _note_left_out(fig, len(_passed_latency(run)) - drawn, "no positive finite median, context, bytes, FLOPs or "
                   "intensity")
    return [Plot("roofline", "Roofline", _png(fig))]


def _roofline_panel(ax, panel: RooflinePanel) -> None:
    """Draw one model's roofline (where both its ceilings are drawable) and the points of its first impls."""
    copy, matmul = panel.copy_gbps, panel.matmul_tflops
    intensities = [x for items in panel.points.values() for x, _ in items]
    drawn = []  # the legend's handles, passed explicitly (see _legend)
    if copy and matmul:
        lo = max(min(intensities) / 2, LOG_RANGE[0])
        hi = min(max(max(intensities) * 2, matmul * 1e3 / copy * 4), LOG_RANGE[1])
        line = [(x, min(copy * x / 1e3, matmul)) for x in (lo * (hi / lo) ** (i / 100) for i in range(101))]
        line = [(x, y) for x, y in line if _loggable(y)]
        drawn += ax.plot([x for x, _ in line], [y for _, y in line], color="black",
                         label=f"roofline: copy {copy:.0f} GB/s, bf16 matmul {matmul:.0f} TFLOP/s")
    for impl, items in sorted(panel.points.items())[:MAX_IMPLS_PER_FIGURE]:
        drawn.append(ax.scatter([x for x, _ in items], [y for _, y in items], label=_text(impl)))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    impls = len(panel.points)
    shown = "" if impls <= MAX_IMPLS_PER_FIGURE else f", first {MAX_IMPLS_PER_FIGURE} of {impls} impls"
    where = _text(panel.model, 40) if panel.model is not None else "a device the results do not name"
    ax.set_title(f"Roofline of {where} (ceilings measured in this run{shown})")
    ax.grid(True, alpha=0.3)
    _legend(ax, drawn)


def _legend(ax, handles: list) -> None:
    """A legend of ``handles`` under their labels. Passed explicitly, so that a label starting with "_" (an impl may
    be named so) is shown: matplotlib's automatic legend takes such a label for "leave me out"."""
    ax.legend(handles=handles, fontsize=7)


def _roofline_point(r: Result) -> tuple[float, float] | None:
    """(FLOP/byte, TFLOP/s) of a drawable latency result, or None when its numbers give no loggable point."""
    flops, nbytes = r.metrics.get("flops"), r.metrics.get("bytes")
    if not (_loggable(flops) and _loggable(nbytes)):
        return None
    x, y = flops / nbytes, flops / (r.metrics["run_ms"] * 1e-3) / 1e12
    return (x, y) if _loggable(x) and _loggable(y) else None


def _models(models: Iterable[str | None]) -> list[str | None]:
    """The distinct GPU models, sorted, None (not said) last."""
    return sorted(set(models), key=lambda model: (model is None, model or ""))


def _ceiling(run: Run, model: str | None, name: str) -> float | None:
    """The ceiling ``name`` the run measured for GPU ``model``, where a log axis can draw it (a file may hold NaN, 0
    or negatives)."""
    value = run.ceilings.get(model, {}).get(name) if model is not None else None
    return float(value) if _loggable(value) else None
