"""The report's figures (matplotlib, rendered to PNG bytes): error heatmaps, latency and bandwidth against
context length with the copy ceiling, and the roofline.

Figures are built with ``matplotlib.figure.Figure`` (no pyplot, no global backend). Labels come from results
files: ``_text`` escapes ``$`` so a crafted name is drawn as typed, never parsed as math text.
"""

from __future__ import annotations

import io
import math
from collections import defaultdict
from dataclasses import dataclass

import matplotlib
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from mla_bench.results import Result, Run

MAX_IMPLS_PER_FIGURE = 12


@dataclass
class Plot:
    name: str   # file-name part, made by this module (never from the results file)
    title: str
    png: bytes


def all_plots(run: Run) -> list[Plot]:
    with matplotlib.rc_context({"font.size": 9}):
        return error_heatmaps(run) + latency_plots(run) + roofline(run)


def _text(value: object, limit: int = 60) -> str:
    """A string from a results file, safe for matplotlib (``$`` would start math text) and cut to ``limit``."""
    text = str(value)
    text = text if len(text) <= limit else text[:limit - 3] + "..."
    return text.replace("$", r"\$")


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


def _layout(result: Result) -> str:
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
        layouts = sorted({_layout(r) for r in results})
        contexts = sorted({_context(r) for r in results})
        widest = max(len(_text(name)) for name in layouts)
        fig = Figure(figsize=(max(9.0, 1.2 * len(contexts) * 2 + 0.14 * widest), 2.5 + 0.4 * len(layouts)),
                     layout="constrained")
        axes = fig.subplots(1, 2, squeeze=True)
        for ax, kind in zip(axes, ("kernel", "e2e")):
            grid = [[math.nan] * len(contexts) for _ in layouts]
            failed = set()
            for r in results:
                value = r.metrics.get(f"{kind}.rel_l2")
                if not isinstance(value, (int, float)):
                    continue
                cell = (layouts.index(_layout(r)), contexts.index(_context(r)))
                old = grid[cell[0]][cell[1]]
                grid[cell[0]][cell[1]] = value if math.isnan(old) else max(old, value)
                if r.status == "failed":
                    failed.add(cell)
            _heatmap(ax, grid, layouts, contexts, failed)
            ax.set_title(f"{_text(impl, 30)}: {kind} relative L2 error (worst per cell)")
            ax.set_xlabel("longest context in the workload")
        plots.append(Plot(f"errors-{index}", f"Error heatmap: {impl}", _png(fig)))
    return plots


def _heatmap(ax, grid: list[list[float]], rows: list[str], cols: list[int], failed: set) -> None:
    finite = [v for row in grid for v in row if not math.isnan(v) and v > 0]
    low, high = (min(finite), max(finite)) if finite else (1e-8, 1.0)
    if high <= low:
        high = low * 10
    shown = [[v if not math.isnan(v) and v > 0 else math.nan for v in row] for row in grid]
    norm = LogNorm(vmin=low, vmax=high)
    ax.imshow(shown, aspect="auto", cmap="viridis", norm=norm)
    ax.set_xticks(range(len(cols)), [str(c) for c in cols], rotation=45)
    ax.set_yticks(range(len(rows)), [_text(r) for r in rows])
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            if math.isnan(value):
                continue
            text = f"{value:.1e}" + (" FAIL" if (i, j) in failed else "")
            bright = value > 0 and float(norm(value)) > 0.55  # viridis turns yellow: dark text there
            ax.text(j, i, text, ha="center", va="center", fontsize=7,
                    color="red" if (i, j) in failed else ("black" if bright else "white"),
                    fontweight="bold" if (i, j) in failed else "normal")


# ---- latency -------------------------------------------------------------------------------------------------------
def _latency_results(run: Run) -> list[Result]:
    return [r for r in run.results if r.suite == "latency" and r.status == "passed" and r.impl
            and r.metrics.get("run_ms", 0) > 0 and _context(r) is not None]


def _series_key(r: Result) -> tuple[str, str]:
    """(panel, line): a panel per mode and preset (and head override), a line per impl, batch, layout, page."""
    w = _workload(r)
    panel = f"{w.get('mode', '?')} {w.get('preset', '?')}" + (f" h{w['num_heads']}" if w.get("num_heads") else "")
    line = f"{r.impl} b{len(w.get('kv_lens') or [])} {_layout(r)} ps{w.get('page_size', '?')}"
    return panel, line


PANELS_PER_ROW = 3  # panels (mode x preset) side by side before the figure wraps


def latency_plots(run: Run) -> list[Plot]:
    """Per panel: latency (top) and bandwidth with the measured copy ceiling (bottom) against context."""
    results = _latency_results(run)
    if not results:
        return []
    panels: dict[str, dict[str, list[Result]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        panel, line = _series_key(r)
        panels[panel][line].append(r)
    copy = _ceiling(run, "copy_gbps")
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
        for line, items in sorted(panels[panel].items()):
            items = sorted(items, key=_context)
            xs = [_context(r) for r in items]
            top.plot(xs, [r.metrics["run_ms"] for r in items], marker="o", label=_text(line))
            bottom.plot(xs, [r.metrics.get("gbps", math.nan) for r in items], marker="o", label=_text(line))
        if copy:
            bottom.axhline(copy, color="black", linestyle="--", label=f"copy ceiling {copy:.0f} GB/s")
        top.set_title(_text(f"{panel}: latency (median)"))
        top.set_ylabel("ms")
        top.set_yscale("log")
        bottom.set_title(_text(f"{panel}: bandwidth"))
        bottom.set_ylabel("GB/s")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    return [Plot("latency", "Latency and bandwidth against context length", _png(fig))]


def roofline(run: Run) -> list[Plot]:
    """Achieved TFLOP/s against arithmetic intensity, under min(copy bandwidth x intensity, matmul rate)."""
    results = [r for r in _latency_results(run) if r.metrics.get("bytes") and r.metrics.get("flops")]
    copy, matmul = _ceiling(run, "copy_gbps"), _ceiling(run, "matmul_tflops")
    if not results:
        return []
    fig = Figure(figsize=(8, 5.5), layout="constrained")
    ax = fig.subplots()
    by_impl: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_impl[r.impl].append(r)
    intensities = [r.metrics["flops"] / r.metrics["bytes"] for r in results]
    if copy and matmul:
        lo, hi = min(intensities) / 2, max(max(intensities) * 2, matmul * 1e3 / copy * 4)
        xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
        ax.plot(xs, [min(copy * x / 1e3, matmul) for x in xs], color="black",
                label=f"roofline: copy {copy:.0f} GB/s, bf16 matmul {matmul:.0f} TFLOP/s")
    for impl, items in sorted(by_impl.items())[:MAX_IMPLS_PER_FIGURE]:
        ax.scatter([r.metrics["flops"] / r.metrics["bytes"] for r in items],
                   [r.metrics["flops"] / (r.metrics["run_ms"] * 1e-3) / 1e12 for r in items], label=_text(impl))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title("Roofline (ceilings measured in this run)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return [Plot("roofline", "Roofline", _png(fig))]


def _ceiling(run: Run, name: str) -> float | None:
    values = [c.get(name) for c in run.ceilings.values() if isinstance(c.get(name), (int, float))]
    return float(values[0]) if values else None
