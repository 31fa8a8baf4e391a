"""Check and time the Triton prefill, chunked prefill, sparse top-k, merge and DCP paths on GPUs.

    python -m suites.bench_paths [--out DIR] [--parts prefill,sparse,chunked,merge,equivalence] [--quick]
    python -m suites.bench_paths --parts dcp   (on a machine with 2 GPUs)

Self-contained (the latency suite will supersede the timing part):

1. correctness first: every timed kernel configuration is judged against the float64 reference on a smaller
   problem of the same heads / layout, and the default impls on several request mixes;
2. the device's ceilings (``mla_bench.timing.measure_ceilings``): 1 GiB device-to-device copy bandwidth (bytes
   read + written) and a bf16 8192^3 matmul;
3. latency: CUDA events around each call, 3 warm-ups, L2 flushed (256 MB written) before every sample (cold
   inputs), median and IQR of the samples. FLOPs are counted honestly: causal prefill counts only the visible
   (query, key) pairs, 2 * (192 + 128) each per head; sparse counts 2 * (576 + 512) per valid index per head;
4. chunked prefill's peak extra memory (``torch.cuda.max_memory_allocated`` over plan + run) against its
   workspace, for two context lengths with the same MCC;
5. DCP (``--parts dcp``): NCCL runs against the reference, then decode time at context 128k with W=1 and W=2,
   each rank's step (and its attention alone) replayed as a CUDA graph (``impls/triton/dcp/launch.py``); a W-rank
   row's bytes and FLOPs (all ranks') are fractions of W GPUs' ceilings (``ceilings_of``; ``ceiling_gpus`` W).

Writes ``paths_bench.json`` under ``--out`` (default ``$OUT`` or ``results``) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from impls.triton.chunked import TritonChunkedPrefill
from impls.triton.merge import merge_attn_states
from impls.triton.prefill import TritonPrefill
from impls.triton.prefill_kernel import PrefillConfig, mha_prefill, prefill_flops
from impls.triton.sparse import TritonSparse, TritonSparseRagged
from impls.triton.latent_io import cache_tensor_scale, layout_code
from impls.triton.sparse_kernel import WGMMA_CONFIG, SparseConfig, sparse_flops, sparse_mqa
from mla_bench.dims import get_preset
from mla_bench.layouts import LATENT_DIM, NOPE_DIM, PagedCache, get_layout
from mla_bench.layouts.ops import write_cache
from mla_bench.metadata import PagedMetadata
from mla_bench.problem import build_problem
from mla_bench.timing import measure_ceilings
from mla_bench.workload import Workload
from suites.judge import judge

PREFILL_CONFIGS = [PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 64, 8, 4), PrefillConfig(128, 64, 8, 2),
                   PrefillConfig(128, 128, 8, 2), PrefillConfig(64, 64, 4, 3)]
SPARSE_CONFIGS = {  # per layout, the default first (--quick times it alone); NOTES.md, part 2, has the rounds
    "fp8_ds_mla": [WGMMA_CONFIG, SparseConfig(128, 64, 8, 1), SparseConfig(128, 32, 8, 1),
                   SparseConfig(64, 64, 8, 2)],
    "fp8_ds_mla_pow2": [WGMMA_CONFIG, SparseConfig(64, 128, 8, 1, prefetch=True), SparseConfig(64, 128, 8, 1),
                        SparseConfig(64, 64, 8, 2, prefetch=True), SparseConfig(64, 64, 8, 2)],
    "bf16": [SparseConfig(32, 64, 4, 2), SparseConfig(64, 64, 8, 2)],
}
ROWS: list[dict[str, Any]] = []  # the final table


def log(text: str) -> None:
    print(text, flush=True)


# ---- timing ------------------------------------------------------------------------------------------------------

class Timer:
    """Cold-L2 samples of a GPU call: a 256 MB buffer is written before each sample."""

    def __init__(self, device: torch.device) -> None:
        self.flush_buffer = torch.empty(256 << 20, dtype=torch.uint8, device=device)

    def __call__(self, fn: Callable[[], Any], reps: int = 15, warmup: int = 3,
                 warmup_s: float = 0.2) -> dict[str, float]:
        """Samples after at least ``warmup`` calls and ``warmup_s`` seconds of them: after the host-bound checks the
        GPU's clock is low, and three calls of a sub-millisecond kernel did not raise it (the first row timed after
        them read 13-15% slow, NOTES.md part 2, session 12)."""
        began, calls = time.perf_counter(), 0
        while calls < warmup or time.perf_counter() - began < warmup_s:
            fn()
            calls += 1
            if calls % 16 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        samples = []
        for _ in range(reps):
            self.flush_buffer.fill_(1)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        q = statistics.quantiles(samples, n=4)
        return {"ms": statistics.median(samples), "iqr_ms": q[2] - q[0], "min_ms": min(samples)}


def ceilings(device: torch.device) -> dict[str, float]:
    """The shared ceilings (``mla_bench.timing``): 1 GiB device copy, bf16 8192^3 matmul."""
    measured = measure_ceilings(device)
    result = {"copy_GBps": measured.copy_gbps, "bf16_TFLOPs": measured.matmul_tflops}
    log(f"[ceilings] copy {result['copy_GBps']:.0f} GB/s (read+write), bf16 matmul {result['bf16_TFLOPs']:.0f} "
        f"TFLOP/s")
    return result


def ceilings_of(ceil: dict[str, float], gpus: int) -> dict[str, float]:
    """The ceilings of ``gpus`` GPUs: ranks on W GPUs move and compute at once, so the traffic of all W ranks over a
    step's time is a fraction of W times one GPU's copy bandwidth and matmul rate (one GPU's overstated it W-fold)."""
    return {key: gpus * value for key, value in ceil.items()}


def row(part: str, label: str, variant: str, timing: dict | None, flops: float = 0, nbytes: float = 0,
        ceil: dict | None = None, **extra: Any) -> dict:
    record = {"part": part, "label": label, "variant": variant, **(timing or {}), **extra}
    if timing and "ms" in timing:
        if flops:
            record["TFLOPs"] = flops / timing["ms"] / 1e9
            if ceil:
                record["of_matmul"] = record["TFLOPs"] / ceil["bf16_TFLOPs"]
        if nbytes:
            record["GBps"] = nbytes / timing["ms"] / 1e6
            if ceil:
                record["of_copy"] = record["GBps"] / ceil["copy_GBps"]
    ROWS.append(record)
    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items() if k not in ("part",)}
    log(f"[{part}] {shown}")
    return record


def verdict_text(verdict) -> str:
    if verdict.status == "passed":
        return (f"passed (kernel rel_l2 {verdict.kernel.rel_l2:.2e}, lse {verdict.kernel.lse_max_abs:.1e}, "
                f"replay {verdict.replay_max_abs:.1e})")
    return f"{verdict.status} {verdict.violations} {verdict.message[-600:]}"


# ---- prefill -----------------------------------------------------------------------------------------------------

def bench_prefill(device: torch.device, timer: Timer, ceil: dict, quick: bool) -> None:
    for mix in [((6, 1, 900), (6, 3000, 2000)), ((2048, 777), (2048, 3000))]:
        for preset in ("deepseek-v3-tp8", "deepseek-v3"):
            w = Workload(mode="prefill", preset=preset, q_lens=mix[0], kv_lens=mix[1], seed=1)
            log(f"[check] triton_prefill {w.label}: {verdict_text(judge(TritonPrefill(), build_problem(w, device)))}")
    shapes = [("deepseek-v3", 1, 8192), ("deepseek-v3-tp8", 1, 8192), ("deepseek-v3", 4, 2048)]
    for preset, batch, tokens in shapes[:2] if quick else shapes:
        heads = get_preset(preset).num_heads
        gen = torch.Generator(device=device).manual_seed(0)
        n = batch * tokens
        q = torch.randn(n, heads, 192, device=device, generator=gen).to(torch.bfloat16)
        k_nope = torch.randn(n, heads, 128, device=device, generator=gen).to(torch.bfloat16)
        k_pe = torch.randn(n, 64, device=device, generator=gen).to(torch.bfloat16)
        v = torch.randn(n, heads, 128, device=device, generator=gen).to(torch.bfloat16)
        cu = torch.arange(0, n + 1, tokens, dtype=torch.int32, device=device)
        lens = ((tokens,) * batch, (tokens,) * batch)
        flops = prefill_flops(*lens, heads)
        label = f"prefill h{heads} b{batch} q{tokens}"
        scale = get_preset(preset).softmax_scale
        baseline = None
        for config in PREFILL_CONFIGS[:2] if quick else PREFILL_CONFIGS:
            variant = f"BM{config.block_m} BN{config.block_n} w{config.num_warps} s{config.num_stages}"
            try:
                out = torch.empty(n, heads, 128, dtype=torch.bfloat16, device=device)
                lse = torch.empty(n, heads, dtype=torch.float32, device=device)
                run = lambda: mha_prefill(q, k_nope, k_pe, v, cu, cu, tokens, scale, out=out, lse=lse, config=config)
                run()
                if baseline is None:
                    check = judge(TritonPrefill(config), build_problem(
                        Workload(mode="prefill", preset=preset, q_lens=(300, 1000), kv_lens=(700, 1000)), device))
                    baseline = (out.clone(), lse.clone())
                    agree = verdict_text(check)
                else:
                    agree = f"max |diff| vs first config {float((out.float() - baseline[0].float()).abs().max()):.2e}"
                row("prefill", label, variant, timer(run, reps=10), flops, ceil=ceil, check=agree)
            except Exception:  # noqa: BLE001 - one config's failure is a result
                row("prefill", label, variant, None, error=traceback.format_exc()[-500:])
        try:  # peer: torch SDPA (FlashAttention / cuDNN) on the same tensors, keys expanded to 192
            k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)
            qs, ks, vs = (x.view(batch, tokens, heads, -1).transpose(1, 2) for x in (q, k, v))
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            row("prefill", label, "torch SDPA (peer)", timer(sdpa, reps=10), flops, ceil=ceil)
        except Exception:  # noqa: BLE001
            row("prefill", label, "torch SDPA (peer)", None, error=traceback.format_exc()[-300:])
        del q, k_nope, k_pe, v
        torch.cuda.empty_cache()


# ---- sparse ------------------------------------------------------------------------------------------------------

def sparse_inputs(device: torch.device, heads: int, batch: int, ctx: int, topk: int, layout: str, q_len: int = 1):
    """Inputs of the timed sparse shape drawn on the device (building a Problem of this size on the host is slow):
    queries, PAGED indices (``topk`` distinct positions per token), the cache, and the count of valid indices."""
    gen = torch.Generator().manual_seed(0)
    q_lens, kv_lens = (q_len,) * batch, (ctx,) * batch
    meta = PagedMetadata.build(q_lens, kv_lens, 64, gen)
    torch.manual_seed(0)
    kv = torch.randn(batch * ctx, LATENT_DIM, device=device)
    lay = get_layout(layout)
    cache = PagedCache.empty(lay, meta.num_blocks, 64, device, lay.fit_tensor_scale(kv))
    write_cache(cache, kv, meta.token_slots.to(device))
    del kv
    q = (0.5 * torch.randn(batch * q_len, heads, LATENT_DIM, device=device)).to(torch.bfloat16)
    positions = torch.rand(batch * q_len, ctx, device=device).argsort(dim=1)[:, :topk]
    owner = torch.arange(batch, device=device).repeat_interleave(q_len)
    bt = meta.block_table.to(device).long()
    slots = bt[owner[:, None], positions // 64] * 64 + positions % 64
    return q, slots.to(torch.int32).contiguous(), cache, batch * q_len * topk


def bench_sparse(device: torch.device, timer: Timer, ceil: dict, quick: bool) -> None:
    for transform, impl in (("paged", TritonSparse), ("ragged", TritonSparseRagged)):
        for layout in ("bf16", "fp8_ds_mla", "fp8_ds_mla_pow2"):
            for mode, q_lens, kv_lens in (("sparse_decode", (1,) * 6, (4096,) * 4 + (2048, 2100)),
                                          ("sparse_prefill", (64, 17), (3000, 2048))):
                w = Workload(mode=mode, preset="deepseek-v3", q_lens=q_lens, kv_lens=kv_lens, page_size=64,
                             layout=layout, topk=2048, index_transform=transform, seed=2)
                log(f"[check] {impl.name} {w.label}: {verdict_text(judge(impl(), build_problem(w, device)))}")
    heads, batch, ctx, topk = 128, 128, 4096, 2048
    for layout, configs in SPARSE_CONFIGS.items():
        q, idx, cache, valid = sparse_inputs(device, heads, batch, ctx, topk, layout)
        flops = sparse_flops(valid, heads)
        nbytes = valid * cache.layout.bytes_per_token + q.numel() * 2 + batch * heads * NOPE_DIM * 2
        label = f"sparse decode h{heads} b{batch} topk{topk} {layout}"
        scale = get_preset("deepseek-v3").softmax_scale
        for config in configs[:1] if quick else configs:
            variant = (f"BH{config.block_h} BN{config.block_n} w{config.num_warps} s{config.num_stages}"
                       + (" prefetch" if config.prefetch else "") + (" wgmma" if config.wgmma else ""))
            try:
                check = judge(TritonSparse(config), build_problem(Workload(
                    mode="sparse_decode", preset="deepseek-v3", q_lens=(1,) * 8, kv_lens=(3000,) * 8, page_size=64,
                    layout=layout, topk=2048, seed=5), device))
                out = torch.empty(batch, heads, NOPE_DIM, dtype=torch.bfloat16, device=device)
                lse = torch.empty(batch, heads, dtype=torch.float32, device=device)
                code, tscale = layout_code(layout), cache_tensor_scale(cache)
                run = lambda: sparse_mqa(q, idx, cache.rows(), code, scale, tscale, out, lse, config)
                row("sparse", label, variant, timer(run), flops, nbytes, ceil, check=verdict_text(check))
            except Exception:  # noqa: BLE001
                row("sparse", label, variant, None, error=traceback.format_exc()[-500:])
        del q, idx, cache
        torch.cuda.empty_cache()
    # sparse prefill: 4 requests x 512 new tokens over 8k contexts, top-k 2048 each, default tiles
    for layout in SPARSE_CONFIGS:
        q, idx, cache, valid = sparse_inputs(device, heads, 4, 8192, topk, layout, q_len=512)
        scale = get_preset("deepseek-v3").softmax_scale
        code, tscale = layout_code(layout), cache_tensor_scale(cache)
        run = lambda: sparse_mqa(q, idx, cache.rows(), code, scale, tscale)
        row("sparse", f"sparse prefill h{heads} b4 q512 topk{topk} {layout}", "default", timer(run),
            sparse_flops(valid, heads), ceil=ceil)
        del q, idx, cache
        torch.cuda.empty_cache()


# ---- chunked prefill ---------------------------------------------------------------------------------------------

def bench_chunked(device: torch.device, timer: Timer, ceil: dict, quick: bool) -> None:
    for layout in ("bf16", "fp8_ds_mla"):
        w = Workload(mode="chunked_prefill", preset="deepseek-v3-tp8", q_lens=(300, 1, 77), kv_lens=(5000, 900, 77),
                     page_size=64, chunk_size=1000, layout=layout, seed=3)
        log(f"[check] triton_chunked_prefill {w.label}: "
            f"{verdict_text(judge(TritonChunkedPrefill(), build_problem(w, device)))}")
    heads, q_len = 16, 2048
    for ctx in (16384, 65536):
        for mcc in (4096, 16384):
            w = Workload(mode="chunked_prefill", preset="deepseek-v3-tp8", q_lens=(q_len,), kv_lens=(ctx + q_len,),
                         page_size=64, chunk_size=mcc, seed=4)
            problem = build_problem(w, device)
            impl = TritonChunkedPrefill()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            plan = impl.plan(problem)
            impl.run(plan)
            torch.cuda.synchronize()
            peak_extra = torch.cuda.max_memory_allocated(device) - before
            metadata = sum(c.slots.numel() * 8 + c.cu_seqlens_q.numel() * 4 + c.cu_seqlens_k.numel() * 4
                           for c in plan.chunks)
            fixed = plan.out.numel() * 2 + plan.lse.numel() * 4 + plan.w_kv.numel() * 2
            bound = plan.workspace_bytes + fixed + metadata + (1 << 20)
            attn = 2 * 320 * heads * q_len * ctx + prefill_flops((q_len,), (q_len,), heads)
            gemm = 2 * ctx * NOPE_DIM * heads * 256
            row("chunked", f"chunked h{heads} q{q_len} ctx{ctx}", f"MCC {mcc}", timer(lambda: impl.run(plan), reps=8),
                attn + gemm, ceil=ceil, peak_extra_MB=peak_extra / 2**20, workspace_MB=plan.workspace_bytes / 2**20,
                bound_MB=bound / 2**20, within_bound=peak_extra <= bound, chunks=len(plan.chunks))
            del plan, problem
            torch.cuda.empty_cache()


# ---- merge -------------------------------------------------------------------------------------------------------

def bench_merge(device: torch.device, timer: Timer, ceil: dict, quick: bool) -> None:
    tokens, heads, dim = 16384, 128, 128
    parts = [torch.randn(tokens, heads, dim, device=device) for _ in range(2)]
    lses = [torch.randn(tokens, heads, device=device) for _ in range(2)]
    out = torch.empty_like(parts[0])
    lse = torch.empty_like(lses[0])
    nbytes = 3 * parts[0].numel() * 4 + 3 * lses[0].numel() * 4
    row("merge", f"merge fp32 T{tokens} H{heads} D{dim}", "default",
        timer(lambda: merge_attn_states(parts[0], lses[0], parts[1], lses[1], out, lse)), nbytes=nbytes, ceil=ceil)


# ---- equivalence suite -------------------------------------------------------------------------------------------

def run_equivalence(device: torch.device, *_: Any) -> None:
    from suites.base import RunContext
    from suites.equivalence import EquivalenceSuite
    for result in EquivalenceSuite().run(RunContext(impls=[], device=device)):
        metrics = {k: round(v, 6) for k, v in result.metrics.items() if k.endswith(("rel_l2", "lse_max_abs"))}
        row("equivalence", result.label, result.check, None, status=result.status, **metrics,
            message=result.message[-300:])


# ---- DCP ---------------------------------------------------------------------------------------------------------

def bench_dcp(device: torch.device, timer: Timer, ceil: dict, quick: bool) -> None:
    from impls.triton.dcp import run_dcp
    from mla_bench.compare import compare
    from mla_bench.tolerances import tolerance_for
    from reference.expected import expected
    gpus = torch.cuda.device_count()
    log(f"[dcp] {gpus} GPUs visible")
    for layout, interleave in (("bf16", 1), ("fp8_ds_mla", 64)):
        w = Workload(mode="dcp", preset="deepseek-v3-tp8", q_lens=(1, 2, 1, 1), kv_lens=(8192, 5000, 1, 0),
                     page_size=64, layout=layout, dcp_world=min(2, gpus), dcp_interleave=interleave, seed=6)
        outcome = run_dcp(w, reorg_chunk=3000)
        ref = expected(build_problem(w, device))
        metrics = compare(outcome.out.to(device), outcome.lse.to(device), ref.out, ref.lse)
        violations = tolerance_for("bfloat16", layout).violations(metrics)
        row("dcp", w.label, "NCCL vs reference", None, status="failed" if violations else "passed",
            rel_l2=metrics.rel_l2, lse_max_abs=metrics.lse_max_abs, reorg_max_diff=outcome.reorg_max_diff,
            violations=violations)
    for preset, batch in (("deepseek-v3-tp8", 64), ("deepseek-v3", 32)):
        heads = get_preset(preset).num_heads
        w = Workload(mode="dcp", preset=preset, q_lens=(1,) * batch, kv_lens=(131072,) * batch, page_size=64,
                     seed=7)
        flops = 2 * (LATENT_DIM + NOPE_DIM) * heads * batch * 131072
        nbytes = batch * 131072 * 1152
        for world in sorted({1, min(2, gpus)}):
            try:
                outcome = run_dcp(w, world=world, time_iters=10, synthetic=True)
                step, attention = max(outcome.step_ms), max(outcome.attention_ms)
                row("dcp", f"dcp h{heads} b{batch} ctx131072 bf16", f"W={world} triton_decode",
                    {"ms": step}, flops, nbytes, ceilings_of(ceil, world), ceiling_gpus=world,
                    attention_ms=attention, comm_ms=step - attention)
            except Exception:  # noqa: BLE001
                row("dcp", f"dcp h{heads} b{batch} ctx131072", f"W={world}", None, error=traceback.format_exc()[-600:])


PARTS = {"prefill": bench_prefill, "sparse": bench_sparse, "chunked": bench_chunked, "merge": bench_merge,
         "equivalence": run_equivalence, "dcp": bench_dcp}


def print_table() -> None:
    log("\n== paths bench ==")
    for r in ROWS:
        if r["part"] == "equivalence":
            log(f"{r['part']:11s} {r['variant']:22s} {r['status']:9s} {r['label']}")
            continue
        cells = [f"{r['part']:8s}", f"{r['label'][:44]:44s}", f"{r['variant'][:34]:34s}"]
        if "ms" in r:
            cells.append(f"{r['ms']:8.3f} ms")
        if "TFLOPs" in r:
            cells.append(f"{r['TFLOPs']:6.0f} TF/s" + (f" ({r['of_matmul']:.0%} mm)" if "of_matmul" in r else ""))
        if "GBps" in r:
            cells.append(f"{r['GBps']:6.0f} GB/s" + (f" ({r['of_copy']:.0%} copy)" if "of_copy" in r else ""))
        for key in ("peak_extra_MB", "bound_MB", "attention_ms", "comm_ms"):
            if key in r:
                cells.append(f"{key} {r[key]:.2f}")
        if "status" in r:
            cells.append(r["status"])
        if "error" in r:
            cells.append("ERROR " + r["error"].strip().splitlines()[-1][:80])
        elif "check" in r and not str(r["check"]).startswith(("passed", "max |diff|")):
            cells.append("CHECK " + str(r["check"])[:80])
        log(" ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m suites.bench_paths", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "results"))
    parser.add_argument("--parts", default="prefill,sparse,chunked,merge")
    parser.add_argument("--quick", action="store_true", help="fewer configurations and shapes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_paths times GPU kernels: no CUDA device here (the tests cover the CPU)")
    device = torch.device("cuda")
    log(f"[env] {torch.cuda.get_device_name(device)} torch {torch.__version__} "
        f"triton {__import__('triton').__version__}")
    timer = Timer(device)
    ceil = ceilings(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for part in args.parts.split(","):
        try:
            PARTS[part](device, timer, ceil, args.quick)
        except Exception:  # noqa: BLE001 - keep the other parts' numbers
            row(part, "part", "crashed", None, error=traceback.format_exc()[-1500:])
            log(traceback.format_exc())
        # written after every part, so a run cut short keeps what it measured
        (out / "paths_bench.json").write_text(json.dumps({"ceilings": ceil, "rows": ROWS}, indent=1, default=str))
    print_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
