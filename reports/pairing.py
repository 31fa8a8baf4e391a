"""Match the Results of two runs: the same suite, check, impl, workload and label are the same result."""

from __future__ import annotations

import json
from typing import Iterator

from mla_bench.results import Result, Run

# The number that stands for a result in a comparison, per suite.
HEADLINE = {"accuracy": "kernel.rel_l2", "equivalence": "pair.rel_l2", "latency": "run_ms"}

Key = tuple[str, str, str, str]


def result_key(result: Result) -> Key:
    """What identifies a result across runs. The label is part of it: one workload may carry several results of
    one check told apart by their label only (placement's metadata_sync, one per metadata builder)."""
    what = json.dumps([result.workload, result.label], sort_keys=True)
    return (result.suite, result.check, result.impl or "", what)


def index(run: Run) -> dict[Key, Result]:
    """Results by key (a later duplicate wins: see ``duplicates``)."""
    return {result_key(r): r for r in run.results}


def duplicates(run: Run) -> dict[Key, list[Result]]:
    """The results of each key that several results of ``run`` share: which of them is the result is ambiguous."""
    groups: dict[Key, list[Result]] = {}
    for r in run.results:
        groups.setdefault(result_key(r), []).append(r)
    return {key: group for key, group in groups.items() if len(group) > 1}


def pair(a: Run, b: Run) -> Iterator[tuple[Key, Result | None, Result | None]]:
    """Every key of either run, with its Result in ``a`` and in ``b`` (None where absent), in ``b``'s order
    then ``a``'s leftovers."""
    in_a, in_b = index(a), index(b)
    for key, result in in_b.items():
        yield key, in_a.get(key), result
    for key, result in in_a.items():
        if key not in in_b:
            yield key, result, None


def headline(result: Result | None) -> float | None:
    if result is None:
        return None
    name = HEADLINE.get(result.suite)
    value = result.metrics.get(name) if name else None
    return float(value) if value is not None else None


def same_gpu(a: Run, b: Run) -> bool:
    """Latencies compare only between runs on the same GPU model."""
    gpu_a, gpu_b = a.environment.get("gpu"), b.environment.get("gpu")
    return gpu_a is not None and gpu_a == gpu_b


def measured_on(r: Result) -> str | None:
    """The GPU model a latency result was measured on: the latency suite names it in ``details["device"]`` (every
    version of it), the very name that keys the run's ceilings of that model. None where a file does not say."""
    model = r.details.get("device")
    return model if isinstance(model, str) else None


def measured_on_one_model(a: Result | None, b: Result | None) -> bool:
    """Two latency results measured on one GPU model, where both exist and say which (in a run over several models,
    two runs of the same mix may shard a workload onto different ones)."""
    models = [measured_on(r) for r in (a, b) if r is not None]
    return None in models or len(set(models)) < 2
