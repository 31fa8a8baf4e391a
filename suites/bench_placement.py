"""Benchmark: decode with the cache in host memory (attention on the CPU) against the cache on the GPU.

    python -m suites.bench_placement --out results/placement_bench.json

Over context lengths and batch sizes, the host-cache impl runs workloads whose cache lives on the CPU and each
device impl the same workloads with the cache on the device; every step goes through the placement suite (hidden
costs and rules), then a comparison table prints and everything is written as JSON. Without CUDA it runs on the
CPU with small contexts (both placements are then the same memory: a smoke run of the whole path).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from mla_bench.registry import resolve
from mla_bench.results import Result
from mla_bench.workload import Workload
from reports.hidden_costs import format_bytes, hidden_cost_table
from suites.base import RunContext
from suites.placement import PlacementSuite

GPU_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
CPU_CONTEXTS = (256, 1024)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m suites.bench_placement", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="deepseek-v3-tp8")
    parser.add_argument("--contexts", type=_ints, help=f"comma-separated context lengths (default {GPU_CONTEXTS} "
                        f"on CUDA, {CPU_CONTEXTS} on CPU)")
    parser.add_argument("--batches", type=_ints, default=[1, 8])
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--host-impl", default="torch_eager_host_cache", help="impl run with the cache on the CPU")
    parser.add_argument("--impls", default="torch_eager", help="comma-separated impls run with the cache on the device")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per point (median reported)")
    parser.add_argument("--out", type=Path, default=Path("results/placement_bench.json"))
    return parser


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every (batch, context) point for the host-cache impl and each device impl; returns the JSON document."""
    device = torch.device(args.device)
    contexts = args.contexts or (GPU_CONTEXTS if device.type == "cuda" else CPU_CONTEXTS)
    host = [resolve(args.host_impl)]
    on_device = [resolve(name) for name in args.impls.split(",") if name]
    results: list[Result] = []
    comparison = []
    for batch in args.batches:
        for context in contexts:
            w = Workload.uniform("decode", batch, 1, context, preset=args.preset, page_size=args.page_size)
            w_host = w.replace(cache_device="cpu")
            point = list(PlacementSuite([w_host], builders=(), reps=args.reps).run(RunContext(host, device)))
            point += PlacementSuite([w], builders=(), reps=args.reps).run(RunContext(on_device, device))
            results += point
            comparison.append(_compare(batch, context, point))
    return {"benchmark": "placement", "device": _device_name(device), "torch": torch.__version__,
            "command": " ".join(["python -m suites.bench_placement", *sys.argv[1:]]),
            "comparison": comparison, "results": [r.to_dict() for r in results]}


def _compare(batch: int, context: int, point: list[Result]) -> dict[str, Any]:
    """One row: step time and bus bytes per impl (``cache-cpu`` marks the host-cache run)."""
    row: dict[str, Any] = {"batch": batch, "context": context, "impls": {}}
    for r in point:
        if r.check == "hidden_cost" and r.status == "passed":
            m = r.metrics
            row["impls"][r.impl] = {"cache": r.workload.get("cache_device") or "device",
                                    "step_ms": m["plan_ms"] + m["run_ms"], "plan_ms": m["plan_ms"],
                                    "run_ms": m["run_ms"], "bus_bytes": m["h2d_bytes"] + m["d2h_bytes"],
                                    "syncs": m["syncs"]}
        elif r.status != "passed":
            row.setdefault("problems", []).append(f"{r.impl} {r.check} {r.status}: {r.message.splitlines()[-1:]}")
    return row


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def comparison_table(doc: dict[str, Any]) -> Table:
    table = Table(title=f"Decode step, cache on the CPU vs on the device ({doc['device']})")
    for column in ("batch", "context", "impl", "cache", "step ms", "plan ms", "run ms", "bus / step", "syncs"):
        table.add_column(column, justify="left" if column in ("impl", "cache") else "right")
    for row in doc["comparison"]:
        for name, m in row["impls"].items():
            table.add_row(str(row["batch"]), str(row["context"]), name, m["cache"], f"{m['step_ms']:.3f}",
                          f"{m['plan_ms']:.3f}", f"{m['run_ms']:.3f}", format_bytes(m["bus_bytes"]),
                          f"{m['syncs']:.0f}")
    return table


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    doc = run_bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    console = Console(width=200)
    console.print(hidden_cost_table([Result.from_dict(r) for r in doc["results"]]))
    console.print(comparison_table(doc))
    problems = [p for row in doc["comparison"] for p in row.get("problems", [])]
    for p in problems:
        console.print(f"[red]{p}[/]")
    console.print(f"wrote {args.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
