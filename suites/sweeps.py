"""The workload sweeps every suite draws from, and how the command line's filters reshape them.

Two sweeps: ``tiny`` (the ``tiny`` preset, for CPU and the Triton interpreter: every mode and query-length
kind, an empty request, lengths on page boundaries, page sizes 1/16/64 and a non-power-of-two) and ``gpu``
(DeepSeek V3 under TP8 (16 heads) and unsharded (128 heads) at serving shapes: batch 1/32/128, context
4096/8192/16384, page 64, plus prefill; and small sparse mixes with requests shorter than top-k, whose index lists
carry -1 padding). ``gpu-quick`` is the gpu sweep cut to batch 1/32, context 4096/8192.

``select(ctx)`` applies the run's filters: ``--preset`` picks the sweep (``tiny`` -> tiny, others -> gpu
shapes with that preset; the gpu sweeps cannot build ``tiny``), ``--mode`` keeps only those modes, ``--layout`` /
``--page-size`` re-run each cache-reading workload with those values (so ``--layout fp8_ds_mla`` sweeps every
decode shape in FP8), and ``--seed`` sets the seed. Layouts other than bf16 are swept for whatever the layout
registry holds. ``check_filters(ctx)`` refuses, before a run starts, a filter value that no workload can take.
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

import torch

from mla_bench.dims import PRESETS, get_preset
from mla_bench.errors import about_flag
from mla_bench.layouts import LAYOUTS
from mla_bench.registry import Capabilities
from mla_bench.workload import DTYPES, Mode, Workload

T = TypeVar("T")

TINY_PAGE = 16
GPU_PAGE = 64
GPU_PRESETS = ("deepseek-v3-tp8", "deepseek-v3")


def tiny(preset: str = "tiny") -> list[Workload]:
    """Small workloads with the real 512/64/128 dims: every mode, kind of request mix and page-size edge."""
    def decode(q_lens, kv_lens, page=TINY_PAGE, layout="bf16", **kw) -> Workload:
        return Workload(Mode.DECODE, tuple(q_lens), tuple(kv_lens), preset=preset, page_size=page, layout=layout,
                        **kw)

    sweep = [
        decode((1, 1, 1, 1), (37, 0, 64, 100)),          # single queries, a padding request, a page boundary
        decode((2, 2), (33, 48)),                        # uniform q_len 2 (MTP)
        decode((1, 3, 0, 2), (50, 17, 0, 32)),           # varlen, an empty request, the last q_len not the max
        decode((1, 1, 1, 1), (16, 17, 15, 32)),          # lengths at, past and before page boundaries
        decode((1, 1), (9, 20), page=1),
        decode((1, 2), (64, 130), page=64),
        decode((1, 1), (26, 40), page=13),               # a page size that is not a power of two
        decode((1, 1), (40, 77), dtype="float32"),
    ]
    sweep += [decode((1, 2), (40, 77), layout=name) for name in LAYOUTS if name != "bf16"]
    sweep += [
        Workload(Mode.PREFILL, (6, 1, 9), (6, 30, 20), preset=preset),
        Workload(Mode.PREFILL, (12, 5), (12, 5), preset=preset, dtype="float32"),
        Workload(Mode.CHUNKED_PREFILL, (5, 3), (40, 19), preset=preset, page_size=TINY_PAGE, chunk_size=16),
        Workload(Mode.SPARSE_DECODE, (1, 1, 1, 1), (50, 8, 90, 0), preset=preset, page_size=TINY_PAGE, topk=16),
        Workload(Mode.SPARSE_DECODE, (1, 1), (30, 45), preset=preset, page_size=TINY_PAGE, topk=16,
                 index_transform="ragged"),
        Workload(Mode.SPARSE_PREFILL, (4, 6), (30, 6), preset=preset, page_size=TINY_PAGE, topk=8),
        Workload(Mode.SPARSE_PREFILL, (3, 2), (9, 25), preset=preset, page_size=TINY_PAGE, topk=8,
                 index_transform="ragged"),
        Workload(Mode.DCP, (1, 1), (33, 40), preset=preset, page_size=TINY_PAGE, dcp_world=2),
        Workload(Mode.DCP, (1, 2, 1, 1), (21, 50, 7, 1), preset=preset, page_size=TINY_PAGE, dcp_world=3,
                 dcp_interleave=2),                     # kv 7 and 1: ranks holding no token of a request
    ]
    return sweep


def gpu(presets: Iterable[str] = GPU_PRESETS, batches=(1, 32, 128), contexts=(4096, 8192, 16384)) -> list[Workload]:
    """Serving shapes: decode over batch x context, each other layout at one shape, prefill, chunked prefill
    over a long context, and DeepSeek V3.2's sparse decode and prefill (top-k 2048) on bf16 and fp8_ds_mla; then
    ``short_sparse``'s mixes on both layouts (the same in every gpu sweep) and sparse decode at the smallest batch."""
    sweep = []
    big_batch, long_ctx = batches[-1], contexts[-1]
    for preset in presets:
        common = dict(preset=preset, page_size=GPU_PAGE)
        sweep += [Workload.uniform(Mode.DECODE, b, 1, ctx, **common) for b in batches for ctx in contexts]
        sweep += [Workload.uniform(Mode.DECODE, batches[min(1, len(batches) - 1)], 1, contexts[0], layout=name,
                                   **common) for name in LAYOUTS if name != "bf16"]
        # 128-head prefill stays at 2048 tokens: the float64 reference's score blocks must fit in memory.
        tokens = 2048 if get_preset(preset).num_heads > 16 else 8192
        sweep.append(Workload.uniform(Mode.PREFILL, 1, tokens, tokens, preset=preset))
        for layout in ("bf16", "fp8_ds_mla"):
            sweep += [
                Workload.uniform(Mode.CHUNKED_PREFILL, 1, 1024, long_ctx + 1024, chunk_size=4096, layout=layout,
                                 **common),
                Workload.uniform(Mode.SPARSE_DECODE, big_batch, 1, long_ctx, topk=2048, layout=layout, **common),
                Workload.uniform(Mode.SPARSE_PREFILL, 1, 512, long_ctx, topk=2048, layout=layout, **common),
            ]
    # Last, so that the workloads above keep their places in the shards' round robin.
    sweep += [w for preset in presets for layout in ("bf16", "fp8_ds_mla") for w in short_sparse(preset, layout)]
    # Sparse decode at the smallest batch, where one token's list must be cut to fill the GPU (after the rest: the
    # places above stay as the committed baselines have them).
    sweep += [Workload.uniform(Mode.SPARSE_DECODE, batches[0], 1, long_ctx, topk=2048, layout=layout, preset=preset,
                               page_size=GPU_PAGE) for preset in presets for layout in ("bf16", "fp8_ds_mla")]
    return sweep


def short_sparse(preset: str, layout: str) -> list[Workload]:
    """Sparse decode and prefill (top-k 2048, page 64) with requests shorter than top-k, so that index lists carry
    -1 padding (the serving shapes' requests all see top-k keys or more); small, for correctness.

    Decode: an empty (padding) request, one seeing a single key, one a third of top-k, top-k - 1, exactly top-k and
    twice it. Prefill: a one-token prompt, a prompt of top-k / 8 tokens without context (its tokens see 1 to 256
    keys) and one whose tokens go from fewer than top-k visible keys to more."""
    topk, prompt = 2048, 256
    common = dict(preset=preset, layout=layout, page_size=GPU_PAGE, topk=topk)
    return [
        Workload(Mode.SPARSE_DECODE, (1,) * 6, (0, 1, topk // 3, topk - 1, topk, 2 * topk), **common),
        Workload(Mode.SPARSE_PREFILL, (1, prompt, prompt), (1, prompt, topk + prompt // 2), **common),
    ]


SWEEPS: dict[str, Callable[..., list[Workload]]] = {
    "tiny": tiny,
    "gpu": gpu,
    "gpu-quick": lambda presets=GPU_PRESETS: gpu(presets, batches=(1, 32), contexts=(4096, 8192)),
}


def default_sweep(preset: str | None, device_type: str) -> str:
    """``tiny`` for the tiny preset or a CPU run, ``gpu`` otherwise."""
    return "tiny" if preset == "tiny" or (preset is None and device_type != "cuda") else "gpu"


def sweep_presets(name: str) -> tuple[str, ...]:
    """The presets sweep ``name`` can build: the tiny sweep any (its shapes with that preset's dims), the gpu
    sweeps the serving-size ones (every preset but ``tiny``, the CPU preset)."""
    if name not in SWEEPS:
        raise ValueError(f"unknown sweep {name!r}; sweeps: {', '.join(SWEEPS)}")
    return tuple(PRESETS) if name == "tiny" else tuple(p for p in PRESETS if p != "tiny")


def sweep_of(ctx) -> str:
    """The sweep ``ctx`` names, else the default for its preset and device; ValueError for an unknown sweep or
    one that cannot build ``ctx.preset`` (rather than silently building other presets)."""
    name = getattr(ctx, "sweep", None) or default_sweep(ctx.preset, ctx.device.type)
    presets = sweep_presets(name)
    if ctx.preset and ctx.preset not in presets:
        raise ValueError(f"sweep {name} takes the presets {', '.join(presets)}, not {ctx.preset!r}")
    return name


def check_filters(ctx) -> None:
    """Refuse, before a run starts, a filter of ``ctx`` that no workload can take (ValueError naming it and its
    command-line flag): an unknown preset, sweep, mode or layout, a sweep that cannot build the preset, a page size
    or seed ``Workload`` refuses, a DCP interleave without ``--dcp``."""
    with about_flag("--preset"):
        probe = Workload(Mode.DECODE, (1,), (1,), preset=ctx.preset or "tiny")  # Workload checks values
    with about_flag("--seed"):
        probe.replace(seed=ctx.seed)
    with about_flag("--sweep"):
        sweep_of(ctx)
    modes = [mode.value for mode in Mode]
    with about_flag("--mode"):
        for mode in ctx.modes:
            if mode not in modes:
                raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(modes)}")
    with about_flag("--layout"):
        for layout in ctx.layouts:
            probe.replace(layout=layout)
    with about_flag("--page-size"):
        for page_size in ctx.page_sizes:
            probe.replace(page_size=page_size)
    if ctx.dcp_interleave != 1 and not ctx.dcp_world:
        raise ValueError("--dcp-interleave applies to decode context parallel runs only: give --dcp W too")


def select(ctx) -> list[Workload]:
    """The workloads of ``ctx``'s sweep after its filters (see the module docstring), without duplicates."""
    name = sweep_of(ctx)
    if name == "tiny":
        base = SWEEPS[name](ctx.preset or "tiny")
    else:
        base = SWEEPS[name](presets=(ctx.preset,) if ctx.preset else GPU_PRESETS)
    if ctx.modes:
        base = [w for w in base if w.mode.value in ctx.modes]
    if getattr(ctx, "dcp_world", None):  # --dcp W: the decode workloads, sharded over W ranks
        base = [as_dcp(w, ctx.dcp_world, ctx.dcp_interleave) for w in base if w.mode in (Mode.DECODE, Mode.DCP)]
    out: dict[str, Workload] = {}
    for w in base:
        for variant in _variants(w, ctx.layouts, ctx.page_sizes):
            variant = variant.replace(seed=ctx.seed)
            out.setdefault(variant.key, variant)
    return list(out.values())


def as_dcp(workload: Workload, world: int, interleave: int = 1) -> Workload:
    """The decode context parallel version of a decode (or DCP) workload over ``world`` ranks (``--dcp W``)."""
    if workload.mode not in (Mode.DECODE, Mode.DCP):
        raise ValueError(f"--dcp applies to decode workloads, not {workload.mode.value} ({workload.label})")
    return workload.replace(mode=Mode.DCP, dcp_world=world, dcp_interleave=interleave)


def _variants(w: Workload, layouts: list[str], page_sizes: list[int]) -> list[Workload]:
    if not w.mode.uses_cache:
        return [w]
    return [w.replace(layout=layout, page_size=page)
            for layout in (layouts or [w.layout]) for page in (page_sizes or [w.page_size])]


def shard(items: list[T], ctx) -> list[T]:
    """This worker's share of ``items`` (round robin over ``ctx.shards`` workers)."""
    return items[ctx.shard::ctx.shards]


def conformance(caps: Capabilities, device: torch.device | str = "cpu", preset: str = "tiny") -> list[Workload]:
    """The tiny sweep bent to what ``caps`` declares on ``device``, then widened to the declared values it misses.

    Bent: a head count or page size the impl does not declare moves to the smallest declared one, and off the CPU
    the cache of an impl that keeps it only in host memory moves there (so an impl for 64/128 heads, page 64 or a
    host cache is still checked); for an impl that does not declare bf16, the layout of the sweep's edge cases, each
    cache-reading workload in a layout it does not declare moves in its place to the first declared layout (sorted),
    where the impl accepts it there and the sweep lacks it (so an FP8-only decode kernel gets the empty request, the
    page edges and every query-length kind, and an FP8-only sparse one the sparse workloads); everything else is left
    for the impl to refuse. Widened: per mode, each value of ``_declared_values`` that no workload the impl accepts
    has gets one workload, the mode's smallest accepted one with that value changed (one more test each, on the
    cheapest shape; for a page size, each request made a page longer, so that it crosses a page boundary)."""
    device_type = torch.device(device).type
    host_cache = device_type != "cpu" and "cpu" in (caps.cache_devices or ())
    out: dict[str, Workload] = {}
    for w in tiny(preset):
        changes = {}
        if caps.head_counts is not None and w.dims.num_heads not in caps.head_counts:
            changes["num_heads"] = min(caps.head_counts)
        if w.mode.uses_cache and caps.page_sizes is not None and w.page_size not in caps.page_sizes:
            changes["page_size"] = min(caps.page_sizes)
        if w.mode.uses_cache and host_cache and device_type not in caps.cache_devices:
            changes["cache_device"] = "cpu"
        w = w.replace(**changes) if changes else w
        out.setdefault(w.key, w)
    if "bf16" not in caps.layouts:
        out = _into_declared_layout(out, caps, device)
    for mode in [m for m in Mode if m in caps.modes]:  # in a fixed order: pytest-xdist's workers must agree
        accepted = [w for w in out.values() if w.mode is mode and caps.refusal(w, device) is None]
        if not accepted:
            continue
        smallest = min(accepted, key=lambda w: w.total_q + w.total_kv)
        for name, value in _declared_values(caps, mode, host_cache):
            if all((w.dims.num_heads if name == "num_heads" else getattr(w, name)) != value for w in accepted):
                changes = {name: value}
                if name == "page_size":  # each request one page longer: it crosses a page boundary of that size
                    changes["kv_lens"] = tuple(n and n + value for n in smallest.kv_lens)
                extra = smallest.replace(**changes)
                out.setdefault(extra.key, extra)
    return list(out.values())


def _into_declared_layout(workloads: dict[str, Workload], caps: Capabilities,
                          device: torch.device | str) -> dict[str, Workload]:
    """``workloads`` (by key, in order), each cache-reading one in a layout ``caps`` does not declare moved in its
    place to the first declared layout (sorted), where ``caps`` accepts it there and no workload has that key
    already."""
    layout, present, out = min(caps.layouts), set(workloads), {}
    for w in workloads.values():
        if w.mode.uses_cache and w.layout not in caps.layouts:
            moved = w.replace(layout=layout)
            if moved.key not in present and caps.refusal(moved, device) is None:
                present.add(moved.key)
                w = moved
        out[w.key] = w
    return out


def _declared_values(caps: Capabilities, mode: Mode, host_cache: bool) -> list[tuple[str, object]]:
    """The (workload field, value) pairs that conformance gives each declared mode at least once: every declared
    dtype (the tiny sweep has no float16) and layout (its sparse, chunked and DCP workloads are bf16), the smallest
    and largest declared head count and page size and the smallest non-power-of-two page size (kernels tile heads
    and split pages: their edges break, not the values in between), and the cache in host memory where
    ``host_cache``."""
    wanted: list[tuple[str, object]] = [("dtype", dtype) for dtype in DTYPES if dtype in caps.dtypes]
    if caps.head_counts:
        wanted += [("num_heads", n) for n in sorted({min(caps.head_counts), max(caps.head_counts)})]
    if mode.uses_cache:
        wanted += [("layout", layout) for layout in sorted(caps.layouts)]
    if mode.uses_cache and caps.page_sizes:
        odd = sorted(p for p in caps.page_sizes if p & (p - 1))
        wanted += [("page_size", p) for p in sorted({min(caps.page_sizes), max(caps.page_sizes), *odd[:1]})]
    if mode.uses_cache and host_cache:
        wanted.append(("cache_device", "cpu"))
    return wanted
