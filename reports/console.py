"""Rich tables for the terminal: a run's summary and failures, the deltas of two runs, the gate's findings.

Strings from results go in as ``Text`` (never markup), so a crafted name cannot restyle the terminal output.
"""

from __future__ import annotations

from collections import Counter

from rich.table import Table
from rich.text import Text

from mla_bench.results import STATUSES, Run
from reports.gate import Finding
from reports.pairing import headline, pair

STATUS_STYLE = {"passed": "green", "failed": "red", "unsupported": "yellow", "error": "bold red"}


def summary_table(run: Run) -> Table:
    """Counts of each status per (suite, impl)."""
    counts: dict[tuple[str, str], Counter] = {}
    for r in run.results:
        counts.setdefault((r.suite, r.impl or "(bench)"), Counter())[r.status] += 1
    table = Table(title="mla-bench run")
    for column in ("suite", "impl", *STATUSES):
        table.add_column(column, justify="left" if column in ("suite", "impl") else "right")
    for (suite, impl), count in sorted(counts.items()):
        table.add_row(Text(suite), Text(impl), *[Text(str(count[s]), style=STATUS_STYLE[s] if count[s] else "dim")
                                               for s in STATUSES])
    return table


def failures_table(run: Run, limit: int = 20) -> Table | None:
    """The first ``limit`` failed or errored results with the first line of their message."""
    bad = [r for r in run.results if r.status in ("failed", "error")]
    if not bad:
        return None
    table = Table(title=f"failures ({len(bad)}{', first ' + str(limit) if len(bad) > limit else ''})")
    for column in ("status", "suite", "impl", "workload", "message"):
        table.add_column(column, overflow="fold")
    for r in bad[:limit]:
        table.add_row(Text(r.status, style=STATUS_STYLE[r.status]), Text(r.suite), Text(r.impl or ""),
                      Text(r.label), Text(r.brief[:200]))
    return table


def untested_text(impl: str, reasons: Counter, limit: int = 3, width: int = 160) -> Text:
    """Why ``impl``, named on the command line, was tested on nothing: its ``limit`` most common distinct reasons
    for ``unsupported`` with their counts, one line of at most ``width`` characters each."""
    text = Text(f"error: {impl} was tested on nothing: all {sum(reasons.values())} of its results are unsupported",
                style="bold red")
    for reason, count in reasons.most_common(limit):
        line = reason if len(reason) <= width else reason[:width - 3] + "..."
        text.append(f"\n  {count}x {line}")
    if len(reasons) > limit:
        text.append(f"\n  ... and {len(reasons) - limit} more")
    return text


def compare_table(a: Run, b: Run, title: str = "A -> B") -> Table:
    """Each result of either run: status in A and B, and its headline number (accuracy: kernel rel_l2,
    latency: median ms) with the change."""
    table = Table(title=title)
    for column in ("suite", "impl", "workload", "status A", "status B", "metric", "A", "B", "change"):
        table.add_column(column, overflow="fold", justify="right" if column in ("A", "B", "change") else "left")
    for (suite, _, impl, _), ra, rb in pair(a, b):
        any_result = rb or ra
        va, vb = headline(ra), headline(rb)
        change = ""
        if va is not None and vb is not None:
            change = f"{(vb - va) / va:+.1%}" if va else ("0" if vb == va else "new nonzero")
        metric = {"accuracy": "kernel.rel_l2", "latency": "run_ms"}.get(suite, "")
        table.add_row(Text(suite), Text(impl), Text(any_result.label), _status(ra), _status(rb), metric,
                      _number(va), _number(vb), change)
    return table


def gate_table(findings: list[Finding]) -> Table:
    table = Table(title="gate findings")
    for column in ("", "kind", "suite", "impl", "workload", "message"):
        table.add_column(column, overflow="fold")
    for f in sorted(findings, key=lambda f: not f.fatal):
        table.add_row(Text("FAIL", style="bold red") if f.fatal else Text("note", style="yellow"), Text(f.kind),
                      Text(f.suite), Text(f.impl), Text(f.label), Text(f.message))
    return table


def _status(result) -> Text:
    if result is None:
        return Text("-", style="dim")
    return Text(result.status, style=STATUS_STYLE.get(result.status, ""))


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"
