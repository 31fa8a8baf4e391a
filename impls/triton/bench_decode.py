"""Check and time the Triton paged MLA decode on a GPU: ``python -m impls.triton.bench_decode [--profile NAME]``.

Self-contained (the bench's latency suite will supersede the timing part):

1. correctness of every layout, page size and query-length mode against the float64 reference (``judge``);
2. the device's ceilings: device-to-device copy bandwidth (bytes read + written) and a bf16 8192^3 matmul;
3. latency of the issue's shapes under several kernel configurations: CUDA-graph replay of calls that rotate
   over enough input copies to exceed 4x the L2 (cold L2), median of the samples; GB/s counts the cache bytes
   of the real tokens, the queries and the outputs; TFLOP/s counts 2 * (576 + 512) per (query row, visible key).

Writes ``$OUT/decode_bench.json`` (or ``--out``) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from impls.triton.decode import DecodeConfig, TritonDecode, default_config, plan_decode, run_decode
from mla_bench.dims import get_preset
from mla_bench.layouts import LATENT_DIM, NOPE_DIM, PagedCache, get_layout
from mla_bench.layouts.ops import write_cache
from mla_bench.metadata import PagedMetadata
from mla_bench.metadata.reference import flat_token_slots
from mla_bench.problem import build_problem
from mla_bench.workload import Workload
from suites.judge import judge

FLOPS_PER_ROW_KEY = 2 * (LATENT_DIM + NOPE_DIM)


# ---- correctness -------------------------------------------------------------------------------------------------

def correctness_workloads() -> list[Workload]:
    """Every layout, page size and query-length mode at least once, heads 16, 128 and a padded count."""
    layouts = ["bf16", "fp8_e4m3", "fp8_ds_mla", "fp8_ds_mla_pow2", "fp4_mx16", "mxfp4_nsa", "nvfp4"]
    cases = []
    for i, layout in enumerate(layouts):
        cases.append(Workload(mode="decode", preset="deepseek-v3-tp8", layout=layout, page_size=64,
                              q_lens=(1, 1, 1, 1), kv_lens=(3000, 1, 0, 777), seed=i))
        cases.append(Workload(mode="decode", preset="deepseek-v3", layout=layout, page_size=(16, 48, 1)[i % 3],
                              q_lens=(2, 3, 1), kv_lens=(1500, 64, 9), seed=10 + i))
    for page_size in (1, 7, 16, 32, 128):
        cases.append(Workload(mode="decode", preset="kimi-k2", page_size=page_size, q_lens=(4, 4),
                              kv_lens=(2049, 130), seed=20 + page_size))
    cases.append(Workload(mode="decode", preset="tiny", num_heads=20, q_lens=(1, 5), kv_lens=(40000, 6), seed=3))
    cases.append(Workload(mode="decode", preset="deepseek-v3-tp8", num_heads=32, q_lens=(1,), kv_lens=(131072,)))
    return cases


def check_correctness(device: torch.device) -> list[dict]:
    impl = TritonDecode()
    records = []
    for workload in correctness_workloads():
        verdict = judge(impl, build_problem(workload, device))
        record = {"label": workload.label, "status": verdict.status, "violations": verdict.violations,
                  "kernel": verdict.kernel.to_dict() if verdict.kernel else None,
                  "e2e": verdict.e2e.to_dict() if verdict.e2e else None, "message": verdict.message[-800:]}
        records.append(record)
        kernel = (f"kernel rel_l2 {verdict.kernel.rel_l2:.2e} lse {verdict.kernel.lse_max_abs:.1e}"
                  if verdict.kernel else "")
        e2e = f"e2e rel_l2 {verdict.e2e.rel_l2:.2e}" if verdict.e2e else ""
        print(f"[check] {verdict.status:7s} {workload.label}  {kernel}  {e2e} {verdict.violations or ''}"
              f"{verdict.message[-400:] if verdict.status == 'error' else ''}", flush=True)
    return records


# ---- ceilings ----------------------------------------------------------------------------------------------------

def time_ms(fn, reps: int = 20, warmup: int = 3) -> list[float]:
    """Per-call times (ms) of ``fn`` with CUDA events, one sample per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


def measure_ceilings(device: torch.device) -> dict:
    ceilings = {"copy_GBps": _copy_GBps(device), "bf16_TFLOPs": _matmul_TFLOPs(device)}
    torch.cuda.empty_cache()
    print(f"[ceilings] copy {ceilings['copy_GBps']:.0f} GB/s (read+write), bf16 matmul "
          f"{ceilings['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    return ceilings


def _copy_GBps(device: torch.device) -> float:
    """Device-to-device copy of 1 GiB of random bytes, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * (1 << 30) / statistics.median(time_ms(lambda: dst.copy_(src))) / 1e6


def _matmul_TFLOPs(device: torch.device) -> float:
    """bf16 8192^3 matrix product on random data."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / statistics.median(time_ms(lambda: a @ b, reps=10)) / 1e9


# ---- latency -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    heads: int
    batch: int
    ctx: int
    q_len: int = 1
    page_size: int = 64
    layout: str = "bf16"
    sequential: bool = False  # pages in allocation order instead of a random permutation

    @property
    def label(self) -> str:
        q = f" q{self.q_len}" if self.q_len > 1 else ""
        return (f"h{self.heads} b{self.batch} ctx{self.ctx}{q} ps{self.page_size} {self.layout}"
                + (" seq" if self.sequential else ""))


@dataclass
class Inputs:
    q: torch.Tensor
    cache: PagedCache
    block_table: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]


def make_inputs(shape: Shape, device: torch.device, seed: int) -> Inputs:
    """Random inputs drawn on the device (quick for large shapes): N(0,1) latents, permuted pages."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = [shape.q_len] * shape.batch, [shape.ctx] * shape.batch
    meta = PagedMetadata.build(tuple(q_lens), tuple(kv_lens), shape.page_size, gen)
    if shape.sequential:
        width = meta.block_table.shape[1]
        meta.block_table = torch.arange(shape.batch * width, dtype=torch.int32).reshape(shape.batch, width)
        meta.num_blocks = shape.batch * width
        meta.token_slots = flat_token_slots(meta.block_table, kv_lens, shape.page_size)
    layout = get_layout(shape.layout)
    torch.manual_seed(seed)
    kv = torch.randn(sum(kv_lens), LATENT_DIM, device=device)
    cache = PagedCache.empty(layout, meta.num_blocks, shape.page_size, device, layout.fit_tensor_scale(kv))
    write_cache(cache, kv, meta.token_slots.to(device))
    del kv
    q = (0.5 * torch.randn(sum(q_lens), shape.heads, LATENT_DIM, device=device)).to(torch.bfloat16)
    return Inputs(q, cache, meta.block_table.to(device), q_lens, kv_lens)


def traffic(shape: Shape) -> tuple[float, float]:
    """(bytes, flops) of one call: cache bytes of real tokens + queries + outputs; causal visible keys."""
    rows = shape.batch * shape.q_len * shape.heads
    nbytes = shape.batch * shape.ctx * get_layout(shape.layout).bytes_per_token
    nbytes += rows * (LATENT_DIM * 2 + NOPE_DIM * 2 + 4)
    visible = sum(shape.ctx - shape.q_len + i + 1 for i in range(shape.q_len)) * shape.batch * shape.heads
    return nbytes, visible * FLOPS_PER_ROW_KEY


_CHECKED: dict[tuple, str] = {}


def check_config(shape: Shape, config: DecodeConfig, device: torch.device) -> str:
    """Judge ``config`` on a small problem of the shape's heads, query length, layout and page size (cached):
    every timed configuration is first shown to compute the right thing."""
    key = (shape.heads, shape.q_len, shape.layout, shape.page_size, config)
    if key not in _CHECKED:
        impl = type("Configured", (TritonDecode,), {"config": config})()
        workload = Workload(mode="decode", preset="deepseek-v3", num_heads=shape.heads, layout=shape.layout,
                            page_size=shape.page_size, q_lens=(shape.q_len,) * 3, kv_lens=(2100, 333, shape.q_len),
                            seed=len(_CHECKED))
        verdict = judge(impl, build_problem(workload, device))
        _CHECKED[key] = verdict.status + ("" if verdict.ok else f" {verdict.violations} {verdict.message[-300:]}")
    return _CHECKED[key]


def time_config(inputs: list[Inputs], config: DecodeConfig, samples: int = 15) -> dict:
    """Median per-call time (ms) over CUDA-graph replays that rotate over the input copies."""
    scale = get_preset("deepseek-v3").softmax_scale
    plans = [plan_decode(x.q, x.cache, x.block_table, x.q_lens, x.kv_lens, scale, config=config) for x in inputs]
    for plan in plans:  # compile and warm up
        run_decode(plan)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for plan in plans:
            run_decode(plan)
    times = [t / len(plans) for t in time_ms(graph.replay, reps=samples, warmup=2)]
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
            "items": plans[0].work.shape[0], "merge_groups": plans[0].groups.shape[0],
            "max_splits": plans[0].schedule.max_splits}


PROFILES: dict[str, list[tuple[Shape, list[DecodeConfig | None]]]] = {}


def _cfg(block_m: int, block_n: int, heads_as_n: bool, warps: int, stages: int = 2, per_sm: int = 1,
         **more) -> DecodeConfig:
    return DecodeConfig(block_m=block_m, block_n=block_n, heads_as_n=heads_as_n, num_warps=warps, num_stages=stages,
                        programs_per_sm=per_sm, **more)


SMALL_ROWS = [None, _cfg(16, 16, False, 4, 7, 3), _cfg(16, 16, False, 4, 10, 2), _cfg(16, 32, False, 4, 7, 1),
              _cfg(16, 32, False, 4, 2, 2), _cfg(16, 64, True, 4, 2), _cfg(16, 32, False, 4, 6, 1),
              _cfg(16, 16, False, 4, 7, 2)]
BIG_ROWS = [None, _cfg(64, 32, False, 8, 5), _cfg(32, 64, True, 4, 2), _cfg(64, 64, False, 8, 2, 2)]
QUANT = [None, _cfg(16, 32, False, 4, 6, 2), _cfg(16, 32, False, 4, 4, 2), _cfg(16, 16, False, 4, 7, 3),
         _cfg(16, 16, False, 4, 2, 2)]
B1 = [None, _cfg(16, 32, False, 4, 6, 2, min_split=128), _cfg(16, 32, False, 4, 6, 2, min_split=256),
      _cfg(16, 64, True, 4, 2, 1, min_split=128)]
Q2 = [None, _cfg(32, 32, False, 4, 6, 2), _cfg(32, 64, False, 8, 2), _cfg(32, 16, False, 4, 7, 2)]

PROFILES["first"] = (
    [(Shape(16, 32, 4096), SMALL_ROWS), (Shape(128, 32, 4096), BIG_ROWS), (Shape(16, 1, 8192), B1),
     (Shape(16, 128, 4096), SMALL_ROWS[:5]), (Shape(16, 64, 16384), SMALL_ROWS[:5]),
     (Shape(128, 128, 4096), BIG_ROWS[:2]), (Shape(128, 64, 16384), BIG_ROWS[:2]),
     (Shape(128, 1, 8192), [None, _cfg(64, 64, False, 8, 2, 1, min_split=128)]),
     (Shape(16, 32, 4096, page_size=1), SMALL_ROWS[:5]), (Shape(16, 32, 4096, page_size=1, sequential=True), [None]),
     (Shape(128, 32, 4096, page_size=1), [None]), (Shape(128, 32, 4096, page_size=1, sequential=True), [None]),
     (Shape(16, 32, 4096, sequential=True), [None]),
     (Shape(16, 32, 4096, q_len=2), Q2), (Shape(16, 32, 4096, q_len=4), [None])]
    + [(Shape(16, 64, 4096, layout=layout), QUANT) for layout in
       ("fp8_e4m3", "fp8_ds_mla", "fp8_ds_mla_pow2", "fp4_mx16", "mxfp4_nsa", "nvfp4")]
    + [(Shape(16, 64, 4096), SMALL_ROWS[:5])]
    + [(Shape(128, 32, 4096, layout=layout), [None]) for layout in ("fp8_ds_mla", "nvfp4")]
)
# The shapes with the default configuration of each: the closing table.
PROFILES["final"] = (
    [(Shape(16, 1, 8192), [None]), (Shape(16, 32, 4096), [None]), (Shape(16, 64, 4096), [None]),
     (Shape(16, 128, 4096), [None]), (Shape(16, 64, 16384), [None]), (Shape(128, 1, 8192), [None]),
     (Shape(128, 32, 4096), [None]), (Shape(128, 128, 4096), [None]), (Shape(128, 64, 16384), [None]),
     (Shape(16, 32, 4096, page_size=1), [None]), (Shape(128, 32, 4096, page_size=1), [None]),
     (Shape(16, 32, 4096, q_len=2), [None]), (Shape(16, 32, 4096, q_len=4), [None])]
    + [(Shape(16, 64, 4096, layout=layout), [None]) for layout in
       ("fp8_e4m3", "fp8_ds_mla", "fp8_ds_mla_pow2", "fp4_mx16", "mxfp4_nsa", "nvfp4")]
)
# One run of a few kernels for a profiler (ncu): no graphs, no rotation.
PROFILES["ncu"] = [(Shape(16, 32, 4096), [None, _cfg(16, 32, False, 4, 2, 2)]),
                   (Shape(128, 32, 4096), [None])]


def run_once(profile: str, device: torch.device) -> None:
    """Each config of the profile once after a warm-up, for a profiler to catch."""
    scale = get_preset("deepseek-v3").softmax_scale
    for shape, configs in PROFILES[profile]:
        x = make_inputs(shape, device, 0)
        for config in configs:
            plan = plan_decode(x.q, x.cache, x.block_table, x.q_lens, x.kv_lens, scale, config=config)
            run_decode(plan)
            torch.cuda.synchronize()
            run_decode(plan)
            torch.cuda.synchronize()
            print(f"[once] {shape.label} {_config_label(plan.config)}", flush=True)


def run_latency(profile: str, device: torch.device, ceilings: dict, deadline: float) -> list[dict]:
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    records = []
    for shape, configs in PROFILES[profile]:
        if time.time() > deadline:
            print(f"[time] out of time before {shape.label}", flush=True)
            break
        nbytes, flops = traffic(shape)
        copies = max(2, math.ceil(4 * l2 / nbytes))
        try:
            inputs = [make_inputs(shape, device, seed) for seed in range(copies)]
        except torch.OutOfMemoryError:
            print(f"[time] {shape.label}: out of memory building inputs", flush=True)
            continue
        for config in configs:
            resolved = config or default_config(shape.heads, shape.q_len, shape.layout)
            status = check_config(shape, resolved, device)
            if status != "passed":
                print(f"[time] {shape.label} {_config_label(resolved)}: check {status}", flush=True)
                continue
            try:
                result = time_config(inputs, resolved)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is a result
                print(f"[time] {shape.label} {resolved}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            ms = result["ms"]
            record = {"shape": asdict(shape), "label": shape.label, "config": asdict(resolved),
                      "default": config is None, **result, "GBps": nbytes / ms / 1e6, "TFLOPs": flops / ms / 1e9,
                      "copy_fraction": nbytes / ms / 1e6 / ceilings["copy_GBps"],
                      "floor_ms": max(nbytes / ceilings["copy_GBps"] / 1e6, flops / ceilings["bf16_TFLOPs"] / 1e9)}
            records.append(record)
            print(f"[time] {shape.label:36s} {_config_label(resolved):34s} {ms * 1e3:8.1f} us "
                  f"{record['GBps']:6.0f} GB/s ({record['copy_fraction']:.2f}) {record['TFLOPs']:5.0f} TFLOP/s "
                  f"items {result['items']} splits {result['max_splits']}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    return records


def _config_label(c: DecodeConfig) -> str:
    default = DecodeConfig()
    return (f"M{c.block_m} N{c.block_n} {'hN' if c.heads_as_n else 'st'} w{c.num_warps} s{c.num_stages} "
            f"p{c.programs_per_sm}" + (f" sp{c.num_splits}" if c.num_splits else "")
            + (f" min{c.min_split}" if c.min_split != default.min_split else "")
            + (f" ms{c.merge_splits}" if c.merge_splits != default.merge_splits else "")
            + (f" sm{c.serial_merge_max}" if c.serial_merge_max != default.serial_merge_max else ""))


def print_table(records: list[dict]) -> None:
    """Best config per shape, compact."""
    best: dict[str, dict] = {}
    for r in records:
        if r["label"] not in best or r["ms"] < best[r["label"]]["ms"]:
            best[r["label"]] = r
    print(f"\n{'shape':37s} {'best config':34s} {'us':>7s} {'GB/s':>7s} {'copy':>5s} {'TFLOP/s':>7s} {'floor_us':>8s}")
    for label, r in best.items():
        print(f"{label:37s} {_config_label(DecodeConfig(**r['config'])):34s} {r['ms'] * 1e3:7.1f} {r['GBps']:7.0f} "
              f"{r['copy_fraction']:5.2f} {r['TFLOPs']:7.0f} {r['floor_ms'] * 1e3:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="first", choices=sorted(PROFILES))
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--budget-s", type=float, default=330.0, help="stop timing new shapes after this")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--once", action="store_true", help="run each config once (for ncu), time nothing")
    args = parser.parse_args()
    start = time.time()
    device = torch.device("cuda")
    if args.once:
        run_once(args.profile, device)
        return
    import triton
    env = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
           "sms": torch.cuda.get_device_properties(device).multi_processor_count}
    print(f"[env] {env}", flush=True)
    checks = [] if args.skip_check else check_correctness(device)
    ceilings = measure_ceilings(device)
    records = run_latency(args.profile, device, ceilings, start + args.budget_s)
    with open(os.path.join(args.out, "decode_bench.json"), "w") as f:
        json.dump({"env": env, "ceilings": ceilings, "checks": checks, "latency": records}, f, indent=1)
    failed = [c["label"] for c in checks if c["status"] != "passed"]
    print(f"\n[check] {len(checks) - len(failed)}/{len(checks)} passed" + (f"; FAILED: {failed}" if failed else ""))
    print_table(records)
    print(f"[total] {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
