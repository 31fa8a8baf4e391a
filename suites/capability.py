"""The capability matrix: every impl on every (op, cache layout, index transform) is either conformant or refused at
plan time with ``UnsupportedConfig`` naming the combination. A crash, a wrong answer or a refusal that does not say
what it refuses is a failure.

Cells are small workloads (16 heads, contexts up to a few pages of 64) judged by ``suites.judge.judge`` against
the float64 reference. ``run_matrix`` yields one Result per cell and impl, then a summary Result whose details
hold the matrix (``matrix_details``); ``capability_table`` renders it with rich, for the CLI and the report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from rich.console import Console
from rich.table import Table

from mla_bench.errors import reraise_interrupt
from mla_bench.problem import Problem, build_problem
from mla_bench.registry import Impl, ImplEntry
from mla_bench.results import Result
from mla_bench.workload import INDEX_TRANSFORMS, Mode, Workload
from reports.console import plain
from suites.base import load_impl
from suites.judge import References, judge, judged_tolerances

SUITE = "roundtrip"
DEFAULT_PRESET = "deepseek-v3-tp8"  # 16 heads: the per-GPU head count of V3 under TP8
MARKS = {"passed": "[green]ok[/]", "unsupported": "[dim]refused[/]", "failed": "[bold red]FAIL[/]",
         "error": "[bold red]CRASH[/]", "not installed": "[yellow]not installed[/]"}

# Per mode: (q_lens, kv_lens, extra fields). Contexts cross page boundaries of 64; one request is tiny.
_CELL_SHAPES: dict[Mode, tuple[tuple[int, ...], tuple[int, ...], dict]] = {
    Mode.DECODE: ((1, 1, 1), (70, 129, 1), {}),
    Mode.PREFILL: ((5, 9), (5, 20), {}),
    Mode.CHUNKED_PREFILL: ((3, 5), (40, 140), {"chunk_size": 64}),
    Mode.SPARSE_DECODE: ((1, 1, 1), (70, 129, 5), {"topk": 16}),
    Mode.SPARSE_PREFILL: ((3, 4), (40, 90), {"topk": 16}),
    Mode.DCP: ((1, 1), (70, 129), {"dcp_world": 2, "dcp_interleave": 1}),
}


@dataclass(frozen=True)
class Cell:
    """One (op, layout, index transform) combination; layout None for ops that read no cache."""

    mode: Mode
    layout: str | None
    transform: str | None

    @property
    def row(self) -> str:
        return f"{self.mode.value} ({self.transform})" if self.transform else self.mode.value

    @property
    def column(self) -> str:
        return self.layout or "no cache"

    @property
    def name(self) -> str:
        return f"{self.row} / {self.column}"

    def workload(self, preset: str, seed: int) -> Workload:
        q_lens, kv_lens, extra = _CELL_SHAPES[self.mode]
        fields = dict(extra, preset=preset, seed=seed, page_size=64)
        if self.layout:
            fields["layout"] = self.layout
        if self.transform:
            fields["index_transform"] = self.transform
        return Workload(mode=self.mode, q_lens=q_lens, kv_lens=kv_lens, **fields)


def cells(layouts: Iterable[str]) -> list[Cell]:
    """Every op x layout x transform: cache-less ops once, sparse ops once per index transform."""
    out = []
    for mode in Mode:
        if not mode.uses_cache:
            out.append(Cell(mode, None, None))
            continue
        for layout in layouts:
            out += [Cell(mode, layout, t) for t in INDEX_TRANSFORMS] if mode.sparse else [Cell(mode, layout, None)]
    return out


def names_combination(message: str, workload: Workload, impl: str = "") -> bool:
    """Whether a refusal says what it refuses: the op, the layout or the transform as a word of its own, in any case
    and with a space or hyphen for an underscore ("DCP", "sparse decode"), or the whole workload label; not inside
    the impl's name (``triton_decode: ...`` names no mode)."""
    if impl:
        message = re.sub(rf"(?<![\w]){re.escape(impl)}(?![\w])", " ", message)
    words = [workload.mode.value]
    if workload.mode.uses_cache:
        words.append(workload.layout)
    if workload.mode.sparse:
        words.append(workload.index_transform)
    patterns = [r"[_\s-]".join(map(re.escape, word.split("_"))) for word in words if word]
    return workload.label in message or any(re.search(rf"(?<![\w]){pattern}(?![\w])", message, re.IGNORECASE)
                                            for pattern in patterns)


def run_matrix(impls: list[ImplEntry], layouts: Iterable[str], device: torch.device, preset: str | None = None,
               seed: int = 0, progress=lambda label: None) -> Iterator[Result]:
    """One Result per (impl, cell), then the summary Result ``capability matrix`` carrying the matrix."""
    matrix_cells = cells(layouts)
    loaded, results = [], []
    for entry in impls:
        impl, failure = load_impl(entry)
        if impl is not None:
            loaded.append((entry.name, impl))
            continue
        status, message = failure  # a row of its own for the impl, not the end of the matrix
        why = "not installed" if status == "unsupported" else "could not load"
        result = Result(SUITE, "capability", status, impl=entry.name, label=f"{entry.name}: {why}",
                        details={"not_loaded": True}, message=message)
        results.append(result)
        yield result
    for cell in matrix_cells:
        problem = build_problem(cell.workload(preset or DEFAULT_PRESET, seed), device)
        refs: References | None = None
        for name, impl in loaded:
            progress(f"capability {name} {cell.name}")
            if refs is None and _accepts(impl, problem):
                refs = References.of(problem)
            result = _judge_cell(name, impl, cell, problem, refs)
            results.append(result)
            yield result
    details = matrix_details(results, matrix_cells)
    bad = [r for r in results if r.status in ("failed", "error")]
    # filed under the impl where the matrix holds one (an --isolate worker's): the workers' summaries do not collide
    owner = impls[0].name if len(impls) == 1 else None
    yield Result(SUITE, "capability matrix", "failed" if bad else "passed", impl=owner, label="capability matrix",
                 metrics={"cells": len(results), "failures": len(bad)}, details=details,
                 message="; ".join(f"{r.label}: {r.status}" for r in bad))


def _judge_cell(name: str, impl, cell: Cell, problem: Problem, refs: References | None) -> Result:
    verdict = judge(impl, problem, refs)
    status, message = verdict.status, verdict.message or "; ".join(verdict.violations)
    if status == "unsupported" and not names_combination(verdict.message, problem.workload, name):
        status, message = "failed", f"refused without naming the combination: {verdict.message!r}"
    return Result(SUITE, "capability", status, impl=name, workload=problem.workload.to_dict(),
                  label=f"{name}: {cell.name}", metrics=verdict.metrics(),
                  details={"row": cell.row, "column": cell.column,
                           "tolerance": judged_tolerances(problem.workload)}, message=message)


def matrix_details(results: list[Result], matrix_cells: list[Cell]) -> dict:
    """The matrix as plain JSON: ``columns`` (layouts), ``rows`` (impl, op) with a status per column."""
    columns = list(dict.fromkeys(cell.column for cell in matrix_cells))
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for result in results:
        if result.check != "capability":
            continue
        if result.details.get("not_loaded"):
            status = "not installed" if result.status == "unsupported" else result.status
            rows[(result.impl, "all ops")] = {column: status for column in columns}
            continue
        rows.setdefault((result.impl, result.details["row"]), {})[result.details["column"]] = result.status
    return {"columns": columns,
            "rows": [{"impl": impl, "op": op, "cells": statuses} for (impl, op), statuses in rows.items()]}


def _accepts(impl: Impl, problem: Problem) -> bool:
    """Whether ``impl`` takes ``problem`` (its ``refusal``, which an impl may override): one whose refusal raises is
    judged all the same, and errs there, not here (a GeneratorExit ended the run)."""
    try:
        return impl.refusal(problem) is None
    except BaseException as exc:  # noqa: BLE001
        reraise_interrupt(exc)
        return False


def capability_table(details: dict) -> Table:
    """The matrix (``matrix_details``) as a rich table: one row per (impl, op), one column per layout."""
    table = Table(title="capability matrix (ok = conformant, refused = UnsupportedConfig at plan time)")
    table.add_column("impl")
    table.add_column("op")
    for column in details["columns"]:
        table.add_column(column, justify="center")
    for row in details["rows"]:
        table.add_row(plain(row["impl"]), plain(row["op"]),
                      *[MARKS.get(row["cells"].get(c, ""), "") for c in details["columns"]])
    return table


def print_capability_matrix(results: Iterable[Result], console: Console | None = None) -> None:
    """Print the matrix of the ``capability matrix`` Result among ``results`` (as the CLI does after a run)."""
    for result in results:
        if result.check == "capability matrix":
            (console or Console()).print(capability_table(result.details))
