"""The hidden-cost table of the placement suite: a rich console table and an HTML fragment.

One row per ``hidden_cost`` Result (impl x workload): plan and run times, launches, copies with their bytes,
syncs, allocations, then the verdicts of the placement rules checked on the same impl and workload.
"""

from __future__ import annotations

import html
import math
from collections import defaultdict
from typing import Iterable

from rich.table import Table

from mla_bench.results import Result
from reports.console import plain

SUITE = "placement"
COLUMNS = ("impl", "workload", "status", "plan ms", "run ms", "launches", "h2d", "d2h", "d2d", "syncs",
           "allocations", "rules")


def format_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    units, i = ("B", "KiB", "MiB", "GiB"), 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def hidden_cost_rows(results: Iterable[Result]) -> list[list[str]]:
    """The table's cells as text, in the order of the ``hidden_cost`` Results."""
    results = [r for r in results if r.suite == SUITE]
    rules: dict[tuple, list[str]] = defaultdict(list)
    for r in results:
        if r.check not in ("hidden_cost", "metadata_sync"):
            rules[(r.impl, r.label)].append(f"{r.check} {r.status}")
    rows = []
    for r in results:
        if r.check != "hidden_cost" or r.status == "unsupported":  # refusals are in the summary, not costs
            continue
        m = defaultdict(lambda: math.nan, r.metrics)  # a file may lack a metric: shown as nan
        if r.status != "passed":
            rows.append([r.impl or "", r.label, r.status] + [""] * 8 + [r.message.splitlines()[-1] if r.message
                                                                      else ""])
            continue
        copies = [f"{m[f'{kind}_copies']:.0f} / {format_bytes(m[f'{kind}_bytes'])}" for kind in ("h2d", "d2h", "d2d")]
        rows.append([r.impl or "", r.label, r.status, f"{m['plan_ms']:.3f}", f"{m['run_ms']:.3f}",
                     f"{m['launches']:.0f}", *copies, f"{m['syncs']:.0f}",
                     f"{m['allocations']:.0f} / {format_bytes(m['alloc_bytes'])}",
                     ", ".join(rules[(r.impl, r.label)])])
    return rows


def hidden_cost_table(results: Iterable[Result], title: str = "Hidden costs per step (plan + run)") -> Table:
    """A rich table for the console."""
    table = Table(title=title)
    for column in COLUMNS:
        table.add_column(column, overflow="fold", justify="right" if column.endswith(("ms", "launches", "syncs"))
                         else "left")
    for row in hidden_cost_rows(results):
        table.add_row(*map(plain, row))
    return table


def hidden_cost_html(results: Iterable[Result]) -> str:
    """An HTML ``<table>`` fragment (every string escaped); empty when there are no placement results."""
    rows = hidden_cost_rows(results)
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return (f'<table class="hidden-costs"><caption>Hidden costs per step (plan + run): copies as count / bytes'
            f"</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
