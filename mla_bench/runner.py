"""Run suites over impls and collect one ``Run``: in this process, or in worker processes.

In-process is the default. ``isolate`` runs each impl in its own worker, so a hard crash (an illegal memory
access, an abort) becomes an ``error`` Result for that impl instead of the end of the run. ``devices`` shards
the workloads of shardable suites over GPUs, one worker per GPU (``CUDA_VISIBLE_DEVICES`` set to it); other
suites run once, on the first worker. On CPU, ``devices`` gives that many CPU workers. ``stall_timeout`` kills a
worker that sends nothing for that many seconds (a hung impl), with every process it started (a DCP run's ranks),
which also ends as an ``error`` Result per impl. A worker dies with the runner, and a DCP rank with its worker,
however either ends (``mla_bench.lifetime``).

A worker is this module run as ``python -m mla_bench.runner``: it reads its job (JSON) on stdin and writes
JSON lines (its device, progress, results, done) on a private copy of stdout; anything the impls print goes to
stderr, whose tail is kept when the worker dies.

Every result carries the device that produced it (``Result.device``), and the run lists those devices
(``Run.devices``): the GPUs of one ``--devices`` run may be of several models.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from mla_bench import environment
from mla_bench.device import make_current, pick_device
from mla_bench.errors import about_flag, reraise_interrupt
from mla_bench.lifetime import die_with_parent
from mla_bench.registry import ImplEntry, check_distinct_names, discover, resolve
from mla_bench.results import Device, Result, Run
from mla_bench.timing import CEILINGS_CHECK
from mla_bench.workload import Mode, Workload

_STDERR_TAIL = 4000
# A workload's paged cache may take at most this share of the host's memory, where every cache is written first: a
# judge holds it twice (the problem's and its InputGuard's copy), and the GPU's memory is of the host's order.
CACHE_MEMORY_SHARE = 0.25
EXIT_GRACE_S = 30.0  # how long a worker that sent all its results may take to exit
# The command line's flag for each filter (RunContext field) that a suite may leave unapplied.
_FLAGS = {"impls": "--impl", "modes": "--mode", "layouts": "--layout", "page_sizes": "--page-size",
          "sweep": "--sweep", "dcp_world": "--dcp"}
# The filters that can leave a suite nothing to run (its other filters reshape workloads, never drop them all).
_NARROWING = ("impls", "modes", "dcp_world")


@dataclass
class RunOptions:
    """What ``mla-bench run`` was asked for (``impls`` / ``suites`` may be ``["all"]``)."""

    impls: list[str] = field(default_factory=lambda: ["all"])
    suites: list[str] = field(default_factory=lambda: ["accuracy"])
    device: str = "auto"
    preset: str | None = None
    modes: list[str] = field(default_factory=list)
    layouts: list[str] = field(default_factory=list)
    page_sizes: list[int] = field(default_factory=list)
    seed: int = 0
    sweep: str | None = None
    devices: list[int] = field(default_factory=list)
    isolate: bool = False
    stall_timeout: float | None = None
    dcp_world: int | None = None
    dcp_interleave: int = 1


class Progress:
    """What the runner reports while it works (the CLI draws a rich progress bar from it)."""

    def start(self, total: int | None) -> None:
        """The number of workload steps to come, or None when a suite cannot say."""

    def advance(self, label: str) -> None:
        """One workload step began."""


@dataclass
class Selection:
    """A run checked and ready: its device, impls and suites; ``results`` holds an ``error`` per named suite that
    could not load, ``notes`` remarks for the user (suites skipped, filters a suite does not apply), ``counts``
    each suite's workloads in this process (None where a suite cannot say), listed once for the check and the
    progress bar."""

    options: RunOptions
    device: torch.device
    entries: list[ImplEntry]
    suites: list[tuple[str, Any]]
    results: list[Result]
    notes: list[str]
    counts: list[int | None]


def resolve_impls(specs: list[str]) -> list[ImplEntry]:
    """Impl entries by name or ``module:Class``; ``all`` is every discoverable impl, and those given beside it
    (``all,mypkg:MyMLA``) are added. ValueError for none, or for two impls of one name (their results would share
    keys)."""
    if not specs:
        raise ValueError("no impl given: name impls, module:Class, or 'all'")
    entries = [entry for _, entry in sorted(discover().items())] if "all" in specs else []
    known = {entry.name for entry in entries}
    entries += [resolve(spec) for spec in specs if spec != "all" and spec not in known]
    check_distinct_names(entries)
    return entries


def select_run(options: RunOptions) -> Selection:
    """Resolve and check everything ``options`` asks for before anything runs; a ValueError names the problem
    (unknown impl, suite, preset, sweep, mode or layout, a bad value, filters that leave nothing to run) and the
    command line's flag it is about. An impl given as ``module:Class`` whose module cannot be imported raises
    ``ImplNotInstalled``."""
    from suites.sweeps import check_filters

    _check_stall_timeout(options)
    with about_flag("--device"):
        device = pick_device(options.device)
    with about_flag("--impl"):
        entries = resolve_impls(options.impls)
    notes: list[str] = []
    with about_flag("--suite"):
        suites, results = _select_suites(options.suites, notes)
    ctx = _context(options, device, entries, Progress())
    check_filters(ctx)
    counts = _counts(suites, ctx)
    _check_not_emptied(options, suites, counts, ctx)
    _check_caches_fit(options, suites, ctx)
    notes += _unapplied_filter_notes(options, suites) + _one_gpu_a_worker_notes(options, device, suites)
    return Selection(options, device, entries, suites, results, notes, counts)


def _one_gpu_a_worker_notes(options: RunOptions, device: torch.device, suites: list[tuple[str, Any]]) -> list[str]:
    """``--devices`` on CUDA gives each worker one GPU, where DCP over W ranks needs W: ``--dcp`` then tests nothing
    (a ValueError), and the equivalence suite's DCP checks are unsupported (a note). A GPU index past the visible
    ones is a ValueError too."""
    if not options.devices or device.type != "cuda":
        return []
    past = [i for i in options.devices if i >= torch.cuda.device_count()]
    if past:
        raise ValueError(f"--devices {','.join(map(str, past))} asked for, but {torch.cuda.device_count()} GPU(s) "
                         "are visible")
    if options.dcp_world:
        raise ValueError(f"--dcp {options.dcp_world} runs {options.dcp_world} ranks on as many GPUs of one worker; "
                         "--devices gives each worker one GPU: leave --devices out")
    if any(name == "equivalence" for name, _ in suites):
        return ["note: --devices gives each worker one GPU: the equivalence suite's DCP checks are unsupported"]
    return []


def execute(options: RunOptions, progress: Progress | None = None, notes: list[str] | None = None) -> Run:
    """Check (``select_run``) and run everything ``options`` asks for. ``notes`` collects remarks for the user."""
    selection = select_run(options)
    if notes is not None:
        notes += selection.notes
    return run_selection(selection, progress)


def run_selection(selection: Selection, progress: Progress | None = None) -> Run:
    """Run a checked selection: in this process, or in worker processes (``isolate``, ``devices``)."""
    progress = progress or Progress()
    options, device, entries, suites = selection.options, selection.device, selection.entries, selection.suites
    results = list(selection.results)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if options.isolate or options.devices:
        devices, found = _execute_workers(options, device, entries, [name for name, _ in suites], progress)
    else:
        make_current(device)
        devices = [environment.describe(device, _device_id(device, None))]
        ctx = _context(options, device, entries, progress)
        progress.start(_total(selection.counts))
        found = _ran_on(devices[0].id, (r for name, suite in suites for r in run_suite(name, suite, ctx)))
    results += found
    ceilings = {r.label: dict(r.metrics) for r in results if r.check == CEILINGS_CHECK}
    results = [r for r in results if r.check != CEILINGS_CHECK]
    return Run(environment=environment.collect(device, devices), results=results, ceilings=ceilings,
               created=started, command=list(sys.argv), devices=devices)


def _device_id(device: torch.device, slot: int | None) -> str:
    """The ``Device.id`` of a worker given GPU ``slot`` (``--devices``), or, with no slot, of ``device``: ``cpu``, or
    ``cuda:N`` for the host's GPU N (a bare ``cuda`` is GPU 0: the bench makes only a ``cuda:N`` current)."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{slot if slot is not None else device.index or 0}"


def _ran_on(device_id: str, results: Iterable[Result]) -> list[Result]:
    """``results``, each marked as produced by the device ``device_id``."""
    return [dataclasses.replace(r, device=device_id) for r in results]


def run_suite(name: str, suite: Any, ctx) -> Iterator[Result]:
    """The suite's Results; if the suite itself crashes (``sys.exit`` or GeneratorExit an impl raised too, where the
    suite let it through), one ``error`` Result with the traceback ends it. Driven by hand: a GeneratorExit that
    ``close()`` throws into this generator arrives at its ``yield``, outside the handler, and ends it."""
    results = None
    try:
        while True:
            try:
                results = iter(suite.run(ctx)) if results is None else results
                result = next(results)
            except StopIteration:
                return
            except BaseException as exc:  # noqa: BLE001 - a broken suite must not stop the other suites
                reraise_interrupt(exc)
                yield Result(name, name, "error", label="(suite)",
                             message=f"suite {name} crashed:\n{traceback.format_exc()}")
                return
            yield result
    finally:
        if hasattr(results, "close"):
            results.close()


def untested_impls(selection: Selection, run: Run) -> dict[str, Counter[str]]:
    """The impls named explicitly (not through ``all``) whose every result is ``unsupported``, each with how often
    each reason (a result's one-line brief) was given. Such an impl was tested on nothing, which ``run.ok``
    (unsupported counts as ok) does not show. Under ``all``, peers that are not installed are expected to be
    unsupported; an impl with no result at all (suites like metadata test our own parts) is not counted."""
    named = set(selection.options.impls) - {"all"}
    untested = {}
    for entry in selection.entries:
        if entry.name not in named and _spec(entry) not in named:
            continue
        mine = [r for r in run.results if r.impl == entry.name]
        if mine and all(r.status == "unsupported" for r in mine):
            untested[entry.name] = Counter(r.brief for r in mine)
    return untested


def _check_stall_timeout(options: RunOptions) -> None:
    """ValueError unless ``stall_timeout`` is unset, or a finite number of seconds > 0 for a run in workers."""
    if options.stall_timeout is None:
        return
    if not (options.isolate or options.devices):
        raise ValueError("--stall-timeout needs --isolate or --devices: a hang in this process cannot be "
                         "interrupted, only a worker process can be killed")
    if not 0 < options.stall_timeout < math.inf:
        raise ValueError(f"--stall-timeout must be a number of seconds > 0, got {options.stall_timeout}")


def _select_suites(names: list[str], notes: list[str]) -> tuple[list[tuple[str, Any]], list[Result]]:
    """The suites named (``all``: every registered one) and an ``error`` Result per named suite that cannot load;
    ValueError for an unknown name or none."""
    from suites.registry import SUITES, SuiteNotAvailable, load_suite

    if not names:
        raise ValueError(f"no suite given: name suites ({', '.join(SUITES)}) or 'all'")
    wanted = list(SUITES) if "all" in names else names
    chosen, results = [], []
    for name in wanted:
        try:
            chosen.append((name, load_suite(name)))
        except SuiteNotAvailable as exc:
            if "all" in names:
                notes.append(f"skipped: {exc}")
            else:
                results.append(Result(name, name, "error", label="(suite)", message=str(exc)))
        except ValueError:
            raise
        except Exception:  # noqa: BLE001 - a suite that fails to import is an error of that suite only
            results.append(Result(name, name, "error", label="(suite)",
                                  message=f"suite {name} failed to load:\n{traceback.format_exc()}"))
    return chosen, results


def _check_not_emptied(options: RunOptions, suites: list[tuple[str, Any]], counts: list[int | None], ctx) -> None:
    """ValueError when no selected suite has a workload to run and the filters given (``_NARROWING``) emptied some,
    naming the filters that did and the suites. A suite that cannot list its workloads (count None) counts as
    having some; one that lists none even unfiltered (latency on a CPU, which says so in a result) was not emptied."""
    from suites.sweeps import sweep_of

    if any(count != 0 for count in counts):
        return
    given = [name for name in _NARROWING if _given(options, name)]
    emptied = _with_work(suites, _lifted(ctx, given))
    if not emptied:
        return
    # The filters whose lifting alone gives a suite work; when none does alone, they empty it together.
    culprits = [name for name in given if _with_work(emptied, _lifted(ctx, [name]))] or given
    swept = [name for name, suite in emptied if "sweep" not in _unapplied(suite)]
    own = [name for name, suite in emptied if "sweep" in _unapplied(suite)]
    where = [f"of the {sweep_of(ctx)} sweep (suites {', '.join(swept)})"] if swept else []
    where += [f"of suites {', '.join(own)}"] if own else []
    flags = " with ".join(f"{_FLAGS[name]} {_value(options, name)}" for name in culprits)
    raise ValueError(f"nothing to run: {flags} selects no workload {' nor '.join(where)}")


def _check_caches_fit(options: RunOptions, suites: list[tuple[str, Any]], ctx) -> None:
    """ValueError naming the workload with the largest paged cache (``Workload.cache_bytes``) when that takes more
    than ``CACHE_MEMORY_SHARE`` of the host's memory, and ``--page-size`` when one was given (a cache holds whole
    pages): a page size of 1,000,000 failed every result on allocation, one after another. The host's memory only:
    asking CUDA for the GPU's would start CUDA in this process, which a run over workers leaves to them."""
    workloads = [w for _, suite in suites for w in _listed(suite, ctx) or [] if isinstance(w, Workload)]
    if not workloads:
        return
    largest = max(workloads, key=lambda w: w.cache_bytes)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if largest.cache_bytes > CACHE_MEMORY_SHARE * memory:
        flag = f"{_FLAGS['page_sizes']} {_value(options, 'page_sizes')}: " if options.page_sizes else ""
        raise ValueError(f"{flag}the paged cache of workload {largest.label} takes {largest.cache_bytes / 2**30:.1f} "
                         f"GiB (whole pages of {largest.page_size} tokens), more than {CACHE_MEMORY_SHARE:.0%} of the "
                         f"host's {memory / 2**30:.1f} GiB of memory")


def _with_work(suites: list[tuple[str, Any]], ctx) -> list[tuple[str, Any]]:
    """The suites that list some workload for ``ctx``."""
    return [(name, suite) for name, suite in suites if _workload_count(suite, ctx)]


def _lifted(ctx, filters: list[str]):
    """``ctx`` without the ``_NARROWING`` filters named: every discoverable impl, every mode, no DCP."""
    changes: dict[str, Any] = {}
    if "impls" in filters:
        changes["impls"] = resolve_impls(["all"])
    if "modes" in filters:
        changes["modes"] = []
    if "dcp_world" in filters:
        changes.update(dcp_world=None, dcp_interleave=1)
    return dataclasses.replace(ctx, **changes)


def _unapplied_filter_notes(options: RunOptions, suites: list[tuple[str, Any]]) -> list[str]:
    """One note per filter given that a selected suite does not apply (its ``unapplied_filters``), and for
    ``--layout`` / ``--page-size`` when every mode given reads no cache (its workloads then take neither)."""
    notes = []
    for name, flag in _FLAGS.items():
        unapplied = [suite_name for suite_name, suite in suites if name in _unapplied(suite)]
        if _given(options, name) and unapplied:
            notes.append(f"note: {flag} is not applied by suite(s) {', '.join(unapplied)}")
    if options.modes and not any(Mode(mode).uses_cache for mode in options.modes):
        for name in ("layouts", "page_sizes"):
            if getattr(options, name):
                notes.append(f"note: {_FLAGS[name]} is not applied to the workloads of --mode "
                             f"{','.join(options.modes)}: they read no cache")
    return notes


def _unapplied(suite: Any) -> tuple[str, ...]:
    """The filters ``suite`` does not apply (``Suite.unapplied_filters``; none when it does not say)."""
    return getattr(suite, "unapplied_filters", ())


def _given(options: RunOptions, name: str) -> bool:
    """Whether the filter ``name`` narrows the run (``--impl all`` does not)."""
    value = getattr(options, name)
    return bool(value) and not (isinstance(value, list) and "all" in value)


def _value(options: RunOptions, name: str) -> str:
    """The filter ``name`` as given on the command line, e.g. ``decode,prefill``."""
    value = getattr(options, name)
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _context(options: RunOptions, device: torch.device, entries: list[ImplEntry], progress: Progress,
             shard: int = 0, shards: int = 1, impl_free: bool = True):
    from suites.base import RunContext

    return RunContext(impls=entries, device=device, preset=options.preset, modes=list(options.modes),
                      layouts=list(options.layouts), page_sizes=list(options.page_sizes), seed=options.seed,
                      progress=progress.advance, sweep=options.sweep, shard=shard, shards=shards,
                      dcp_world=options.dcp_world, dcp_interleave=options.dcp_interleave, impl_free=impl_free)


def _runs_in_shard(suite: Any, shard: int) -> bool:
    return shard == 0 or getattr(suite, "shardable", False)


def _counts(suites: list[tuple[str, Any]], ctx) -> list[int | None]:
    """Each suite's workload count for ``ctx`` (None where it cannot say); 0 for one that skips ctx's shard."""
    return [_workload_count(suite, ctx) if _runs_in_shard(suite, ctx.shard) else 0 for _, suite in suites]


def _total(counts: list[int | None]) -> int | None:
    """The workload steps to come, or None if a suite cannot say."""
    return None if None in counts else sum(counts)


def _workload_count(suite: Any, ctx) -> int | None:
    """How many workloads ``suite`` lists for ``ctx``; None when it cannot say (``_listed``)."""
    listed = _listed(suite, ctx)
    return None if listed is None else len(listed)


def _listed(suite: Any, ctx) -> list | None:
    """What ``suite`` lists for ``ctx`` (its ``workloads``); None when it cannot say (no ``workloads``, or it
    raised)."""
    workloads = getattr(suite, "workloads", None)
    if not callable(workloads):
        return None
    try:
        return list(workloads(ctx))
    except Exception:  # noqa: BLE001 - the suite itself will report the problem when it runs
        return None


# ---- workers ------------------------------------------------------------------------------------------------------
def _spec(entry: ImplEntry) -> str:
    return entry.target if entry.origin == "path" else entry.name


def _execute_workers(options: RunOptions, device: torch.device, entries: list[ImplEntry], suite_names: list[str],
                     progress: Progress) -> tuple[list[Device], list[Result]]:
    """The devices of the workers' slots (one a slot, as its workers described it) and every worker's results."""
    from suites.registry import load_suite

    slots = options.devices or [None]
    groups = [[e] for e in entries] if options.isolate else [entries]
    jobs: dict[int, list[dict[str, Any]]] = {}
    for shard, slot in enumerate(slots):
        jobs[shard] = [{"options": asdict(options), "impls": [_spec(e) for e in group],
                        "names": [e.name for e in group], "suites": suite_names,
                        "device": device.type if slot is not None else str(device),  # cuda:N without --devices
                        "device_id": _device_id(device, slot), "shard": shard, "shards": len(slots),
                        "visible_device": slot, "parent": os.getpid(), "impl_free": index == 0}
                       for index, group in enumerate(groups)]
    suites = [(name, load_suite(name)) for name in suite_names]
    contexts = [_context(options, device, group, progress, shard, len(slots), index == 0)
                for shard in jobs for index, group in enumerate(groups)]
    progress.start(_total([count for ctx in contexts for count in _counts(suites, ctx)]))
    collected: dict[tuple[int, int], list[Result]] = {}
    described: dict[str, Device] = {}  # by id: the first that a worker of the slot described
    lock = threading.Lock()

    def work(shard: int) -> None:
        for index, job in enumerate(jobs[shard]):
            try:
                device_of_job, found = _run_worker(job, progress)
            except Exception:  # noqa: BLE001 - the runner failed one job: its impls get an error, the rest run
                device_of_job = None
                found = [Result("run", "worker", "error", impl=name, label="(runner)",
                                message=f"running the worker of {name} failed:\n{traceback.format_exc()}")
                         for name in job["names"]]
            with lock:
                collected[(shard, index)] = _ran_on(job["device_id"], found)
                if device_of_job is not None:
                    described.setdefault(device_of_job.id, device_of_job)

    # daemon: an interrupted run (Ctrl-C) does not wait for the threads to start the jobs left
    threads = [threading.Thread(target=work, args=(shard,), daemon=True) for shard in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # In slot order, once each (CPU workers share "cpu"); one that no worker described before it died by its id only.
    ids = dict.fromkeys(jobs[shard][0]["device_id"] for shard in sorted(jobs))
    return [described.get(i, Device(i)) for i in ids], [r for key in sorted(collected) for r in collected[key]]


def _run_worker(job: dict[str, Any], progress: Progress) -> tuple[Device | None, list[Result]]:
    """Run one job in a fresh interpreter: the device it described (None when it died first) and its results. A
    worker that dies, or stalls past the job's ``stall_timeout``, yields an ``error`` Result per impl of the job."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    if job["visible_device"] is not None and job["device"] == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = _host_gpu(job["visible_device"])
    results, last, done, device = [], "(before the first workload)", False, None
    limit = job["options"]["stall_timeout"]
    with tempfile.TemporaryFile(mode="w+b") as stderr:  # bytes: an impl may print any
        proc = subprocess.Popen([sys.executable, "-m", "mla_bench.runner"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr, env=env, text=True)
        watchdog = _Watchdog(proc, limit) if limit else None
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        for line in proc.stdout:
            if watchdog:
                watchdog.heard()
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "device" in message:
                device = Device.from_dict(message["device"])
            elif "progress" in message:
                last = str(message["progress"])
                progress.advance(last)
            elif "result" in message:
                results.append(Result.from_dict(message["result"]))
            elif message.get("done"):
                done = True
        try:
            code = proc.wait(EXIT_GRACE_S if done else None)  # done: its results are in, only its exit is left
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            code = proc.wait()
        if watchdog:
            watchdog.stop()
        stderr.seek(0)
        tail = stderr.read()[-_STDERR_TAIL:].decode("utf-8", errors="replace")
    if code == 0 and done:
        return device, results
    if done:  # every result arrived: the worker hung or crashed on its way out (a thread or a communicator left)
        last = "(at exit)"
        how = (f"finished its workloads, then did not exit within {EXIT_GRACE_S:g} s and was killed"
               if code == -signal.SIGKILL else f"finished its workloads, then exited with code {code}")
    elif watchdog and watchdog.stalled:
        how = f"made no progress for {limit:g} s (--stall-timeout) and was killed"
    else:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    for name in job["names"]:
        results.append(Result("run", "worker", "error", impl=name, label=last,
                              message=f"the worker running {name} {how} during '{last}' "
                                      f"(shard {job['shard']} of {job['shards']}).\nstderr tail:\n{tail}"))
    return device, results


def _host_gpu(slot: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of the runner's GPU ``slot``: the runner's own list maps it when it was
    started with one (``CUDA_VISIBLE_DEVICES=4,5 mla-bench run --devices 0,1`` runs on GPUs 4 and 5, not 0 and 1)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return visible.split(",")[slot].strip() if visible else str(slot)


class _Watchdog:
    """Kills ``proc`` once ``limit`` seconds pass without ``heard()``, counted from its creation (the worker's
    start)."""

    def __init__(self, proc: subprocess.Popen, limit: float) -> None:
        self.proc, self.limit, self.last, self.stalled = proc, limit, time.monotonic(), False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def heard(self) -> None:
        self.last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stopped.wait(self.last + self.limit - time.monotonic()):
            if time.monotonic() - self.last >= self.limit:
                self.stalled = True
                _kill_tree(self.proc.pid)
                return


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it. Its descendants are found first, while the tree still links them
    (a killed worker's DCP ranks would otherwise live on, holding their GPUs); where there is no ``/proc``, only
    ``pid``."""
    doomed = [pid] + _descendants(pid)
    for each in doomed:
        try:
            os.kill(each, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone already, or its pid taken by another user's process


def _descendants(pid: int) -> list[int]:
    """The pids below ``pid`` in the process tree, read from ``/proc/<pid>/stat`` (empty where there is none)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue  # /proc/self and the like
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone since the listing
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, queue = [], [pid]
    while queue:
        below = children.get(queue.pop(), [])
        found += below
        queue += below
    return found


def _worker_main() -> int:
    """Entry of a worker process: run the job read from stdin, stream JSON lines to the parent."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the impls print (even from C) goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    job = json.loads(sys.stdin.read())
    die_with_parent(job["parent"])  # a worker outlives no runner, however the runner ends
    send: Callable[[dict], None] = lambda message: channel.write(json.dumps(message) + "\n")

    class Relay(Progress):
        def advance(self, label: str) -> None:
            send({"progress": label})

    from suites.registry import load_suite

    options = RunOptions(**job["options"])
    device = pick_device(job["device"])
    make_current(device)
    send({"device": asdict(environment.describe(device, job["device_id"]))})
    entries = [resolve(spec) for spec in job["impls"]]
    ctx = _context(options, device, entries, Relay(), job["shard"], job["shards"], job["impl_free"])
    for name in job["suites"]:
        suite = load_suite(name)
        if not _runs_in_shard(suite, job["shard"]):
            continue
        for result in run_suite(name, suite, ctx):
            send({"result": result.to_dict()})
    send({"done": True})
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
