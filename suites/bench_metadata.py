"""Benchmark: paged-metadata build time per scheduler step, with host synchronizations and device copies counted.

    python -m suites.bench_metadata [--devices cpu,cuda] [--batches 1,4,16,64,256,1024] [--out bench.json]

Per batch size B (a mix of decode, MTP and prefill-chunk requests with contexts up to 4k, page size 64, block
table already on the device as engines keep it), three ways to build one step's metadata (query_start_loc,
kv_start_loc, seq_lens, slot mapping, FlashInfer CSR, flattened token page table, max_qo_len / max_kv_len):

- ``reference``: the plain host builders, then each tensor copied to the device;
- ``fast``: host-side sizes (``HostSizes``), the lengths in one pinned host-to-device copy, ``fast.build_step``;
- ``fast+triton``: the same with the Triton ``kv_indices`` kernel.

Reported: host time per step (what the scheduler thread pays; for CUDA the work is only launched), time per step
including the device work (steps back to back, one synchronize at the end), and per build the host
synchronizations and copies seen by torch.profiler (cudaStreamSynchronize / cudaDeviceSynchronize /
cudaEventSynchronize calls; cudaMemcpy* calls, by direction from the device trace), less what an empty build
shows, plus whether ``torch.cuda.set_sync_debug_mode("error")`` lets the build through. Each fast build is checked
equal to the reference first. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from mla_bench.metadata import fast, reference
from suites.metadata import difference

PAGE_SIZE = 64
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def request_mix(batch: int, seed: int) -> tuple[list[int], list[int]]:
    """Mostly decode (q 1), some MTP (q 4) and some prefill chunks (q up to 512); contexts up to 4096."""
    rng = random.Random(seed)
    q_lens, kv_lens = [], []
    for _ in range(batch):
        kind = rng.random()
        q = 1 if kind < 0.7 else 4 if kind < 0.9 else rng.randint(16, 512)
        kv = rng.randint(q, 4096)
        q_lens.append(q)
        kv_lens.append(kv)
    return q_lens, kv_lens


class Step:
    """One batch's inputs: host lengths, the device block table, and a pinned staging buffer for the lengths."""

    def __init__(self, batch: int, device: torch.device, seed: int) -> None:
        self.q_lens, self.kv_lens = request_mix(batch, seed)
        table, _ = reference.allocate_block_table(self.kv_lens, PAGE_SIZE, torch.Generator().manual_seed(seed))
        self.table_host = table
        self.table = table.to(device)
        self.device = device
        pinned = device.type == "cuda"
        self.staging = torch.empty(2, batch, dtype=torch.int32, pin_memory=pinned)
        self.lengths = torch.empty(2, batch, dtype=torch.int32, device=device)

    def reference(self) -> dict[str, torch.Tensor]:
        built = reference.build_step(self.q_lens, self.kv_lens, self.table_host, PAGE_SIZE)
        return {name: tensor.to(self.device) for name, tensor in built.items()}

    def fast(self, indices: Callable = fast.kv_indices) -> dict[str, torch.Tensor]:
        sizes = fast.HostSizes.of(self.q_lens, self.kv_lens, PAGE_SIZE)
        self.staging[0] = torch.tensor(self.q_lens, dtype=torch.int32)
        self.staging[1] = torch.tensor(self.kv_lens, dtype=torch.int32)
        lengths = self.lengths.copy_(self.staging, non_blocking=True) if self.device.type == "cuda" else self.staging
        return fast.build_step(lengths, self.table, PAGE_SIZE, sizes, indices)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_builds(build: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """(host ms per build, ms per build including the device work)."""
    for _ in range(3):
        build()
    _sync(device)
    host = 0.0
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        build()
        host += time.perf_counter() - t0
    _sync(device)
    return host / repeats * 1e3, (time.perf_counter() - start) / repeats * 1e3


def _profile_counts(build: Callable[[], object], device: torch.device) -> Counter:
    """Synchronizing CUDA runtime calls and memcpy runtime calls (with the copies' directions from the device
    trace) made while ``build`` runs."""
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        build()
    _sync(device)
    counts = Counter()
    for name in (event.name for event in prof.events()):
        counts["syncs"] += name in SYNC_EVENTS
        counts["copies"] += name.startswith("cudaMemcpy")
        if name.startswith("Memcpy"):
            counts[next((d for d in ("HtoD", "DtoH", "DtoD") if d in name), "other")] += 1
    return counts


def count_events(build: Callable[[], object], device: torch.device) -> dict[str, int | bool]:
    """Per build (CUDA only): host synchronizations and copies, less what profiling an empty build shows (the
    profiler's own synchronization), and whether ``set_sync_debug_mode("error")`` lets the build through."""
    counts = _profile_counts(build, device)
    counts.subtract(_profile_counts(lambda: None, device))
    torch.cuda.set_sync_debug_mode("error")
    try:
        build()
        sync_free = True
    except RuntimeError:
        sync_free = False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"syncs": counts["syncs"], "copies": counts["copies"], "h2d": counts["HtoD"], "d2h": counts["DtoH"],
            "d2d": counts["DtoD"], "sync_free": sync_free}


def bench(devices: list[torch.device], batches: list[int], repeats: int, seed: int) -> list[dict]:
    from impls.triton.cache_ops import triton_unavailable
    from impls.triton.kv_indices import kv_indices_triton

    rows = []
    for device in devices:
        for batch in batches:
            step = Step(batch, device, seed)
            expect = reference.build_step(step.q_lens, step.kv_lens, step.table_host, PAGE_SIZE)
            ways = {"reference": step.reference, "fast": step.fast}
            if device.type == "cuda" and triton_unavailable(device) is None:  # the interpreter is no timing target
                ways["fast+triton"] = lambda: step.fast(kv_indices_triton)
            for way, build in ways.items():
                got = build()
                wrong = [f"{k}: {problem}" for k in expect if (problem := difference(got[k], expect[k]))]
                if wrong:
                    raise AssertionError(f"{way} on {device} B={batch} differs from the reference in {wrong}")
                host_ms, total_ms = time_builds(build, device, repeats if way != "reference" else max(3, repeats // 4))
                row = {"device": device.type, "batch": batch, "way": way, "host_ms": host_ms, "total_ms": total_ms,
                       "tokens": sum(step.q_lens), "pages": fast.HostSizes.of(step.q_lens, step.kv_lens,
                                                                              PAGE_SIZE).num_pages}
                if device.type == "cuda":
                    row.update(count_events(build, device))
                rows.append(row)
    return rows


def table(rows: list[dict]) -> Table:
    out = Table(title=f"metadata build per step (page size {PAGE_SIZE}; ms; syncs / copies per build)")
    for column in ("device", "B", "way", "host ms", "with device ms", "syncs", "copies (H2D/D2H/D2D)", "sync-free"):
        out.add_column(column, justify="right")
    for r in rows:
        copies = f"{r['copies']} ({r['h2d']}/{r['d2h']}/{r['d2d']})" if "copies" in r else "-"
        out.add_row(r["device"], str(r["batch"]), r["way"], f"{r['host_ms']:.3f}", f"{r['total_ms']:.3f}",
                    str(r.get("syncs", "-")), copies, {True: "yes", False: "no"}.get(r.get("sync_free"), "-"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m suites.bench_metadata", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cpu,cuda", help="comma-separated; cuda is skipped without a GPU")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512,1024")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = [torch.device(d) for d in args.devices.split(",") if d != "cuda" or torch.cuda.is_available()]
    rows = bench(devices, [int(b) for b in args.batches.split(",")], args.repeats, args.seed)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    Console(width=140).print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
