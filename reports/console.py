"""Rich tables for the terminal: a run's summary and failures, the deltas of two runs, the gate's findings.

Strings from results go in through ``plain``: ``Text``, never markup, with control characters shown escaped, so a
crafted name can neither restyle the table nor send escape sequences to the terminal.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from rich.table import Table
from rich.text import Text

from mla_bench.results import STATUSES, Result, Run
from reports.gate import BAD, Finding, GateLimits, compare_pair, measured
from reports.limits import COMPARE_ROWS
from reports.pairing import HEADLINE, duplicates, headline, measured_on_one_model, pair, same_gpu

STATUS_STYLE = {"passed": "green", "failed": "red", "unsupported": "yellow", "error": "bold red"}
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # all but newline and tab: ESC starts terminal sequences


def plain(value: object, style: str = "") -> Text:
    """``value`` as Text for a table: never parsed as markup, control characters written as ``\\xNN``."""
    return Text(CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value)), style=style)


def summary_table(run: Run) -> Table:
    """Counts of each status per (suite, impl)."""
    counts: dict[tuple[str, str], Counter] = {}
    for r in run.results:
        counts.setdefault((r.suite, r.impl or "(bench)"), Counter())[r.status] += 1
    table = Table(title="mla-bench run")
    for column in ("suite", "impl", *STATUSES):
        table.add_column(column, justify="left" if column in ("suite", "impl") else "right")
    for (suite, impl), count in sorted(counts.items()):
        table.add_row(plain(suite), plain(impl), *[Text(str(count[s]), style=STATUS_STYLE[s] if count[s] else "dim")
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
        table.add_row(Text(r.status, style=STATUS_STYLE[r.status]), plain(r.suite), plain(r.impl or ""),
                      plain(r.label), plain(r.brief[:200]))
    return table


def untested_text(impl: str, reasons: Counter, limit: int = 3, width: int = 160) -> Text:
    """Why ``impl``, named on the command line, was tested on nothing: its ``limit`` most common distinct reasons
    for ``unsupported`` with their counts, one line of at most ``width`` characters each."""
    text = plain(f"error: {impl} was tested on nothing: all {sum(reasons.values())} of its results are unsupported",
                 style="bold red")
    for reason, count in reasons.most_common(limit):
        line = reason if len(reason) <= width else reason[:width - 3] + "..."
        text.append(plain(f"\n  {count}x {line}"))
    if len(reasons) > limit:
        text.append(f"\n  ... and {len(reasons) - limit} more")
    return text


NOTABLE = GateLimits().latency_slack  # a headline that moved by more than this fraction (10%) changed
# What happened to a result from A to B (``_kind``), in the order a long comparison shows them.
KINDS = ("new failure", "regression", "still failing", "failure not rerun", "fixed", "not comparable", "changed",
         "unchanged")
ALWAYS_SHOWN = KINDS[:6]  # never left out, however many
KIND_STYLE = {"new failure": "bold red", "regression": "red", "still failing": "red", "fixed": "green",
              "not comparable": "yellow"}


def compare_table(a: Run, b: Run, title: str = "A -> B", limit: int = COMPARE_ROWS) -> Table:
    """Status in A and B and the headline number (accuracy: kernel rel_l2, latency: median ms) with its change;
    latency changes only between runs on the same GPU model, and, as the gate, between results measured on one model
    (runs over several models shard a workload onto either). Up to ``limit`` results (0: no limit): every one, in run
    order. More: every failure, error and regression (``_kind``), then the other changes, largest first, up to
    ``limit`` rows; unchanged results are counted. A passed result's headline in A that no measurement gives (NaN,
    inf, negative, a median <= 0) is no base for a change: "not comparable", as the gate does not compare it. The
    caption says what the table could not show."""
    other_gpu = not same_gpu(a, b)
    rows, withheld = [], 0
    for (suite, check, impl, _), ra, rb in pair(a, b):
        va, vb = headline(ra), headline(rb)
        unanchored = va is not None and ra.status == "passed" and not measured(HEADLINE[suite], va)
        relative = None if unanchored else _relative(va, vb)
        change = "not comparable" if unanchored else _change(va, vb, relative)
        comparable = not other_gpu and measured_on_one_model(ra, rb)
        if suite == "latency" and not comparable and change:
            relative, change, withheld = None, "other GPU", withheld + 1
        fatal = any(f.fatal for f in compare_pair(ra, rb, GateLimits(), comparable))
        rows.append((_kind(ra, rb, relative, fatal, unanchored), abs(relative or 0.0), suite, check, impl, ra, rb, va,
                     vb, change))
    notes = []
    summarized = 0 < limit < len(rows)
    if summarized:
        kinds = Counter(row[0] for row in rows)
        rows.sort(key=lambda row: (KINDS.index(row[0]), -row[1]))  # stable: run order among equals
        room = max(limit - sum(kinds[k] for k in ALWAYS_SHOWN), 0)
        shown_changes = min(kinds["changed"], room)
        rows = [row for row in rows if row[0] in ALWAYS_SHOWN] + [row for row in rows if row[0] == "changed"][:room]
        notes.append(f"{sum(kinds.values())} results: " + ", ".join(f"{k} {kinds[k]}" for k in ALWAYS_SHOWN)
                     + f", changed {kinds['changed']} ({shown_changes} shown, largest first), unchanged "
                     f"{kinds['unchanged']} (within {NOTABLE:.0%} or not compared; not shown)")
    table = Table(title=plain(title))
    columns = ("suite: check", "impl", "workload", "status A", "status B", "metric", "A", "B", "change")
    for column in ("what",) * summarized + columns:
        table.add_column(column, overflow="fold", justify="right" if column in ("A", "B", "change") else "left")
    for kind, _, suite, check, impl, ra, rb, va, vb, change in rows:
        metric = HEADLINE.get(suite, "")
        table.add_row(*[Text(kind, style=KIND_STYLE.get(kind, ""))] * summarized,
                      plain(suite if check == suite else f"{suite}: {check}"), plain(impl), plain((rb or ra).label),
                      _status(ra), _status(rb), metric, _number(va), _number(vb), change)
    if withheld and other_gpu:
        notes.append(f"{withheld} latency change(s) not shown: A ran on GPU {a.environment.get('gpu')!r}, B on "
                     f"{b.environment.get('gpu')!r}")
    elif withheld:
        notes.append(f"{withheld} latency change(s) not shown: measured on one GPU model in A and another in B")
    notes += [f"{name} has {len(groups)} key(s) shared by several results: only the last of each is shown"
              for name, groups in (("A", duplicates(a)), ("B", duplicates(b))) if groups]
    table.caption = plain("; ".join(notes)) if notes else None
    return table


def _kind(ra: Result | None, rb: Result | None, relative: float | None, fatal: bool, unanchored: bool) -> str:
    """What happened to a result from A to B: a new failure (failed or errored in B only), a regression (passed
    in A, unsupported or absent in B, or a finding the gate with its default limits calls fatal: ``fatal``), still
    failing, a failure not rerun (absent from B), fixed (passed in B), not comparable (A's headline is no value a
    measurement gives: ``unanchored``), changed (another status, or the headline over ``NOTABLE`` better or worse,
    within the gate's noise) or unchanged."""
    bad_a, bad_b = ra is not None and ra.status in BAD, rb is not None and rb.status in BAD
    if bad_b:
        return "still failing" if bad_a else "new failure"
    if bad_a:
        return "failure not rerun" if rb is None else "fixed" if rb.status == "passed" else "changed"
    lost = ra is not None and ra.status == "passed" and (rb is None or rb.status != "passed")
    if lost:
        return "regression"
    if unanchored:  # the gate's finding for such a baseline says to record it again; the table names no change
        return "not comparable"
    if fatal:
        return "regression"
    if ra is None or rb is None or ra.status != rb.status or (relative is not None and abs(relative) > NOTABLE):
        return "changed"
    return "unchanged"


def _relative(a: float | None, b: float | None) -> float | None:
    """B's headline relative to A's, where A is finite and not negative; inf where B is NaN or inf, or nonzero
    after A's 0 (worse without measure)."""
    if a is None or b is None or not math.isfinite(a) or a < 0:
        return None
    if not math.isfinite(b) or (a == 0 and b != 0):
        return math.inf
    return 0.0 if a == 0 else (b - a) / a


def _change(a: float | None, b: float | None, relative: float | None) -> str:
    """``relative`` (``_relative(a, b)``) as text, only where both are finite and A is not negative (from 0: "0" or
    "new nonzero")."""
    if relative is None or not math.isfinite(b):
        return ""
    if a == 0:
        return "0" if b == 0 else "new nonzero"
    return f"{relative:+.1%}"


def gate_table(findings: list[Finding]) -> Table:
    table = Table(title="gate findings")
    for column in ("", "kind", "suite", "impl", "workload", "message"):
        table.add_column(column, overflow="fold")
    for f in sorted(findings, key=lambda f: not f.fatal):
        table.add_row(Text("FAIL", style="bold red") if f.fatal else Text("note", style="yellow"), plain(f.kind),
                      plain(f.suite), plain(f.impl), plain(f.label), plain(f.message))
    return table


def _status(result) -> Text:
    if result is None:
        return Text("-", style="dim")
    return Text(result.status, style=STATUS_STYLE.get(result.status, ""))


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"
