"""What a suite is: a named generator of Results over a run's context.

The runner builds one ``RunContext`` from the command line (or a test) and asks each selected suite for its
results; a suite never exits the process and never lets one impl's crash stop the others.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from mla_bench.errors import UnsupportedConfig, reraise_interrupt
from mla_bench.registry import Impl, ImplEntry, ImplNotInstalled
from mla_bench.results import Result


def refusal(exc: UnsupportedConfig) -> tuple[str, str]:
    """The status and message of an impl's refusal: ``unsupported`` with its reason, or ``error`` when it gives none
    (an unsupported result that does not say why tells its reader nothing): one non-blank string, not ``None``, an
    empty pair or an object."""
    reason = exc.args[0] if len(exc.args) == 1 else None
    if isinstance(reason, str) and reason.strip():
        return "unsupported", reason
    return "error", ("raised UnsupportedConfig with no reason: a refusal must say what it does not support\n"
                     + traceback.format_exc())


@dataclass
class RunContext:
    """What the user asked for. Empty filters mean the suite's own defaults."""

    impls: list[ImplEntry]
    device: torch.device
    preset: str | None = None
    modes: list[str] = field(default_factory=list)
    layouts: list[str] = field(default_factory=list)
    page_sizes: list[int] = field(default_factory=list)
    seed: int = 0
    progress: Callable[[str], None] = lambda label: None  # called once per unit of work, for the progress bar
    sweep: str | None = None  # a name in suites.sweeps.SWEEPS; None: the default for the preset and device
    shard: int = 0            # this worker's index when workloads are sharded over GPUs (suites.sweeps.shard)
    shards: int = 1
    dcp_world: int | None = None  # --dcp W: run the decode workloads as decode context parallel over W ranks
    dcp_interleave: int = 1
    impl_free: bool = True  # run the checks that test no impl (metadata builders, codecs, cache ops): under
    #                         --isolate only the first worker does, so that each runs once


class Suite(Protocol):
    """A named generator of Results. A suite that splits its workloads with ``suites.sweeps.shard`` sets
    ``shardable = True`` (the runner then runs it on every GPU); others run once, on the first worker.
    A suite may define ``workloads(ctx)``, the units of work ``run`` goes through (one progress step each), so the
    progress bar knows its length and the runner can refuse filters that leave it nothing to run.
    ``unapplied_filters`` names the ``RunContext`` filters the suite does not apply (none when absent), so the runner
    can say so when they are given."""

    name: str
    unapplied_filters: tuple[str, ...] = ()

    def run(self, ctx: RunContext) -> Iterator[Result]:
        """Yield one Result per check."""


def load_impls(ctx: RunContext, suite: str) -> tuple[list[Impl], list[Result]]:
    """Instantiate the context's impls; each that cannot be (``load_impl``) gives a Result instead, and the others
    still load."""
    impls, results = [], []
    for entry in ctx.impls:
        impl, failure = load_impl(entry)
        if impl is not None:
            impls.append(impl)
        else:
            status, message = failure
            results.append(Result(suite, suite, status, impl=entry.name, label="(all workloads)", message=message))
    return impls, results


def load_impl(entry: ImplEntry) -> tuple[Impl | None, tuple[str, str] | None]:
    """``entry``'s impl, else None with the status and message of its failure: ``unsupported`` where it is not
    installed, ``error`` with the traceback where it fails to load (``sys.exit`` too: a broken impl is a result, not
    the run's end)."""
    try:
        return entry.load(), None
    except ImplNotInstalled as exc:
        return None, ("unsupported", f"not installed: {exc}")
    except BaseException as exc:  # noqa: BLE001
        reraise_interrupt(exc)
        return None, ("error", f"could not load {entry.target}:\n{traceback.format_exc()}")
