"""The ``mla-bench`` command line: run, list, report, compare, gate.

Heavy modules are imported inside the commands: ``run`` must set ``TRITON_INTERPRET`` (on a machine without
CUDA) before anything that defines Triton kernels is imported.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from reports.limits import COMPARE_ROWS, REPORT_ROWS


class _Console:
    """Rich output to the current stdout (or stderr); wide when it is not a terminal (logs, CI), so lines do not
    fold."""

    def __init__(self, stderr: bool = False) -> None:
        self.stderr = stderr

    def print(self, *objects) -> None:
        stream = sys.stderr if self.stderr else sys.stdout
        Console(stderr=self.stderr, width=None if stream.isatty() else 200).print(*objects)


console = _Console()
notes_console = _Console(stderr=True)  # remarks before a run (suites skipped, filters not applied)
SUITE_CHOICES = ("accuracy", "roundtrip", "metadata", "equivalence", "latency", "placement", "all")


# ---- list ---------------------------------------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    """Print every discoverable impl with its capabilities (or why it cannot load), or the cache layouts."""
    from mla_bench.device import prepare

    prepare("auto")  # on a machine without CUDA, impls import their Triton kernels for the interpreter
    if args.layouts:
        from mla_bench.layouts import LAYOUTS

        table = Table(title="cache layouts")
        for column in ("layout", "bytes/token", "description"):
            table.add_column(column, overflow="fold")
        for name, layout in LAYOUTS.items():
            table.add_row(Text(name), str(layout.bytes_per_token), Text(layout.description))
        console.print(table)
        return 0
    from mla_bench.errors import reraise_interrupt
    from mla_bench.registry import ImplNotInstalled, discover

    table = Table(title="MLA implementations")
    columns = ["impl", "origin", "modes", "layouts", "dtypes", "devices", "page sizes", "heads", "query lengths",
               "lse"]
    for column in columns:
        table.add_column(column, overflow="fold")
    broken = 0
    for name, entry in sorted(discover().items()):
        try:
            summary = entry.load().capabilities.summary()
        except ImplNotInstalled as exc:
            table.add_row(Text(name), Text(entry.origin), Text.assemble(("not installed", "yellow"), f": {exc}"),
                          *[""] * (len(columns) - 3))
            continue
        except BaseException as exc:  # noqa: BLE001 - a broken impl (sys.exit too) is listed as such, the rest too
            reraise_interrupt(exc)
            broken += 1
            table.add_row(Text(name), Text(entry.origin), Text.assemble(("cannot load", "bold red"),
                                                                        f": {_first_line(exc)}"),
                          *[""] * (len(columns) - 3))
            continue
        table.add_row(Text(name), Text(entry.origin), *[Text(summary[c]) for c in columns[2:]])
    console.print(table)
    return 1 if broken else 0


def _first_line(exc: Exception) -> str:
    """``Type: message``'s first line (an exception may have no message)."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0].removesuffix(": ")


# ---- run ----------------------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    """Run suites over impls, write ``run.json`` (and ``report.html``), print the summary; 0 only if all passed and
    every impl named (not ``all``) was tested on something."""
    from mla_bench.device import prepare

    try:
        device = prepare(args.device)  # sets TRITON_INTERPRET on CPU before any impl is imported
    except ValueError as exc:  # before the runner is imported, which names the flag of every other option's error
        return _usage_error(f"--device: {exc}")
    from mla_bench.registry import ImplNotInstalled
    from mla_bench.runner import run_selection, select_run, untested_impls
    from mla_bench.results import save_run
    from reports.console import failures_table, summary_table, untested_text
    from reports.hidden_costs import hidden_cost_table
    from suites.capability import print_capability_matrix

    # absolute: an impl that changes the working directory must not move where the run's files go
    out = (Path(args.out) if args.out else Path("results") / _run_name(device)).absolute()
    try:
        selection = select_run(_run_options(args, device))
    except (ValueError, ImplNotInstalled) as exc:  # unknown impl, suite, preset, mode, a bad value, nothing to run
        return _usage_error(str(exc))
    problem = _make_dir(out) or _files_problem(out, ["run.json"] + ([] if args.no_report else ["report.html"]))
    if problem:  # before the run, so a bad --out cannot lose its results
        return _usage_error(problem)
    for note in selection.notes:
        notes_console.print(Text(note, style="yellow"))
    with _progress() as progress:
        run = run_selection(selection, progress)
    path = save_run(run, out / "run.json")
    print_capability_matrix(run.results, console)
    if any(r.check == "hidden_cost" for r in run.results):
        console.print(hidden_cost_table(run.results))
    console.print(summary_table(run))
    failures = failures_table(run)
    if failures is not None:
        console.print(failures)
    untested = untested_impls(selection, run)
    for impl, reasons in untested.items():
        console.print(untested_text(impl, reasons))
    console.print(Text(f"results: {path}"))  # Text, not markup: a path may hold "[/x]"
    if not args.no_report:
        from reports.html import write_report

        console.print(Text(f"report:  {write_report(run, out / 'report.html')}"))
    return 0 if run.ok and not untested else 1


def _run_options(args: argparse.Namespace, device):
    """The runner's options from the command line. Without ``--preset``, a CPU run takes the tiny preset (the
    suites' own defaults are serving sizes) unless the sweep asked for cannot build it (the gpu sweeps)."""
    from mla_bench.errors import about_flag
    from mla_bench.runner import RunOptions
    from suites.sweeps import sweep_presets

    with about_flag("--sweep"):
        tiny = device.type == "cpu" and "tiny" in sweep_presets(args.sweep or "tiny")
    return RunOptions(impls=_split(args.impl), suites=args.suite, device=str(device),
                      preset=args.preset or ("tiny" if tiny else None), modes=args.mode or [],
                      layouts=args.layout or [], page_sizes=args.page_size or [], seed=args.seed, sweep=args.sweep,
                      devices=args.devices or [], isolate=args.isolate, stall_timeout=args.stall_timeout,
                      dcp_world=args.dcp, dcp_interleave=args.dcp_interleave)


def _make_dir(path: Path) -> str | None:
    """Create the directory ``path`` (and its parents); why it cannot hold our files, or None when it can."""
    if path.exists() and not path.is_dir():
        return f"{path} exists and is not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the directory {path}: {exc.strerror or exc}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"cannot write in the directory {path}"
    return None


def _files_problem(directory: Path, names: list[str]) -> str | None:
    """Why a run cannot write its files ``names`` in ``directory`` (one that is a directory, a dangling link, or not
    writable), or None."""
    for name in names:
        path = directory / name
        if path.is_dir():
            return f"{path} is a directory: the run writes its {name} there"
        if path.is_symlink() and not path.exists():
            return f"{path} is a link to nothing: the run writes its {name} there"
        if path.exists() and not os.access(path, os.W_OK):
            return f"cannot write {path}: the run writes its {name} there"
    return None


def _run_name(device) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{device.type}"


class _RichProgress:
    """A rich progress bar over workload steps (implements ``mla_bench.runner.Progress``)."""

    def __enter__(self) -> "_RichProgress":
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, \
            TimeElapsedColumn

        self._bar = Progress(SpinnerColumn(), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("{task.description}"), console=Console(stderr=True), transient=False)
        self._bar.__enter__()
        self._task = self._bar.add_task("starting", total=None)
        return self

    def start(self, total: int | None) -> None:
        self._bar.update(self._task, total=total, completed=0)

    def advance(self, label: str) -> None:
        self._bar.update(self._task, advance=1, description=escape(label))

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)


class _LineProgress:
    """One line on stderr per workload step as it begins, for logs and CI, where a bar is drawn only once the run
    ends: a long run shows that it moves, and a run that hangs names the step it hangs on."""

    def __enter__(self) -> "_LineProgress":
        self._start = time.monotonic()
        self._done = 0
        self._total: int | None = None
        return self

    def start(self, total: int | None) -> None:
        self._total, self._done = total, 0

    def advance(self, label: str) -> None:
        self._done += 1
        minutes, seconds = divmod(int(time.monotonic() - self._start), 60)
        count = f"{self._done}/{self._total}" if self._total is not None else f"{self._done}"
        print(f"[{count} {minutes}:{seconds:02d}] {label}", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        pass


def _progress() -> _RichProgress | _LineProgress:
    """A bar on a terminal, else a line per step."""
    return _RichProgress() if Console(stderr=True).is_terminal else _LineProgress()


# ---- report, compare, gate --------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    from reports.html import write_report

    run = _load(args.run)
    if run is None:
        return 2
    target = Path(args.output) if args.output else Path(args.run).with_name("report.html")
    problem = _report_target_problem(target, Path(args.run))
    if problem:
        return _usage_error(problem)
    try:
        console.print(Text(f"report: {write_report(run, target, args.rows)}"))
    except OSError as exc:  # a path the checks could not foresee (/proc, a full disk)
        return _usage_error(f"cannot write the report at {exc.filename or target}: {exc.strerror or exc}")
    return 0


def _report_target_problem(path: Path, run_path: Path) -> str | None:
    """Why the report (and its PNGs beside it) cannot be written at ``path``, or None; checked before writing."""
    if path.resolve() == run_path.resolve():
        return f"{path} is the run file itself; give the report another name with -o"
    if path.is_dir():
        return f"{path} is a directory; give the report's file name, e.g. {path / 'report.html'}"
    if path.exists() and not path.is_file():
        return f"{path} is not a regular file (its plots would go beside it); give the report a file name"
    if (run_path.resolve().parent == path.resolve().parent and run_path.name.startswith(f"{path.stem}-")
            and run_path.suffix == ".png"):
        return f"the report's plots ({path.stem}-<plot>.png) could overwrite the run file; give the report another name"
    if path.exists() and not os.access(path, os.W_OK):
        return f"cannot write {path}"
    return _make_dir(path.parent)


def cmd_compare(args: argparse.Namespace) -> int:
    from reports.console import compare_table

    a, b = _load(args.a), _load(args.b)
    if a is None or b is None:
        return 2
    console.print(compare_table(a, b, title=Text(f"{args.a} -> {args.b}").plain, limit=args.rows))
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    """Exit 1 when the run regresses against the baseline (see reports.gate), else 0."""
    from reports.console import gate_table
    from reports.gate import GateLimits, gate

    baseline, run = _load(args.baseline), _load(args.run)
    if baseline is None or run is None:
        return 2
    outcome = gate(baseline, run, GateLimits(args.error_slack, args.latency_slack, args.noise_factor,
                                             args.allow_missing))
    if outcome.findings:
        console.print(gate_table(outcome.findings))
    fatal = outcome.fatal
    compared = f"{outcome.compared} of {len(run.results)} results compared against {args.baseline}"
    if fatal:
        console.print(Text(f"gate: FAILED, {len(fatal)} regression(s) ({compared})", style="bold red"))
        if any(f.kind == "missing" for f in fatal):
            console.print("a run meant to cover only part of the baseline passes --allow-missing")
        return 1
    console.print(Text(f"gate: passed ({compared})", style="green"))
    return 0


def _load(path: str):
    from mla_bench.results import RunFileError, load_run

    try:
        return load_run(path)
    except RunFileError as exc:
        console.print(Text(f"error: {exc}", style="bold red"))
        return None


# ---- parser -------------------------------------------------------------------------------------------------------
def _int_from(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int of at least ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value
    return parse


def _gate_limit(text: str) -> float:
    """A gate option: a finite number >= 0 (a negative or NaN slack fails a run against itself, inf passes anything)."""
    problem = argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    try:
        value = float(text)
    except ValueError:
        raise problem from None
    if not 0 <= value < float("inf"):
        raise problem
    return value


def _int_list(minimum: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated ints of at least ``minimum``, one or more (an argparse error for anything
    else: an empty list would be taken as the option left out)."""
    def parse(text: str) -> list[int]:
        problem = argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}")
        try:
            values = [int(v) for v in _split(text)]
        except ValueError:
            raise problem from None
        if not values:
            raise problem
        if any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"values must be >= {minimum}, got {text!r}")
        return values
    return parse


def _gpus(text: str) -> list[int]:
    """``--devices``: GPU indices, each once (two workers on one GPU would time each other's kernels)."""
    return _once(_int_list(minimum=0)(text), "GPU", "each GPU runs one worker")


def _suites(text: str) -> list[str]:
    """``--suite``: suite names, each once (a suite named twice runs twice: every result twice, an ambiguous file
    the gate refuses). None given is the runner's usage error."""
    return _once(_split(text), "suite", "name each once")


def _once(values: list, what: str, why: str) -> list:
    """``values``; an argparse error naming the first of them given more than once, and ``why`` once is right."""
    from mla_bench.errors import repeated

    twice = repeated(values)
    if twice is not None:
        raise argparse.ArgumentTypeError(f"{what} {twice!r} is given more than once: {why}")
    return values


def _names(text: str) -> list[str]:
    """An argparse type: comma-separated names, one or more (an empty list would be taken as the option left out,
    lifting its filter)."""
    names = _split(text)
    if not names:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated values, got {text!r}")
    return names


def _nonblank(text: str) -> str:
    """An argparse type: a value that is not blank (a blank one would be taken as the option left out)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a value, got {text!r}")
    return text


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


def _usage_error(message: str) -> int:
    console.print(Text(f"error: {message}", style="bold red"))
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mla-bench", description="Correctness and performance test-bench for "
                                     "Multi-head Latent Attention.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="list implementations and their capabilities")
    p.add_argument("--layouts", action="store_true", help="list the cache layouts instead")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("run", help="run suites over implementations, write results and a report")
    p.add_argument("--impl", default="all", help="impl names or module:Class, comma-separated, or 'all'")
    p.add_argument("--suite", type=_suites, default="accuracy", help=f"comma-separated of {', '.join(SUITE_CHOICES)}")
    p.add_argument("--preset", type=_nonblank, help="model preset (default: tiny on CPU unless --sweep is a gpu "
                                                    "sweep, else the GPU sweep's presets)")
    p.add_argument("--mode", type=_names, help="only these modes (comma-separated)")
    p.add_argument("--layout", type=_names,
                   help="run the cache-reading workloads with these layouts (comma-separated)")
    p.add_argument("--page-size", type=_int_list(minimum=1),
                   help="run the cache-reading workloads with these page sizes (comma-separated)")
    p.add_argument("--sweep", type=_nonblank,
                   help="sweep name (tiny, gpu, gpu-quick; default from the preset and device)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--devices", type=_gpus,
                   help="shard workloads over these GPUs, one worker process each (e.g. 0,1,2,3)")
    p.add_argument("--isolate", action="store_true", help="run each impl in its own process (crashes become errors)")
    p.add_argument("--stall-timeout", type=float, metavar="SECONDS",
                   help="with --isolate or --devices: kill a worker that sends no progress or result for this long "
                        "(counted from its start, so allow for its imports and CUDA start-up) and give its impls an "
                        "error naming the workload it hung on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dcp", type=_int_from(1), metavar="W",
                   help="run the decode workloads as decode context parallel over W processes (gloo on CPU, NCCL "
                        "over W GPUs); with --impl all, the DCP impl")
    p.add_argument("--dcp-interleave", type=_int_from(1), default=1, metavar="I",
                   help="with --dcp: token t lives on rank (t // I) %% W")
    p.add_argument("--out", type=_nonblank,
                   help="directory for run.json and report.html (default results/<time>-<device>)")
    p.add_argument("--no-report", action="store_true", help="write run.json only")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("report", help="write the self-contained HTML report of a run")
    p.add_argument("run", help="run.json")
    p.add_argument("-o", "--output", type=_nonblank, help="report path (default: report.html beside the run file)")
    p.add_argument("--rows", type=_int_from(0), default=REPORT_ROWS,
                   help=f"a pass/fail matrix or latency table of more workloads is summarized, every failure kept "
                        f"(default {REPORT_ROWS}; 0: never)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("compare", help="table of the differences between two runs")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rows", type=_int_from(0), default=COMPARE_ROWS,
                   help=f"list every result of runs this size or smaller, else every failure and regression and "
                        f"the largest other changes up to this many rows (default {COMPARE_ROWS}; 0: every result)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("gate", help="fail (exit 1) when a run regresses against a baseline")
    p.add_argument("run")
    p.add_argument("--baseline", required=True)
    p.add_argument("--error-slack", type=_gate_limit, default=0.25,
                   help="allowed error increase, as a fraction of the accuracy bound (default 0.25)")
    p.add_argument("--latency-slack", type=_gate_limit, default=0.10,
                   help="allowed relative slowdown before noise is considered (default 0.10)")
    p.add_argument("--noise-factor", type=_gate_limit, default=3.0,
                   help="a slowdown must also exceed this many IQRs of the baseline's timings (default 3)")
    p.add_argument("--allow-missing", action="store_true",
                   help="results that passed in the baseline may be absent from the run (a run of part of it)")
    p.set_defaults(func=cmd_gate)
    return parser


def main(argv: list[str] | None = None) -> int:
    # A traceback naming a path that is not UTF-8 holds lone surrogates: printed escaped, not a UnicodeEncodeError.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    return args.func(args)


def entry() -> None:
    """The ``mla-bench`` command: ``main``, then an exit that does not wait for threads an impl left running (the
    process hung after writing its results, for ever where such a thread never ends; ``--isolate`` kills workers
    that linger so)."""
    code = main()
    lingering = [t.name for t in threading.enumerate()
                 if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if not lingering:
        sys.exit(code)
    print(f"note: not waiting for {len(lingering)} thread(s) an impl left running: {', '.join(lingering)}",
          file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
