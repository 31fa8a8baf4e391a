"""Paged MLA decode in Triton: the functional API (plan, then run) and the registered ``triton_decode`` impl.

``plan_decode`` does the per-step host work: it validates the inputs (a block table pointing past the cache or
too short for a length is an error here, never an illegal memory access in the kernel), chooses the kernel
configuration and the split-KV schedule, and allocates the outputs and workspaces. ``run_decode`` only
launches kernels: no allocation, no host synchronization, so it can be captured in a CUDA graph and replayed
after the caller updates ``q``, the cache and the block table in place.

On Hopper, some row blocks run the split step in Gluon: 64 rows of a bf16 cache (``decode_wgmma_ws``: a loader warpgroup
copies by TMA, or gathers pages under a tile key by key, one warpgroup scores and one multiplies values;
``decode_wgmma`` where ``tma_loader`` is off or the query or cache are not TMA rows: the score product once across both
warpgroups, where Triton's layout rule computes it in each), 64 of fp8_ds_mla, fp8_e4m3, nvfp4 and mxfp4_nsa
(``decode_wgmma_quantized``: sparse_wgmma's step over the paged cache), 16 and 32 (``decode_wgmma_narrow``: keys on
wgmma's M side, tiles copied straight into its operands), 16 rows of fp8_ds_mla, fp8_e4m3, nvfp4 and mxfp4_nsa in pages
of whole 64-key steps (``decode_rs_fp8``: warp-specialized, copied by TMA, the codes decoded into wgmma's register
operands), 16 rows of the quantized layouts elsewhere (``decode_ws``: warp-specialized, eight warps decoding beside a
warpgroup of products) and 32 of fp8_ds_mla (``decode_wgmma_fp8``: keys on wgmma's M side); the merge and everything
else are shared. ``decode_mma_fp8`` (16 rows of fp8_ds_mla, codes decoded straight into mma.sync operands) is no default
since decode_ws beat it at every size (NOTES.md session 21), and runs when a ``DecodeConfig`` asks for its tile.

On Hopper the split kernel is a programmatic dependent launch of the stream's previous kernel
(``DecodeConfig.overlap_launch``): its programs start, and read the plan's work rows, while that kernel finishes, then
wait on the device for its results before reading the queries, the cache, the block table or the visible lengths
(``WAIT_PRIOR``), so an engine's kernel that writes any of them just before the decode is still seen; the merge lets
the next kernel start likewise. H100, 16 heads: batch 1 ctx8192 13.4 -> 12.2 us, no change at batch 64 (NOTES.md,
session 44). Before that wait, the bf16 split kernels ask L2 for their first item's first keys (``KEYS_AHEAD``,
``FIRST_KEYS_AHEAD``): a hint, whose block-table entry may be stale and is not used for anything else.

Where every group is cut into 2 to 4 splits of one program each, as a batch of 64 requests of 4096 keys is on 132
multiprocessors, decode_wgmma_narrow, decode_rs_fp8 and decode_wgmma_ws run in clusters of a group's splits, which
merge their partials themselves after a cluster barrier; no merge kernel runs (``_cluster_size``, ``CLUSTER_SIZES``;
H100, 16 heads b64: bf16 111.8 -> 109.8 us, fp8_ds_mla 72.3 -> 71.9; 64 heads b64 130.2 -> 123.0, 128 heads b32
90.9 -> 88.9, with the programs in slot order: ``in_slot_order``). Where the balanced cut straddles groups or leaves
short requests whole, a cut into such clusters replaces it within measured bounds (``_cluster_cuts``; fp8_ds_mla
b28 ctx2048 25.8 -> 23.0 us, 64 heads b44 ctx4096 104.1 -> 90.3).

On CPU the kernels run in Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before this module is imported
(``mla_bench.device.prepare`` does it for the CLI and the pytest plugin).

Other code calls the kernel directly with ``plan_decode(...)`` / ``run_decode(plan)`` or ``mla_decode(...)``;
decode context parallel runs it over a KV shard with ``visible_lens`` (per query token, the number of leading
keys of its request it may see; by default the causal ``kv_len - q_len + i + 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch
import triton.testing
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.interpreter import InterpretedFunction

from impls.triton import common
from impls.triton.decode_kernel import (ITEM_FIELDS, LOG2E, NOPE, ROPE, TILE, _decode_split_kernel,
                                       _merge_splits_kernel)
from impls.triton.decode_schedule import Schedule, build_schedule, in_slot_order
from impls.triton.decode_mma_fp8 import _decode_split_kernel_mma_fp8
from impls.triton.decode_wgmma import SWIZZLED, _decode_split_kernel_wgmma
from impls.triton import decode_wgmma_ws
from impls.triton.decode_wgmma_ws import _decode_split_kernel_wgmma_ws
from impls.triton.decode_wgmma_fp8 import _decode_split_kernel_fp8
from impls.triton import decode_wgmma_quantized
from impls.triton.decode_wgmma_quantized import _decode_split_kernel_quantized
from impls.triton.decode_wgmma_narrow import _decode_split_kernel_narrow
from impls.triton import decode_rs_fp8, decode_ws
from impls.triton.decode_rs_fp8 import _decode_split_kernel_rs_fp8
from impls.triton.decode_ws import _decode_split_kernel_ws
from impls.triton.latent_io import cache_tensor_scale
from mla_bench.dims import check_softmax_scale
from mla_bench.errors import UnsupportedConfig, given
from mla_bench.layouts import LATENT_DIM, PagedCache
from mla_bench.layouts.ops import check_cache
from mla_bench.lengths import check_int, check_lengths
from mla_bench.metadata.reference import check_block_table, cumulative
from mla_bench.problem import Problem
from mla_bench.registry import Capabilities, Impl
from mla_bench.workload import Mode

# Cache layouts the kernel decodes, and which values the layout's per-layer tensor scale multiplies
# (None: the layout has none).
KERNEL_LAYOUTS: dict[str, str | None] = {
    "bf16": None, "fp8_e4m3": "all", "fp8_ds_mla": None, "fp8_ds_mla_pow2": None, "fp4_mx16": None,
    "mxfp4_nsa": None, "nvfp4": "nope",
}
FP4_LAYOUTS = ("fp4_mx16", "mxfp4_nsa", "nvfp4")
# Keys of a batch per multiprocessor from which 128-row blocks pay (default_config). H200, 128 heads: at 993 (b32
# ctx4096, b16 ctx8192) they cut fp8_ds_mla and FP4 decode by 2-12%, at 3972 (b128) by 9-20%; at 496 (b8 ctx8192)
# -1% to +3%; at 62 (b1 ctx8192) +36-45% (NOTES.md, round 7).
WIDE_ROWS_MIN_KEYS_PER_SM = 512
# Batches too short to fill the GPU with 128-key splits (DecodeConfig.min_split): 64-key splits for 16-row blocks, and
# 32-row blocks of the quantized layouts, where those fill at most half the program slots (multiprocessors times
# programs each): at most SHORT_SPLIT_KEYS_PER_SLOT keys per slot. 16 heads, us, min_split 128 -> 64 (NOTES.md, session
# 33), H200 / H100: bf16 page 64 b1 ctx1024 9.5-9.9 -> 8.3 / 9.6-10.0 -> 8.2-8.3, ctx2048 10.5 -> 9.2 / 10.5-10.6 ->
# 9.3-9.4, ctx4096 11.5 -> 10.2 / 11.6 -> 10.5, b2 ctx2048 11.3 -> 10.4 / 11.3 -> 10.7, page 1 b1 ctx4096 11.0 -> 10.3 /
# 11.2 -> 10.7-10.8; b1 ctx4096 fp8_e4m3 11.8 -> 10.9 / 11.8-11.9 -> 11.0, fp8_ds_mla 12.5 -> 11.3 / 12.4-12.5 -> 11.3,
# fp4_mx16 12.7 -> 11.8 (H200), 16 x 2 tokens fp8_ds_mla 16.8 -> 15.9 / 16.8 -> 16.5; the FP4 layouts' Triton kernel
# (two programs a multiprocessor) b1 ctx8192 nvfp4 15.6 -> 13.7 / 15.5-15.7 -> 14.1, mxfp4_nsa 15.8 -> 13.6 / 15.6-15.7
# -> 13.9. Not for bf16's 32-row blocks: 16 x 2 tokens b2 ctx2048 13.1 -> 13.3 / 13.6 -> 14.0. More 64-key splits than
# half the slots were slower (H200): bf16 b3 ctx2048 (96 programs) 11.8 -> 12.1, b1 ctx8192 (128) 12.7 -> 12.8, b2
# ctx4096 12.8 -> 13.2; b1 ctx8192 fp8_e4m3 13.1 -> 14.3, fp8_ds_mla 13.8 -> 14.6.
SHORT_SPLIT_KEYS_PER_SLOT = 32
SHORT_MIN_SPLIT = 64
# Peak DRAM bandwidth per multiprocessor (GB/s) from which 128-row blocks pay, by layout. Their one stage leaves each
# step's loads exposed, which only a fast memory covers: H200 (37 GB/s per SM) ran them faster (round 7, above);
# an H100 SXM (25) ran the 64-row blocks faster at 993-3972 keys per SM, us 128 -> 64 rows: fp8_ds_mla b32 397 ->
# 335, b128 1419 -> 1273; nvfp4 b32 209 -> 188, b128 702 -> 665; mxfp4_nsa b32 203 -> 193, b128 684 -> 686;
# fp4_mx16 (the fewest bytes, the most decoding) b32 200 -> 199, b128 655 -> 732 (NOTES.md, session 28).
WIDE_ROWS_MIN_GBPS_PER_SM = {"fp8_ds_mla": 30.0, "fp8_ds_mla_pow2": 30.0, "nvfp4": 30.0, "mxfp4_nsa": 30.0,
                             "fp4_mx16": 0.0}
# Keys of a batch per multiprocessor from which 16-row blocks on Hopper run the warp-specialized kernel (one program
# per multiprocessor), by layout; H200, 16 heads, sessions 19 and 21 (NOTES.md). fp8_ds_mla, against decode_mma_fp8
# (two), since session 21's bulk prefetch: at 124 (b4 ctx4096, pages of 64, 16 and 1) 20.5 -> 16.0, 21.8 -> 20.1
# and 21.6 -> 20.4 us, at 62 (b2 ctx8192) 21.8 -> 17.6, at 62, 31, 15.5 and 3.9 (b1 ctx8192 to ctx512) 17.2 ->
# 13.9, 15.8 -> 12.6, 14.8 -> 11.7 and 14.1 -> 11.1. nvfp4, against the Triton kernel: at 124 (b4) 20.3 -> 19.8; at 62
# (b2 ctx4096) 19.1 -> 19.2. mxfp4_nsa, against the Triton kernel: at 992 (b32) 57.4 -> 50.8, at 248 (b8) 25.5 ->
# 21.5; at 124 (b4) 18.4 -> 21.2, at 62 (b2, b1 ctx8192) 16.7 -> 16.9, 16.9 -> 16.4.
# fp4_mx16 (its rope FP4 too): faster at every size measured, from 116.0 -> 91.6 at b64 to 22.8 -> 19.6 at b1 ctx8192.
# fp8_e4m3, against the Triton kernel, since session 21: at 124 (b4) 16.7 -> 15.3, at 62 (b2 ctx8192, b1 ctx8192)
# 18.4 -> 16.9 and 14.6 -> 13.3, at 31 and 7.8 (b1 ctx4096, ctx1024) 13.3 -> 12.0 and 12.0 -> 10.7.
# In pages of whole 64-key steps the layouts of decode_rs_fp8 take it from any size instead (_ws_min_keys): H100, 16
# heads, the Triton kernel -> decode_rs_fp8 (NOTES.md, session 52): nvfp4 b1 ctx1024 8.36 -> 7.17, ctx4096 13.20 ->
# 10.61, ctx8192 14.99 -> 12.48, b2 ctx4096 15.92 -> 11.41; mxfp4_nsa b1 ctx1024 8.32 -> 7.43, ctx4096 12.92 -> 10.86,
# ctx8192 14.84 -> 12.71, b2 ctx4096 16.03 -> 11.71, b6 23.37 -> 17.30; in 32 rows against the 32-row Triton kernel,
# 16 heads x 2 tokens b2 ctx1024 16.86 -> 9.23, b8 ctx4096 30.98 -> 22.08, b32 74.40 -> 62.15, 32 heads b32 74.57 ->
# 62.20.
WS_MIN_KEYS_PER_SM = {"fp8_ds_mla": 0, "fp8_ds_mla_pow2": 0, "fp8_e4m3": 0, "nvfp4": 96, "mxfp4_nsa": 192,
                      "fp4_mx16": 0}
QUERY_DTYPES = (torch.bfloat16,)
# Columns of a work item's row (decode_kernel reads them by position): its request, row block and key range, its
# workspace slot (-1: writes the final output), and the request's first token and token count.
ITEM_COLUMNS = ("request", "row_block", "kv_start", "kv_end", "slot", "first_token", "tokens")
# Float32 partial values one merge step reads (16 per thread of 4 warps): fewer steps at batch 1 (64 splits), and
# few enough registers that the loads stay in flight (H200: 8192 per step cost 2% at b32-b64; NOTES.md, round 4).
MERGE_VALUES = 2048
# The split partials are stored to stay in L2 for the merge (evict_last) when they fill at most this share of it.
# H200 (60 MiB L2): 16 heads, 4 MiB of partials, b32 47.1 -> 45.6 us and b64 83.0 -> 81.1 (NOTES.md, round 9);
# kept unconditionally, 128 heads in 128-row blocks (32 MiB) got slower: fp8_ds_mla 340 -> 357 (round 8).
PARTIALS_L2_SHARE = 0.25
FP8_DS_MLA = ("fp8_ds_mla", "fp8_ds_mla_pow2")
# decode_rs_fp8's, in pages of whole steps (_tma_descriptors). Not fp4_mx16: three of every four of its 324-byte keys
# start off a 16-byte boundary, and a TMA box must start on one (H100, boxes of the cache seen as 4-key rows starting
# at such a key: illegal instruction; NOTES.md, session 53), so it stays with decode_ws.
RS_LAYOUTS = FP8_DS_MLA + ("fp8_e4m3", "nvfp4", "mxfp4_nsa")
# The Gluon split kernels for Hopper, by tile (query rows, keys per step, warps) and cache layout: decode_wgmma's 64-row
# bf16 kernel, decode_wgmma_quantized's 64-row one (fp8 and two FP4 layouts), decode_wgmma_narrow's 16- and 32-row bf16
# one, decode_wgmma_fp8's 16- and 32-row fp8_ds_mla one, decode_mma_fp8's 16-row fp8_ds_mla one and decode_ws's (12
# warps in two partitions) 16-row fp8_ds_mla, fp8_e4m3 and FP4 one.
GLUON_SPLITS = {
    ((64, 64, 8), "bf16"): _decode_split_kernel_wgmma,
    **{((64, 64, 8), layout): _decode_split_kernel_quantized for layout in decode_wgmma_quantized.LAYOUTS},
    **{((rows, 64, 4), "bf16"): _decode_split_kernel_narrow for rows in (16, 32)},
    **{((rows, 64, 8), layout): _decode_split_kernel_fp8 for rows in (16, 32) for layout in FP8_DS_MLA},
    **{((16, 64, 4), layout): _decode_split_kernel_mma_fp8 for layout in FP8_DS_MLA},
    **{((16, 64, decode_ws.WARPS), layout): _decode_split_kernel_ws for layout in decode_ws.LAYOUTS},
}
# Launch options of the Gluon kernels whose warps are not DecodeConfig.num_warps (warp-specialized ones).
GLUON_LAUNCH_OPTIONS = {_decode_split_kernel_ws: decode_ws.LAUNCH_OPTIONS}
GLUON_TILES = frozenset(tile for tile, _ in GLUON_SPLITS)
# The kernels run in Triton's interpreter (CPU tensors) when TRITON_INTERPRET was set before they were defined.
INTERPRETED = isinstance(_decode_split_kernel, InterpretedFunction)


@dataclass(frozen=True)
class DecodeConfig:
    """Kernel parameters. ``block_m`` query rows and ``block_n`` keys per step; ``heads_as_n`` puts the query rows on
    the N side of the matrix products (see decode_kernel); ``num_stages`` is the software pipeline's depth (the kernel
    keeps ``num_stages - 1`` key tiles in flight); ``programs_per_sm`` sets the persistent grid (SMs times it),
    ``min_split`` the fewest keys a program gets; ``num_splits`` forces the splits per group, one program each (tests,
    sweeps). ``merge_splits`` caps the partials a merge step reads at once (None: as many as ``MERGE_VALUES`` allows).
    ``early_merge``: launch the merge kernel as a programmatic dependent of the split kernel (Hopper), which starts it
    while the split kernel runs and hides its launch latency. ``reread_values``: quantized caches read each latent tile
    once per product and decode it in that product's operand layout, fp8 as bf16 (the round-2 kernel: fewer registers);
    off (the default), a tile is read and decoded once for both products, fp8 as float16 with the query scaled into
    float16's range (see decode_kernel). ``keep_partials``: store the split partials to stay in L2 for the merge (None:
    when they fit ``PARTIALS_L2_SHARE`` of it). ``gluon``: the split step runs one of the Gluon kernels for Hopper
    (``GLUON_SPLITS``), chosen by the tile and the cache layout: bf16 in 64 rows ``decode_wgmma_ws`` where
    ``tma_loader`` allows it (``_tma_descriptors``), else ``decode_wgmma`` (the score product once across its two
    warpgroups), in 16 or 32 rows with 4 warps ``decode_wgmma_narrow`` (keys on wgmma's M side); fp8_ds_mla, fp8_e4m3,
    nvfp4 and mxfp4_nsa in 64 rows ``decode_wgmma_quantized`` (rows on wgmma's M side, each tile decoded once for both
    products); fp8_ds_mla in 16 or 32 rows with 8 warps ``decode_wgmma_fp8`` (keys on wgmma's M side), in 16 rows with 4
    warps ``decode_mma_fp8`` (mma.sync: codes decoded straight into operand registers), in 16 rows with 12 warps
    ``decode_ws`` (warp-specialized: 8 decoding warps beside a warpgroup of products), which also runs fp8_e4m3 and the
    FP4 layouts in 16 rows. ``tma_loader``: where the cache (and for bf16 the query) is contiguous, 64 rows of bf16 run
    ``decode_wgmma_ws`` (a loader warpgroup copies by TMA, or gathers pages under a tile by cp.async, one warpgroup
    scores, one multiplies values) and, where pages hold whole 64-key tiles, decode_ws's tile of fp8_ds_mla, fp8_e4m3,
    nvfp4 and mxfp4_nsa runs ``decode_rs_fp8`` (a TMA loader, two scoring warpgroups and one of values, the codes
    decoded into wgmma's register operands, no decoded tile in shared memory); off, ``decode_wgmma`` and ``decode_ws``
    everywhere. ``overlap_launch`` (Hopper): launch the split kernel as a programmatic dependent of the stream's
    previous kernel, so that its programs start, and read their work rows, while that kernel finishes; every split
    kernel waits on the device for the previous kernel's results before it reads anything else (``WAIT_PRIOR``), but for
    an L2 prefetch of the first keys in the bf16 kernels (``FIRST_KEYS_AHEAD``), and the merge lets the next kernel
    start likewise. ``cluster_merge`` (Hopper): where every group has 2 to 4 splits, one program each
    (``_cluster_size``), decode_wgmma_narrow, decode_rs_fp8 and decode_wgmma_ws run in clusters of a group's splits,
    which merge their partials themselves, and no merge kernel runs; where the balanced cut straddles groups or leaves
    short requests whole on too few programs, such a cut replaces it within measured bounds (``_cluster_cuts``)."""

    block_m: int = 16
    block_n: int = 32
    heads_as_n: bool = False
    num_warps: int = 4
    num_stages: int = 4
    programs_per_sm: int = 1
    min_split: int = 128
    num_splits: int | None = None
    merge_splits: int | None = None
    early_merge: bool = False
    reread_values: bool = False
    keep_partials: bool | None = None
    gluon: bool = False
    tma_loader: bool = True
    overlap_launch: bool = True
    cluster_merge: bool = True

    def __post_init__(self) -> None:
        """Refuse what fails only at the first launch (inside Triton, some only on a GPU) or later in plan: tiles and
        warps that are not powers of two (a Gluon tile's warps are checked with its tile: decode_ws runs 12), counts
        that are not ints >= 1."""
        counts = ("block_m", "block_n", "num_warps", "num_stages", "programs_per_sm", "min_split")
        counts += tuple(name for name in ("num_splits", "merge_splits") if getattr(self, name) is not None)
        for name in counts:  # numpy ints stored as the Python ints Triton takes
            object.__setattr__(self, name, check_int(f"DecodeConfig.{name}", getattr(self, name), 1))
        for name in ("block_m", "block_n"):
            common.check_power_of_two(self, name, 16)
        if self.merge_splits is not None:
            common.check_power_of_two(self, "merge_splits")
        if not self.gluon:
            common.check_power_of_two(self, "num_warps")
            if self.num_warps > 16:  # 512 threads: the most the Triton split kernel is launched with
                raise ValueError(f"DecodeConfig.num_warps must be at most 16, got {self.num_warps}")
        if self.gluon and (self.block_m, self.block_n, self.num_warps) not in GLUON_TILES:
            raise ValueError(f"DecodeConfig.gluon runs (block_m, block_n, num_warps) in {sorted(GLUON_TILES)}, got "
                             f"{(self.block_m, self.block_n, self.num_warps)}")


# decode_mma_fp8's tile (16 rows of fp8_ds_mla, two programs per multiprocessor): no default since decode_ws beat it at
# every size (NOTES.md session 21); a config can still ask for it.
MMA_FP8_CONFIG = DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=1, programs_per_sm=2, early_merge=True,
                              gluon=True)
# decode_wgmma_quantized's tile (64 rows of its layouts), the default on Hopper for more than 32 rows from
# QUANTIZED_ROWS_MIN_KEYS_PER_SM keys per multiprocessor. H100, 128 heads, us (NOTES.md, sessions 28 and 29), the
# Triton kernel's 64 rows (128 rows) -> this: fp8_ds_mla b32 ctx4096 335 (398) -> 155, b128 1283 (1420) -> 563, b8
# ctx8192 178 -> 88, b1 ctx8192 40.7 -> 33.0, 64 heads b32 177 -> 92, 16 heads x 4 tokens b32 177 -> 92; fp8_e4m3
# b32 185 -> 130, b128 659 -> 461, b8 101 -> 75, b1 32.7 -> 31.3, 16 x 4 b32 105 -> 78; nvfp4 b32 189 (207) -> 139,
# b128 672 (688) -> 501, b8 103 -> 78, b1 32.4 -> 30.9, 16 x 4 b32 108 -> 81; mxfp4_nsa b32 194 (204) -> 150, b128
# 693 (682) -> 540, b8 (496 keys per SM) 104.7 -> 83.9, 16 x 4 b32 109 -> 86, and b1 (62 keys per SM) 30.6 -> 31.2.
# fp8_ds_mla_pow2 with one scale per key since session 30: b32 154 -> 141, b128 557 -> 505, 16 x 4 b32 91 -> 84.
QUANTIZED_ROWS_CONFIG = DecodeConfig(block_m=64, block_n=64, num_warps=8, num_stages=1, gluon=True)
QUANTIZED_ROWS_MIN_KEYS_PER_SM = {**dict.fromkeys(decode_wgmma_quantized.LAYOUTS, 0), "mxfp4_nsa": 256}
# More than 32 rows of decode_rs_fp8's layouts in whole 64-key pages take its 16-row tile, a request's row blocks side
# by side over the same keys, up to these 16-row blocks times keys per multiprocessor (a row block's keys decoded once
# for each of its 16 rows, not once for 64, so the decoding-bound FP4 layouts stop sooner). H100, us, 64-row kernels
# -> decode_rs_fp8 (NOTES.md, session 52), by blocks times keys per SM: 64 heads fp8_ds_mla b1 ctx8192 (248) 25.67 ->
# 15.87, b8 ctx4096 (993) 38.43 -> 33.13, b12 (1489) 49.92 -> 46.99, b16 (1986) 54.95 -> 58.43, b24 +10.8%; fp8_e4m3
# b8 34.80 -> 28.70, b16 +4.0%, b24 +8.4%; nvfp4 b1 23.55 -> 15.58, b8 35.04 -> 33.70, b12 +9.0%, b16 +21.7%;
# mxfp4_nsa b1 24.94 -> 15.99, b4 (496) 27.46 -> 21.76, b8 38.84 -> 34.84, b12 +10.1%, b16 +19.8%; 128 heads
# fp8_ds_mla b1 ctx8192 (496) 31.51 -> 21.74, b4 ctx4096 (993) 36.86 -> 32.73, nvfp4 b1 29.58 -> 21.88, b4 34.05 ->
# 33.55, mxfp4_nsa b2 (496) 26.18 -> 21.72; 16 heads x 4 tokens mxfp4_nsa b8 (993) 38.92 -> 34.85, fp8_ds_mla b16
# +6.3%. The rule on against off, held-out shapes: fp8_ds_mla 64 heads b4 ctx8192 -14.8%, 48 heads b8 -26.0%, 128
# heads b2 ctx12288 (1489) -0.1%; fp8_ds_mla_pow2 128 heads b1 ctx4096 -32.5%; fp8_e4m3 128 heads b1 ctx16384 -19.5%,
# 16 heads x 4 tokens b12 (1489) -9.4%; nvfp4 128 heads b2 ctx8192 -1.7%, 64 heads b2 ctx16384 -6.5%; mxfp4_nsa 64
# heads b6 -13.7%, 16 heads x 4 tokens b2 ctx8192 -24.2%.
RS_ROWS_MAX_BLOCK_KEYS_PER_SM = {**dict.fromkeys(("fp8_ds_mla", "fp8_ds_mla_pow2", "fp8_e4m3"), 1536),
                                 "nvfp4": 1024, "mxfp4_nsa": 1024}
# decode_ws's tile (16 rows of its layouts, one program per multiprocessor), the default from WS_MIN_KEYS_PER_SM.
WS_CONFIG = DecodeConfig(block_m=16, block_n=64, num_warps=decode_ws.WARPS, num_stages=1, early_merge=True, gluon=True)
# Keys of a batch per multiprocessor from which 16-row bf16 blocks in whole 64-key pages run decode_wgmma_narrow, not
# the Triton kernel (default_config; smaller pages take it at any size). H100, 16 heads, page 64, both with the launch
# overlap and the first keys asked of L2 (FIRST_KEYS_AHEAD), us, Triton -> narrow (NOTES.md, session 45): at 372 (b12)
# 30.7 -> 30.7, at 496 (b16) 35.0 -> 34.2, at 744 (b24) 50.1 -> 49.7, at 993 (b32) 60.8 -> 59.4, at 1489 (b48) 89.3 ->
# 88.3, at 1986 (b64) -0.4% (session 44); below, the kernels trade places: at 248 b8 -1.8% but b1 ctx32768 +2.1%,
# at 124 b4 -5.4% but b2 ctx8192 +11%. (Session 44, without the prefetch: a tie at 993-1489, +0.5 to +3% at 248-496.)
NARROW_MIN_KEYS_PER_SM = 320
# Under the launch overlap, the bf16 split kernels (the Triton kernel, which also reads the quantized layouts at small
# batches, decode_wgmma_narrow, decode_wgmma and decode_wgmma_ws) ask L2 for this many keys of their first item
# before the wait (``decode_kernel._prefetch_first_keys``): the bytes arrive while the previous kernel (in a stream of
# decodes, the merge) ends. H100, 16 heads, page 64, against none: b1 ctx8192 12.3 -> 11.7 us (-5%), b8 -2%, page 16
# b32 -1.7%, b64 -0.5 to -1.1%, b128 -0.4%; page 1 b1 -5.4%, b8 -7.2%, b32 -2.2%; 128 heads b1 -0.8%; 128 keys gave
# less (b1 -2.7%, b64 -0.2%). On an H200 within 0.3% at page 64 but b1 (-0.8%), page 1 b1 -4.6% but b64 +1.1%. The
# quantized kernels measured -0.4 to +0.6% with it (decode_rs_fp8's fp8 layouts slower) and do not ask (NOTES.md
# session 45).
FIRST_KEYS_AHEAD = 64
# Splits per group that decode_wgmma_narrow merges inside a cluster of that many programs (``_cluster_size``), where
# the GPU holds all the clusters at once (an H100 runs 66 clusters of 2 narrow programs but only 30 of 4, so b32
# ctx4096's 32 groups of 4 keep the merge kernel). H100, 16 heads, page 64 unless said, us, merge kernel -> clusters
# of 2 (NOTES.md session 46): b64 ctx4096 111.8 -> 109.8 (0.908 -> 0.924 of copy), ctx2048 -1.2%, ctx1024 -2.4%,
# page 1 -1.3%, page 16 -1.3%, page 128 -1.7%, b66 -1.0%. decode_wgmma_ws alike (session 51, clusters of 2): 64 heads
# b64 -5.6%, b66 ctx2048 -9.7%, 16 heads x 4 tokens b64 -5.8%, 128 heads b32 -2.2%, b33 -2.9%, page 1 b32 -3.5%.
CLUSTER_SIZES = (2, 3, 4)
# Where the balanced cut straddles (a program runs pieces of several groups, groups cut in 3-8 splits, and the merge
# kernel), or leaves short requests whole on too few programs, every group cut into 2-4 equal splits that merge in
# clusters is faster though fewer programs stream than the balanced cut's (``_cluster_cuts``; below
# NARROW_MIN_KEYS_PER_SM the plan takes the narrow kernel's tile for it). H100, 16 heads, page 64, us, balanced ->
# clusters, the rule as landed (NOTES.md session 47): ctx2048 b24 30.1 -> 28.0 (-7.1%), b28 -11.7%, b36 -9.5%, b40
# -5.7%, b56 -4.2%; ctx1024 b20-b52 -2.5 to -11.8%; ctx4096 b18 -5.3%, b28 56.1 -> 53.4 (-4.8%), b36 -1.9%; ctx6144
# -2.5 to +0.8%; whole requests ctx512 b52 21.4 -> 17.2 (-19.6%) to b66 -11.5%, ctx256 b40 and b64 -9%; pages 1 and 16
# -0.7 to -5.8%; 16 heads x 2 tokens (32 rows) ctx2048 b36 48.5 -> 41.3 (-15.0%), ctx4096 -6.4 to -10.4%, ctx6144
# -4.1 to -7.9%, ctx8192 -1.7 to -7.1%, ctx12288 -3.5 to +1.0%. Each bound from the sweeps of forced cuts: fewer than
# 72 programs lose (b16 ctx4096 in fours +4.0%; b18 ctx1024's 72 +0.8%); long splits lose, sooner in 16 rows (2048
# keys at ctx8192 +0.4 to +1.7%) than in 32 (4096 keys at ctx16384 -1.5 to +1.5%); so do uneven batches, where the
# longest request's splits set the time (lengths within +-25% of ctx4096: +2.4 to +3.4%); and where the balanced cut
# runs one item a program (b33 ctx2048 and ctx4096 +2.2 to +3.8%).
# decode_rs_fp8 (fp8_ds_mla, fp8_e4m3 in pages of whole steps; rule on against off, NOTES.md session 48): fp8_ds_mla
# ctx512 b52 19.2 -> 15.5 (-19.3%), b64 -15.5%; ctx1024 b36-b52 -4.5 to -10.1%; ctx2048 b22-b56 -3.0 to -11.1% (b28
# 25.8 -> 23.0); ctx4096 b24-b36 -3.6 to -7.4%; ctx6144 b28 -2.5%; page 128 -11.7%; lengths within +-5% -7.4%;
# fp8_e4m3 -5.5 to -11.3%. Its programs stream slower alone (a step's chain of decoding and products, not the
# memory, bounds one), so fewer of them lose sooner: 72 programs +7.1% (b18 ctx2048) and +11.3% (ctx4096), 80 of
# 1536 keys +12.4% (b20 ctx6144; 80 of 256 keys -6.0%, b20 ctx1024). Not nvfp4 (decoding bounds it harder: b24
# ctx4096 +14.6%, ctx1024-2048 -0.9 to +0.7%), nor requests in several 16-row blocks, which the balanced cut runs side
# by side over the same keys (16 heads x 2 tokens ctx2048 b28 +4.6%, b20 +30.5%).
# decode_wgmma_ws (64 rows of bf16, whose merge kernel costs 6-12 us; rule on against off, NOTES.md session 51): 64
# heads ctx4096 b18 54.7 -> 46.0 (-15.9%), b20 -15.1%, b28 -13.4%, b30 (lengths within +-5%) -13.1%, b36 -9.9%, b40
# -11.7%, b44 -13.2%; ctx8192 b36 -6.7%; ctx2048 b60 -17.5%; ctx1024 b52 -21.6%; 16 heads x 4 tokens b36 -10.9%.
# The forced cuts before it: 48 programs +17.3% (b24 in pairs), 72 programs of 4096 keys +0.3% (b36 ctx8192 in pairs),
# so the bounds are bf16's programs and 32 rows' keys.
CLUSTER_CUT_MIN_PROGRAMS_PER_SM = {"bf16": 0.54, "fp8_ds_mla": 0.66, "fp8_ds_mla_pow2": 0.66, "fp8_e4m3": 0.66}
CLUSTER_CUT_MAX_KEYS = {16: 1536, 32: 3072, 64: 3072}  # by rows a group
CLUSTER_CUT_MAX_IMBALANCE = 1.1


def default_config(num_heads: int, max_q_len: int, layout: str = "bf16", page_size: int = 64,
                   keys_per_sm: float = 0.0, hopper: bool = False, gbps_per_sm: float = 0.0) -> DecodeConfig:
    """Parameters for a workload, chosen from the H100/H200 sweeps in NOTES.md; ``keys_per_sm`` is the batch's keys
    over the GPU's multiprocessors; ``hopper``: the device runs wgmma (compute capability 9); ``gbps_per_sm``: the
    device's peak DRAM bandwidth over its multiprocessors.

    Query rows per request (heads x new tokens) set the row block. More than 32 rows of fp8_ds_mla, fp8_e4m3, nvfp4
    or mxfp4_nsa on Hopper in pages of whole 64-key steps, up to ``RS_ROWS_MAX_BLOCK_KEYS_PER_SM`` 16-row blocks times
    keys per multiprocessor: decode_ws's 16-row tile (decode_rs_fp8), a request's blocks side by side over its keys
    (H100, 64 heads b1 ctx8192: fp8_ds_mla 25.7 -> 15.9 us, mxfp4_nsa 24.9 -> 16.0, NOTES.md session 52); above it, and
    in other pages (mxfp4_nsa from ``QUANTIZED_ROWS_MIN_KEYS_PER_SM``): 64-row blocks through
    ``decode_wgmma_quantized`` (``QUANTIZED_ROWS_CONFIG``). 128 rows or more of another quantized layout than
    fp8_e4m3 (of those layouts too off Hopper), with at least ``WIDE_ROWS_MIN_KEYS_PER_SM`` keys
    and ``WIDE_ROWS_MIN_GBPS_PER_SM`` of bandwidth per multiprocessor: 128-row blocks, one stage of 64 keys, tiles
    decoded once (each decoded tile serves twice the rows; the accumulators spill and it is still faster where
    memory is fast; at batch 1 every split program would load all 128 query rows for a few keys). 64 rows (128
    heads, or 16 heads x 4 tokens): the wgmma path, 8 warps (the 64x512 float32 output needs two warpgroups); bf16
    on Hopper runs the Gluon kernel (``decode_wgmma``: the score product once, not once per warpgroup; H100, 128
    heads b32: 158.6 -> 105.7 us, NOTES.md round 11); fp8_ds_mla there decodes its tiles once per product (decoded
    once, its float16 path spills registers). 32 rows of fp8_ds_mla or fp8_e4m3 on Hopper in pages of whole 64-key
    steps, as two full 16-row blocks (16 heads x 2 tokens, 32 heads): decode_ws's tile, so decode_rs_fp8 where the
    cache takes TMA, the two blocks of a request side by side over its keys (H100 b32 against the 32-row kernels:
    fp8_ds_mla 65.7 -> 60.0 us, fp8_e4m3 77.0 -> 51.9, NOTES.md session 40), and so of nvfp4 and mxfp4_nsa at any size
    (``_ws_min_keys``; nvfp4 through decode_ws, b8 33.2 -> 27.2, b32 74.7 -> 72.0, b64 134.3 -> 130.2, and
    decode_rs_fp8 since session 41; mxfp4_nsa since session 52, b32 74.4 -> 62.2; not fp4_mx16 or bf16, each 2-6%
    slower that way); other 32 rows of
    fp8_ds_mla on Hopper: the Gluon kernel with keys on wgmma's M side (``decode_wgmma_fp8``; H200, 16 heads x 2 tokens
    b32: 135.7 -> 80.4 us, NOTES.md session 13); 16 rows of fp8_ds_mla on Hopper: the warp-specialized Gluon kernel
    (``decode_ws``; H200, 16 heads against ``decode_mma_fp8``, b64 112.5 -> 88.4 us, b128 209.1 -> 153.7, NOTES.md
    sessions 16 and 19, and faster at every batch since session 21); 16 rows of nvfp4 on Hopper from
    ``_ws_min_keys`` keys per multiprocessor (none in whole 64-key pages): the same warp-specialized kernel (H200, 16
    heads b64: 91.9 -> 78.5 us, b128 170.8 -> 138.5, NOTES.md sessions 18 and 19; decode_rs_fp8 where the cache takes
    TMA, H100 b64 75.3 -> 63.4, NOTES.md session 41), of mxfp4_nsa (b64 98.8 -> 83.8, b128 183.1 -> 148.6;
    decode_rs_fp8 where the cache takes TMA, H100 b64 79.7 -> 64.2, NOTES.md session 52), of fp4_mx16 (b64 116.0 ->
    91.6, b128 218.4 -> 162.0) and of fp8_e4m3 (b64 98.8 -> 76.0, b128 182.4 -> 131.5, NOTES.md session 19). bf16 on
    Hopper in 32 rows, and in 16 rows in pages smaller than a 64-key step: the Gluon kernel with keys on wgmma's M side
    (``decode_wgmma_narrow``; H200, 16 heads x 2 tokens b32 67.1 -> 50.2 us, 16 heads page 1 b128 158.1 -> 149.2,
    NOTES.md session 15), and so in whole pages from ``NARROW_MIN_KEYS_PER_SM``. Other 16 or 32 rows: memory-bound, the
    mma.sync path of the Triton kernel. 16 rows of bf16 or fp8_e4m3 (off Hopper, or few keys) in whole 64-key pages, and
    of bf16 in page 1 off Hopper: 64-key steps, one program per multiprocessor (bf16: three tiles of 72 KB fill its
    shared memory; page 1 since its block-table lines are prefetched, NOTES.md round 7); FP4 layouts, since their decode
    takes half the instructions it did (NOTES.md session 17), two programs of two 64-key stages in 16 rows (H200, 16
    heads b64 nvfp4: 105.8 -> 92.8 us); FP4 and fp8_e4m3 in 32 rows two programs of three 32-key stages (16 heads x 2
    tokens b32: nvfp4 119.8 -> 78.6, fp8_e4m3 114.0 -> 80.0; fp8_ds_mla off Hopper keeps 8 warps, unmeasured); other
    16-row blocks two programs of 32-key steps (fp8_e4m3 in page 1 measured slower with 64-key steps: NOTES.md rounds 5
    and 7). The early merge helps the memory-bound row blocks (0.4-0.8 us at b1 and b32) and hurt 128 heads at b1 (29.5
    -> 36.7 us), so only the former use it. 16-row blocks, and 32-row blocks of the quantized layouts, in batches of at
    most ``SHORT_SPLIT_KEYS_PER_SLOT`` keys per program slot: splits of 64 keys, not 128, so that more multiprocessors
    stream the keys.
    """
    config = _tile_config(num_heads, max_q_len, layout, page_size, keys_per_sm, hopper, gbps_per_sm)
    short_rows = config.block_m == 16 or (config.block_m == 32 and layout != "bf16")
    if short_rows and keys_per_sm <= SHORT_SPLIT_KEYS_PER_SLOT * config.programs_per_sm:
        return replace(config, min_split=SHORT_MIN_SPLIT)
    return config


def _runs_rs(layout: str, page_size: int) -> bool:
    """Whether decode_ws's tile of ``layout`` in pages of ``page_size`` runs decode_rs_fp8 (where the cache takes
    TMA): its layouts in pages of whole 64-key steps."""
    return layout in RS_LAYOUTS and _whole_tiles(page_size)


def _ws_min_keys(layout: str, page_size: int) -> float:
    """Keys per multiprocessor from which decode_ws's tile pays for ``layout`` in pages of ``page_size``: any number
    where it runs decode_rs_fp8, else ``WS_MIN_KEYS_PER_SM``."""
    return 0 if _runs_rs(layout, page_size) else WS_MIN_KEYS_PER_SM[layout]


def _tile_config(num_heads: int, max_q_len: int, layout: str, page_size: int, keys_per_sm: float, hopper: bool,
                 gbps_per_sm: float) -> DecodeConfig:
    """``default_config``'s choice of kernel and tile, before its split size."""
    rows = num_heads * max_q_len
    block_keys = keys_per_sm * math.ceil(rows / 16)  # keys per multiprocessor of 16-row blocks
    if rows > 32 and hopper and _runs_rs(layout, page_size) and block_keys <= RS_ROWS_MAX_BLOCK_KEYS_PER_SM[layout]:
        return WS_CONFIG  # a request's 16-row blocks side by side (decode_rs_fp8)
    if rows > 32 and hopper and keys_per_sm >= QUANTIZED_ROWS_MIN_KEYS_PER_SM.get(layout, math.inf):
        return QUANTIZED_ROWS_CONFIG
    wide_rows = layout in WIDE_ROWS_MIN_GBPS_PER_SM and gbps_per_sm >= WIDE_ROWS_MIN_GBPS_PER_SM[layout]
    if rows >= 128 and wide_rows and keys_per_sm >= WIDE_ROWS_MIN_KEYS_PER_SM:
        return DecodeConfig(block_m=128, block_n=64, num_warps=8, num_stages=1)
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    if block_m == 64:
        if layout.startswith("fp8_ds_mla"):
            return DecodeConfig(block_m=64, block_n=32, num_warps=8, num_stages=3, reread_values=True)
        return DecodeConfig(block_m=64, block_n=64, num_warps=8, num_stages=2, gluon=hopper and layout == "bf16")
    if block_m == 32 and hopper and _runs_rs(layout, page_size) and rows % 16 == 0:
        return WS_CONFIG  # two full 16-row blocks a request, side by side (decode_rs_fp8 where TMA can copy)
    if block_m == 32 and hopper and layout.startswith("fp8_ds_mla"):
        return DecodeConfig(block_m=32, block_n=64, num_warps=8, num_stages=1, early_merge=True, gluon=True)
    if block_m == 16 and hopper and layout in decode_ws.LAYOUTS and keys_per_sm >= _ws_min_keys(layout, page_size):
        return WS_CONFIG
    if hopper and layout == "bf16" and (block_m == 32 or page_size % 64 or keys_per_sm >= NARROW_MIN_KEYS_PER_SM):
        return DecodeConfig(block_m=block_m, block_n=64, num_warps=4, num_stages=1, early_merge=True, gluon=True)
    whole_pages = layout in ("bf16", "fp8_e4m3") and page_size % 64 == 0
    if block_m == 16 and (whole_pages or (layout == "bf16" and page_size == 1)):
        return DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=3, programs_per_sm=1, early_merge=True)
    if block_m == 16 and layout in FP4_LAYOUTS:
        return DecodeConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, programs_per_sm=2, early_merge=True)
    if block_m == 16:
        return DecodeConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, programs_per_sm=2, early_merge=True)
    if layout == "fp8_e4m3" or layout in FP4_LAYOUTS:
        return DecodeConfig(block_m=32, block_n=32, num_warps=4, num_stages=3, programs_per_sm=2, early_merge=True)
    if layout == "bf16":
        return DecodeConfig(block_m=32, block_n=64, num_warps=8, num_stages=3, early_merge=True)
    return DecodeConfig(block_m=32, block_n=32, num_warps=8, num_stages=4, early_merge=True)


def batch_config(num_heads: int, q_lens: Sequence[int], kv_lens: Sequence[int], layout: str, page_size: int,
                 device: torch.device) -> DecodeConfig:
    """``default_config`` for a batch on ``device``: its longest query, its keys and the device's bandwidth per
    multiprocessor."""
    sms = common.sm_count(device)
    return default_config(num_heads, max(q_lens), layout, page_size, sum(kv_lens) / sms, common.has_wgmma(device),
                          _dram_gbps(device) / sms)


@dataclass
class DecodePlan:
    """Everything ``run_decode`` launches with: inputs (referenced, not copied), outputs, workspaces."""

    q: torch.Tensor
    cache: PagedCache
    block_table: torch.Tensor
    visible: torch.Tensor
    work: torch.Tensor           # [programs, max items, ITEM_FIELDS] int32 (``_work_table``)
    item_counts: torch.Tensor    # [programs] int32
    groups: torch.Tensor         # [groups, 5] int32, the merge kernel's (``_merge_groups``)
    out: torch.Tensor
    lse: torch.Tensor
    part_out: torch.Tensor
    part_lse: torch.Tensor
    qk_scale: float
    nope_scale: float
    out_scale: float
    config: DecodeConfig
    schedule: Schedule
    merge_splits: int            # partials per merge step
    merge_tile: tuple[int, int]  # (rows, columns) per merge program
    early_merge: bool            # the merge kernel runs as a programmatic dependent launch (config asks, Hopper+)
    keep_partials: bool          # the partials are stored to stay in L2 for the merge
    descriptors: tuple | None    # the TMA kernels' descriptors (``_tma_descriptors``), or None
    overlap_launch: bool         # the split kernel is a programmatic dependent of the stream's previous kernel
    cluster: int = 1             # programs per cluster that merge their group's splits (``_cluster_size``), or 1

    @property
    def keys_ahead(self) -> int:
        """Keys of its first item a bf16 split program asks L2 for before the overlap's wait; none without it."""
        return FIRST_KEYS_AHEAD if self.overlap_launch else 0

    @property
    def split_launch(self) -> dict:
        """The split kernel's launch option under the overlap: a programmatic dependent launch."""
        return {"launch_pdl": True} if self.overlap_launch else {}


def plan_decode(q: torch.Tensor, cache: PagedCache, block_table: torch.Tensor, q_lens: Sequence[int],
                kv_lens: Sequence[int], scale: float, visible_lens: torch.Tensor | None = None,
                config: DecodeConfig | None = None) -> DecodePlan:
    """Validate, schedule and allocate for one decode step (see the module docstring)."""
    check_cache("triton_decode", cache, q=q, block_table=block_table, **given(visible_lens=visible_lens))
    q_lens, kv_lens = map(list, check_lengths(q_lens, kv_lens, queries_may_exceed_keys=visible_lens is not None))
    _check_supported(q, cache)
    device = q.device
    _check_batch(q, cache, block_table, q_lens, kv_lens)
    visible = _visible(visible_lens, q_lens, kv_lens, device)
    num_heads = q.shape[1]
    check_softmax_scale(scale)
    scale = float(scale)  # a numpy float32 passed the check, and no kernel launcher takes it
    chosen = config is None
    config = config or batch_config(num_heads, q_lens, kv_lens, cache.layout.name, cache.page_size, device)
    if cache.layout.name in FP4_LAYOUTS and config.block_n < 32:
        raise UnsupportedConfig(f"triton_decode: block_n {config.block_n} with the FP4 layout {cache.layout.name!r}: "
                                f"Triton 3.6 miscompiles its 16-key FP4 decode on Hopper (wrong results on an H200); "
                                f"use block_n >= 32")
    if config.gluon:
        _check_gluon(cache, device, config)
    sms = common.sm_count(device)
    schedule = build_schedule(q_lens, kv_lens, num_heads, config.block_m, config.block_n,
                              sms * config.programs_per_sm, config.min_split, config.num_splits)
    if _gluon_split(config, cache.layout.name) is _decode_split_kernel_wgmma:
        schedule = in_slot_order(schedule)  # a group's splits side by side, for decode_wgmma_ws's clusters
    options = [(config, schedule)]
    narrow = _narrow_alternative(config, num_heads, max(q_lens), cache, device) if chosen else None
    if narrow:
        options.append((narrow, build_schedule(q_lens, kv_lens, num_heads, narrow.block_m, narrow.block_n,
                                               sms * narrow.programs_per_sm, narrow.min_split)))
    # decode_rs_fp8, the kernel of its layouts that merges in clusters, copies by TMA
    clusters_here = cache.layout.name not in RS_LAYOUTS or _tma_pages(cache)
    with common.on_device(device):  # _prepare_clusters compiles the split kernel and asks the driver about it
        for option, balanced in options if clusters_here else ():
            for cut in _cluster_cuts(balanced, q_lens, kv_lens, num_heads, option, cache.layout.name, sms):
                plan = _allocate_plan(cut, q, cache, block_table, visible, q_lens, scale, option, sms)
                _prepare_clusters(plan)
                if plan.cluster > 1:
                    return plan
        plan = _allocate_plan(schedule, q, cache, block_table, visible, q_lens, scale, config, sms)
        _prepare_clusters(plan)
    return plan


def _narrow_alternative(config: DecodeConfig, num_heads: int, max_q_len: int, cache: PagedCache,
                        device: torch.device) -> DecodeConfig | None:
    """decode_wgmma_narrow's tile where the default chose the Triton kernel's for a bf16 cache on Hopper (16 rows in
    whole pages below ``NARROW_MIN_KEYS_PER_SM``): the balanced cut runs faster in the Triton kernel, but a cut into
    clusters (``_cluster_cuts``), which only the narrow kernel runs, can be faster still. None elsewhere."""
    layout = cache.layout.name
    if config.gluon or layout != "bf16" or not common.has_wgmma(device):
        return None
    narrow = _tile_config(num_heads, max_q_len, layout, cache.page_size, NARROW_MIN_KEYS_PER_SM, True, 0.0)
    runs_narrow = _gluon_split(narrow, layout) is _decode_split_kernel_narrow
    return replace(narrow, min_split=config.min_split) if runs_narrow and _clusters_possible(narrow, layout) else None


def _allocate_plan(schedule: Schedule, q: torch.Tensor, cache: PagedCache, block_table: torch.Tensor,
                   visible: torch.Tensor, q_lens: list[int], scale: float, config: DecodeConfig,
                   sms: int) -> DecodePlan:
    """The plan of ``schedule``: its work table, merge groups, outputs and workspaces."""
    device = q.device
    num_tokens, num_heads = q.shape[0], q.shape[1]
    scaled = KERNEL_LAYOUTS[cache.layout.name]
    global_scale = float(torch.tensor(cache_tensor_scale(cache), dtype=torch.float32)) if scaled else 1.0
    rows, cols = merge_tile = _merge_tile(len(schedule.groups), config.block_m, schedule.max_splits, sms)
    first_token = cumulative(q_lens)
    work, item_counts = _work_table(schedule, q_lens, first_token)
    part_out = torch.empty(schedule.num_slots, config.block_m, NOPE.value, dtype=torch.float32, device=device)
    part_lse = torch.empty(schedule.num_slots, config.block_m, dtype=torch.float32, device=device)
    return DecodePlan(
        q=q, cache=cache, block_table=block_table, visible=visible, work=work.to(device),
        item_counts=item_counts.to(device), groups=_merge_groups(schedule, q_lens, first_token).to(device),
        out=torch.empty(num_tokens, num_heads, NOPE.value, dtype=q.dtype, device=device),
        lse=torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device),
        part_out=part_out, part_lse=part_lse,
        qk_scale=scale * LOG2E * (global_scale if scaled == "all" else 1.0), nope_scale=global_scale,
        out_scale=global_scale, config=config, schedule=schedule,
        merge_splits=_merge_splits(schedule.max_splits, rows * cols, config.merge_splits), merge_tile=merge_tile,
        early_merge=config.early_merge and bool(schedule.groups) and _has_dependent_launch(device),
        keep_partials=(config.keep_partials if config.keep_partials is not None
                       else _partials_fit_l2(part_out.nbytes + part_lse.nbytes, device)),
        descriptors=_tma_descriptors(q, cache, config),
        overlap_launch=config.overlap_launch and _has_dependent_launch(device),
        cluster=_cluster_size(schedule, config, cache.layout.name) if device.type == "cuda" else 1)


def run_decode(plan: DecodePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the split kernel (and the merge where a group has several splits, unless they merge in clusters);
    returns ``(out, lse)``."""
    with common.on_device(plan.q.device):
        if plan.work.shape[0]:
            _launch_split(plan)
        if plan.groups.shape[0] and plan.cluster == 1:
            _launch_merge(plan)
    return plan.out, plan.lse


def _launch_split(plan: DecodePlan, warmup: bool = False):
    """Launch (or with ``warmup`` only compile, returning the compiled kernel) the plan's split kernel; the one place
    that picks it: decode_rs_fp8 or decode_wgmma_ws where the plan has their TMA descriptors (``_tma_descriptors``),
    else the Gluon kernel of the config's tile and layout (``GLUON_SPLITS``), else the Triton kernel."""
    kernel = _gluon_split(plan.config, plan.cache.layout.name) if plan.config.gluon else None
    if plan.descriptors:
        return (_launch_rs_fp8 if plan.cache.layout.name in RS_LAYOUTS else _launch_wgmma_ws)(plan, warmup)
    if kernel is _decode_split_kernel_wgmma:
        return _launch_wgmma(plan, warmup)
    if kernel is not None:
        return _launch_gluon_split(plan, kernel, warmup)
    return _launch_triton_split(plan, warmup)


def _launch_merge(plan: DecodePlan) -> None:
    """Launch the merge kernel: each group's partials into its output rows."""
    cfg = plan.config
    rows, cols = plan.merge_tile
    grid = (plan.groups.shape[0], cfg.block_m // rows, NOPE.value // cols)
    _merge_splits_kernel[grid](
        plan.groups, plan.part_out, plan.part_lse, plan.out, plan.out.stride(0), plan.out.stride(1), plan.lse,
        plan.lse.stride(0), plan.out_scale, plan.q.shape[1],
        BLOCK_M=cfg.block_m, ROWS=rows, COLS=cols, SPLITS=plan.merge_splits, INTERPRET=INTERPRETED,
        EARLY_MERGE=plan.early_merge, KEEP_PARTIALS=plan.keep_partials,
        RELEASE_NEXT=plan.overlap_launch, num_warps=4,
        **({"launch_pdl": True} if plan.early_merge else {}))


def _launch_triton_split(plan: DecodePlan, warmup: bool = False):
    """Launch (or with ``warmup`` only compile, returning the compiled kernel) the Triton split kernel
    (decode_kernel), which runs every layout on any GPU and in the interpreter."""
    cfg, cache = plan.config, plan.cache
    args = (plan.q, plan.q.stride(0), plan.q.stride(1), cache.data, plan.block_table, plan.block_table.stride(0),
            plan.visible, plan.work, plan.work.stride(0), plan.item_counts, plan.out, plan.out.stride(0),
            plan.out.stride(1), plan.lse, plan.lse.stride(0), plan.part_out, plan.part_lse, plan.qk_scale,
            plan.nope_scale, plan.out_scale, plan.q.shape[1])
    kwargs = dict(LAYOUT=cache.layout.name, BYTES_PER_TOKEN=cache.layout.bytes_per_token, PAGE_SIZE=cache.page_size,
                  TILE_SCALES=cache.layout.name.startswith("fp8_ds_mla"),
                  REREAD=cfg.reread_values and cache.layout.name != "bf16",
                  SCALE_NOPE=KERNEL_LAYOUTS[cache.layout.name] == "nope",
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEADS_AS_N=cfg.heads_as_n, INTERPRET=INTERPRETED,
                  EARLY_MERGE=plan.early_merge, KEEP_PARTIALS=plan.keep_partials, WAIT_PRIOR=plan.overlap_launch,
                  KEYS_AHEAD=plan.keys_ahead, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **plan.split_launch)
    return _launch_programs(_decode_split_kernel, plan, args, kwargs, warmup)


def _launch_wgmma(plan: DecodePlan, warmup: bool = False):
    """Launch (or with ``warmup`` only compile, returning the compiled kernel) decode_wgmma: 64 rows of bf16 copied
    key by key, where the plan has no TMA descriptors for decode_wgmma_ws."""
    cfg = plan.config
    args = (plan.q, plan.q.stride(0), plan.q.stride(1), plan.cache.data.view(torch.bfloat16), plan.block_table,
            plan.block_table.stride(0), plan.visible, plan.work, plan.work.stride(0), plan.item_counts, plan.out,
            plan.out.stride(0), plan.out.stride(1), plan.lse, plan.lse.stride(0), plan.part_out, plan.part_lse,
            plan.qk_scale, plan.q.shape[1])
    kwargs = dict(PAGE_SIZE=plan.cache.page_size, KEEP_PARTIALS=plan.keep_partials, WAIT_PRIOR=plan.overlap_launch,
                  KEYS_AHEAD=plan.keys_ahead, num_warps=cfg.num_warps, **plan.split_launch)
    return _launch_programs(_decode_split_kernel_wgmma, plan, args, kwargs, warmup)


def _launch_rs_fp8(plan: DecodePlan, warmup: bool = False):
    """Launch (or with ``warmup`` only compile, returning the compiled kernel) decode_rs_fp8, in clusters under
    ``plan.cluster`` (``_prepare_clusters``)."""
    cache = plan.cache
    args = (plan.q, plan.q.stride(0), plan.q.stride(1), *plan.descriptors, plan.block_table, plan.block_table.stride(0),
            plan.visible, plan.work, plan.work.stride(0), plan.item_counts, plan.out, plan.out.stride(0),
            plan.out.stride(1), plan.lse, plan.lse.stride(0), plan.part_out, plan.part_lse, plan.qk_scale,
            plan.q.shape[1], plan.nope_scale, plan.out_scale)
    kwargs = dict(PAGE_SIZE=cache.page_size, KEEP_PARTIALS=plan.keep_partials, EARLY_MERGE=plan.early_merge,
                  LAYOUT="fp8_ds_mla" if cache.layout.name in FP8_DS_MLA else cache.layout.name,
                  WAIT_PRIOR=plan.overlap_launch, CLUSTER=plan.cluster, **decode_rs_fp8.LAUNCH_OPTIONS,
                  **plan.split_launch)
    return _launch_programs(_decode_split_kernel_rs_fp8, plan, args, kwargs, warmup)


def _launch_wgmma_ws(plan: DecodePlan, warmup: bool = False):
    """Launch (or with ``warmup`` only compile, returning the compiled kernel) decode_wgmma_ws, in clusters under
    ``plan.cluster`` (``_prepare_clusters``)."""
    cache = plan.cache
    args = (cache.data, *plan.descriptors, plan.block_table, plan.block_table.stride(0), plan.visible, plan.work,
            plan.work.stride(0), plan.item_counts, plan.out, plan.out.stride(0), plan.out.stride(1), plan.lse,
            plan.lse.stride(0), plan.part_out, plan.part_lse, plan.qk_scale, plan.q.shape[1])
    kwargs = dict(PAGE_SIZE=cache.page_size, KEEP_PARTIALS=plan.keep_partials, WAIT_PRIOR=plan.overlap_launch,
                  KEYS_AHEAD=plan.keys_ahead, CLUSTER=plan.cluster, **decode_wgmma_ws.LAUNCH_OPTIONS,
                  **plan.split_launch)
    return _launch_programs(_decode_split_kernel_wgmma_ws, plan, args, kwargs, warmup)


def _launch_gluon_split(plan: DecodePlan, kernel, warmup: bool = False):
    """Launch (or with ``warmup`` only compile, returning the compiled kernel) one of the Gluon split kernels that take
    the same arguments: all but decode_wgmma, decode_wgmma_ws and decode_rs_fp8. Under ``plan.cluster`` the grid is
    in clusters (``_prepare_clusters``)."""
    cfg, cache = plan.config, plan.cache
    # Arguments only some kernels take: decode_mma_fp8's rows are fixed (16); decode_ws and
    # decode_wgmma_quantized decode more than one layout, some with layer scales.
    specific = {} if kernel is _decode_split_kernel_mma_fp8 else {"ROWS": cfg.block_m}
    if kernel is _decode_split_kernel_narrow:
        specific.update(KEYS_AHEAD=plan.keys_ahead, CLUSTER=plan.cluster)
    if kernel is _decode_split_kernel_ws or kernel is _decode_split_kernel_quantized:
        specific.update(nope_scale=plan.nope_scale, out_scale=plan.out_scale, LAYOUT=cache.layout.name)
    options = GLUON_LAUNCH_OPTIONS.get(kernel, {"num_warps": cfg.num_warps})
    args = (plan.q, plan.q.stride(0), plan.q.stride(1), cache.data, plan.block_table, plan.block_table.stride(0),
            plan.visible, plan.work, plan.work.stride(0), plan.item_counts, plan.out, plan.out.stride(0),
            plan.out.stride(1), plan.lse, plan.lse.stride(0), plan.part_out, plan.part_lse, plan.qk_scale,
            plan.q.shape[1])
    kwargs = dict(PAGE_SIZE=cache.page_size, KEEP_PARTIALS=plan.keep_partials, EARLY_MERGE=plan.early_merge,
                  WAIT_PRIOR=plan.overlap_launch, **specific, **options, **plan.split_launch)
    return _launch_programs(kernel, plan, args, kwargs, warmup)


def _launch_programs(kernel, plan: DecodePlan, args: tuple, kwargs: dict, warmup: bool):
    """Launch ``kernel`` over the plan's programs, ``plan.cluster`` to a cluster (``_prepare_clusters``), or with
    ``warmup`` only compile it, returning the compiled kernel."""
    grid = (plan.work.shape[0] // plan.cluster,)
    if warmup:
        return kernel.warmup(*args, grid=grid, **kwargs)
    kernel[grid](*args, **kwargs)


def _cluster_cuts(schedule: Schedule, q_lens: list[int], kv_lens: list[int], num_heads: int, config: DecodeConfig,
                  layout: str, sms: int) -> Iterator[Schedule]:
    """Cuts of every group into ``k`` equal splits, one program each, to run in clusters (``_cluster_size``), where
    that beats the balanced ``schedule``; largest ``k`` first (``plan_decode`` takes the first whose clusters the
    GPU holds). A ``k`` of ``CLUSTER_SIZES`` qualifies where it gives at most one program a slot and at least
    ``CLUSTER_CUT_MIN_PROGRAMS_PER_SM`` per multiprocessor (by the layout: only those measured), in splits of at
    most ``CLUSTER_CUT_MAX_KEYS`` (by the row block). None where a request has several row blocks, where the longest
    request is over ``CLUSTER_CUT_MAX_IMBALANCE`` times the mean, or where the balanced cut cuts groups but runs one
    item a program (it straddles nothing, and ``_cluster_size`` clusters it as it is where it can); a balanced cut of
    whole groups (short requests, too few of them to fill the GPU) qualifies."""
    straddles_or_whole = not schedule.one_item_per_program or not schedule.groups
    even = max(kv_lens) <= CLUSTER_CUT_MAX_IMBALANCE * sum(kv_lens) / len(kv_lens)
    groups = sum(-(-q * num_heads // config.block_m) for q in q_lens)
    measured = (_clusters_possible(config, layout) and layout in CLUSTER_CUT_MIN_PROGRAMS_PER_SM
                and config.block_m in CLUSTER_CUT_MAX_KEYS)
    if not (measured and config.num_splits is None and straddles_or_whole and even and groups == len(q_lens)):
        return
    for k in sorted(CLUSTER_SIZES, reverse=True):
        programs = groups * k
        split = -(-max(kv_lens) // (k * config.block_n)) * config.block_n
        fits = CLUSTER_CUT_MIN_PROGRAMS_PER_SM[layout] * sms <= programs <= sms * config.programs_per_sm
        if fits and split <= CLUSTER_CUT_MAX_KEYS[config.block_m]:
            cut = build_schedule(q_lens, kv_lens, num_heads, config.block_m, config.block_n,
                                 sms * config.programs_per_sm, config.min_split, num_splits=k)
            if _cluster_size(cut, config, layout) == k:
                yield cut


def _clusters_possible(config: DecodeConfig, layout: str) -> bool:
    """The config asks for cluster merges and runs a kernel that can merge in clusters: decode_wgmma_narrow,
    decode_rs_fp8 (decode_ws's tile of its layouts) or decode_wgmma_ws (64 rows of bf16), the last two where the plan
    has their TMA descriptors (``_prepare_clusters``)."""
    kernel = _gluon_split(config, layout)
    rs_fp8 = kernel is _decode_split_kernel_ws and layout in RS_LAYOUTS and config.tma_loader
    wgmma_ws = kernel is _decode_split_kernel_wgmma and config.tma_loader
    return config.cluster_merge and config.gluon and (kernel is _decode_split_kernel_narrow or rs_fp8 or wgmma_ws)


def _gluon_split(config: DecodeConfig, layout: str):
    """The Gluon split kernel of the config's tile and the layout (``GLUON_SPLITS``), or None."""
    return GLUON_SPLITS.get(((config.block_m, config.block_n, config.num_warps), layout))


def _cluster_size(schedule: Schedule, config: DecodeConfig, layout: str) -> int:
    """Programs per cluster where the split kernel can merge each group's splits inside a cluster: the splits per
    group (``CLUSTER_SIZES``) where every group has as many, every program runs one item and the slots run program
    by program (a group's splits are neighbouring programs in split order); else 1 (the merge kernel)."""
    if not _clusters_possible(config, layout):
        return 1
    counts = {count for *_, count in schedule.groups}
    if len(counts) != 1 or counts.pop() not in CLUSTER_SIZES:
        return 1
    in_order = all(item[4] == program for program, item in enumerate(schedule.items))
    return schedule.groups[0][3] if schedule.one_item_per_program and in_order else 1


def _prepare_clusters(plan: DecodePlan) -> None:
    """Compile the split kernel for ``plan.cluster`` and mark the compiled kernel for cluster launches: Triton's
    launcher launches ``num_ctas`` times the grid in clusters of ``num_ctas``, which a kernel compiled for one CTA
    does not otherwise ask for (its ``CLUSTER`` specialization is only ever launched so). A cluster launch asks for
    more than half a multiprocessor's shared memory (``_one_program_per_sm``): the schedule gives each program a
    multiprocessor, and a kernel small enough for two (decode_rs_fp8 of fp8_e4m3) was otherwise placed two to a
    multiprocessor where the clusters did not fit one to each (H100, 16 heads b32 ctx4096 fp8_e4m3 in clusters of 4:
    62.6 us against 40.0 through the merge kernel). Where the GPU cannot hold all the clusters at once so (a second
    wave would double the time; an H100 holds 66 of 2 but 30 of 4), or where the compiled kernel's launch tuple is
    not the ``(num_warps, num_ctas, shared)`` this was written for (another Triton), ``plan.cluster`` falls back to
    1: the merge kernel. Nothing to do where it is 1."""
    if plan.cluster == 1:
        return
    kernel = _gluon_split(plan.config, plan.cache.layout.name)
    if kernel is not _decode_split_kernel_narrow and not plan.descriptors:  # decode_ws or decode_wgmma: no clusters
        plan.cluster = 1
        return
    compiled = _launch_split(plan, warmup=True)
    meta = compiled.metadata
    shared = _one_program_per_sm(meta.shared, plan.q.device)
    as_compiled, clustered = (meta.num_warps, meta.num_ctas, meta.shared), (meta.num_warps, plan.cluster, shared)
    if (compiled.packed_metadata not in (as_compiled, clustered)
            or _clusters_resident(compiled, plan.cluster, shared) * plan.cluster < plan.work.shape[0]):
        plan.cluster = 1
        return
    compiled.packed_metadata = clustered


def _one_program_per_sm(shared: int, device: torch.device) -> int:
    """Shared memory bytes for a launch of a kernel that uses ``shared``, enough that no two of its programs fit one
    multiprocessor (more than half of it)."""
    return max(shared, torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor // 2 + 1)


def _clusters_resident(compiled, size: int, shared: int) -> int:
    """How many clusters of ``size`` programs of the compiled kernel, launched with ``shared`` bytes of shared
    memory, the GPU runs at once (the driver's occupancy query, through Triton's utilities; it also sets the
    kernel's dynamic shared memory limit to ``shared``, which the launch then asks for)."""
    compiled._init_handles()
    return triton.runtime.driver.active.utils.cuOccupancyMaxActiveClusters(compiled.function, shared, size)


def poison_decode(plan: DecodePlan) -> None:
    """NaN-fill the outputs and workspaces, so that an element no kernel wrote shows."""
    for buffer in (plan.out, plan.lse, plan.part_out, plan.part_lse):
        buffer.fill_(float("nan"))


def mla_decode(q: torch.Tensor, cache: PagedCache, block_table: torch.Tensor, q_lens: Sequence[int],
               kv_lens: Sequence[int], scale: float, visible_lens: torch.Tensor | None = None,
               config: DecodeConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One-shot decode attention: ``(out [T, H, 512], lse [T, H])``, natural-log lse, -inf for empty rows."""
    return run_decode(plan_decode(q, cache, block_table, q_lens, kv_lens, scale, visible_lens, config))


class TritonDecode(Impl):
    name = "triton_decode"
    description = "Triton split-KV paged MLA decode, keys decoded from the cache layout in registers"
    capabilities = Capabilities(
        modes=frozenset({Mode.DECODE}),
        layouts=frozenset(KERNEL_LAYOUTS),
        dtypes=frozenset({"bfloat16"}),
        devices=frozenset({"cpu", "cuda"}),
    )
    config: DecodeConfig | None = None  # None: default_config per workload

    def refusal(self, problem: Problem) -> str | None:
        reason = super().refusal(problem)
        if reason is None and problem.device.type == "cpu" and not INTERPRETED:
            reason = "device cpu without TRITON_INTERPRET"
        return reason or common.stale_kernels()

    def plan(self, problem: Problem) -> DecodePlan:
        meta = problem.meta
        return plan_decode(problem.q, problem.cache, meta.block_table, meta.q_lens, meta.kv_lens, problem.scale,
                           config=self.config)

    def run(self, plan: DecodePlan) -> tuple[torch.Tensor, torch.Tensor]:
        return run_decode(plan)

    def poison(self, plan: DecodePlan) -> None:
        poison_decode(plan)


# ---- validation and helpers ------------------------------------------------------------------------------------

def _check_supported(q: torch.Tensor, cache: PagedCache) -> None:
    """What the kernel cannot do at all: UnsupportedConfig."""
    if cache.layout.name not in KERNEL_LAYOUTS:
        raise UnsupportedConfig(f"triton_decode: cache layout {cache.layout.name!r} (supported: "
                                f"{', '.join(KERNEL_LAYOUTS)})")
    if q.dim() != 3 or q.shape[2] != LATENT_DIM:
        raise UnsupportedConfig(f"triton_decode: queries must be [T, H, {LATENT_DIM}] (512 latent + 64 rope), "
                                f"got {list(q.shape)}")
    if q.dtype not in QUERY_DTYPES:
        raise UnsupportedConfig(f"triton_decode: query dtype {q.dtype} (supported: bfloat16)")
    if q.device.type == "cpu" and not INTERPRETED:
        raise UnsupportedConfig("triton_decode: CPU tensors need TRITON_INTERPRET=1")
    common.check_e4m3(q.device, cache.layout.name, "triton_decode")


def _check_batch(q: torch.Tensor, cache: PagedCache, block_table: torch.Tensor, q_lens: list[int],
                 kv_lens: list[int]) -> None:
    """Shapes, devices and the block table's contents: ValueError naming the problem."""
    if not q_lens:
        raise ValueError("q_lens and kv_lens must name at least one request")
    if sum(q_lens) != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens but sum(q_lens) = {sum(q_lens)}")
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous in its last dimension")
    if q.shape[1] < 1:
        raise ValueError("q must have at least one head")
    if not cache.data.is_contiguous():
        raise ValueError("the cache's data must be contiguous [num_blocks, page_size, bytes_per_token]")
    common.check_placed(q.device, "q", cache=cache.data, block_table=block_table)
    check_block_table(block_table, kv_lens, cache.page_size, cache.num_blocks)
    if block_table.stride(1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")


def _visible(visible_lens: torch.Tensor | None, q_lens: list[int], kv_lens: list[int],
             device: torch.device) -> torch.Tensor:
    """Per query token, how many leading keys of its request it sees (validated when given). Without
    ``visible_lens`` a request's new tokens are its last ``q_len`` keys (``plan_decode`` refuses a query longer than
    its context then; a request of no context is padding and may carry queries: they see nothing)."""
    limits = [n for q, n in zip(q_lens, kv_lens) for _ in range(q)]
    if visible_lens is None:
        causal = [max(n - q + i + 1, 0) if n else 0 for q, n in zip(q_lens, kv_lens) for i in range(q)]
        return torch.tensor(causal, dtype=torch.int32, device=device)
    if visible_lens.dtype != torch.int32 or visible_lens.shape != (len(limits),) or visible_lens.device != device \
            or not visible_lens.is_contiguous():  # the kernel reads it as contiguous memory
        raise ValueError(f"visible_lens must be a contiguous int32 [{len(limits)}] on {device}, got "
                         f"{visible_lens.dtype} {list(visible_lens.shape)} with strides {visible_lens.stride()} on "
                         f"{visible_lens.device}")
    bounds = torch.tensor(limits, dtype=torch.int32, device=device)
    bad = (visible_lens < 0) | (visible_lens > bounds)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(f"visible_lens[{t}] = {int(visible_lens[t])} is outside [0, kv_len = {limits[t]}]")
    return visible_lens


def _work_table(schedule: Schedule, q_lens: list[int],
                first_token: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule as the split kernel reads it: ``[programs, max items, ITEM_FIELDS]`` int32, program p's items
    in rows ``[p, 0 .. count)``, columns ``ITEM_COLUMNS``; and the item count of each program. Each item carries
    its request's first token and token count, so the kernel reads nothing else before its queries and
    block-table row."""
    programs = schedule.num_programs
    counts = [schedule.program_items[p + 1] - schedule.program_items[p] for p in range(programs)]
    width = max(counts, default=1)
    table = [[0] * ITEM_FIELDS.value for _ in range(programs * width)]
    for p in range(programs):
        for j, item in enumerate(schedule.items[schedule.program_items[p]:schedule.program_items[p + 1]]):
            request = item[0]
            row = (*item, first_token[request], q_lens[request])
            table[p * width + j][:len(row)] = row
    return (torch.tensor(table, dtype=torch.int32).reshape(programs, width, ITEM_FIELDS.value),
            torch.tensor(counts, dtype=torch.int32))


def _merge_groups(schedule: Schedule, q_lens: list[int], first_token: list[int]) -> torch.Tensor:
    """The merge kernel's rows: row block, first slot, slots, the request's first token and token count."""
    rows = [(row_block, first, count, first_token[request], q_lens[request])
            for request, row_block, first, count in schedule.groups]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), 5)


def _merge_splits(max_splits: int, tile_elements: int, cap: int | None) -> int:
    """Partials per merge step: all of a group's at once where ``[splits, rows, columns]`` float32 holds at most
    ``MERGE_VALUES``, else as many as that allows; at most ``cap``."""
    fits = max(1, MERGE_VALUES // tile_elements)
    wanted = 1 << (max(1, max_splits) - 1).bit_length()
    splits = min(wanted, 1 << (fits.bit_length() - 1))
    return min(splits, cap) if cap else splits


def _merge_tile(groups: int, block_m: int, max_splits: int, sms: int) -> tuple[int, int]:
    """Rows and columns per merge kernel program: 16 x 64, narrowed until the merge has two programs per SM (a
    batch of one request with many splits would otherwise merge on a handful of SMs): columns first, down to 8,
    then rows while a program would still read its ``max_splits`` partials in more than one step of
    ``MERGE_VALUES`` (each step a dependent L2 round trip; H200, 16 heads, 64 splits: b1 14.3 -> 12.8 us, b2
    17.7 -> 16.4; 128 heads, which have their two programs per SM already, were slower with narrower rows: NOTES.md,
    round 10)."""
    rows, cols = min(16, block_m), 64

    def programs() -> int:
        return groups * (block_m // rows) * (NOPE.value // cols)

    while cols > 8 and programs() < 2 * sms:
        cols //= 2
    while rows > 1 and programs() < 2 * sms and max_splits * rows * cols > MERGE_VALUES:
        rows //= 2
    return rows, cols


def _check_gluon(cache: PagedCache, device: torch.device, config: DecodeConfig) -> None:
    """What a Gluon split kernel needs beyond its tile (``DecodeConfig`` checks that): UnsupportedConfig."""
    tile = (config.block_m, config.block_n, config.num_warps)
    layouts = [layout for (tile_of, layout) in GLUON_SPLITS if tile_of == tile]
    if cache.layout.name not in layouts:
        raise UnsupportedConfig(f"triton_decode: the Gluon kernels of tile {tile} read {', '.join(layouts)} "
                                f"caches, not {cache.layout.name!r}")
    if not common.has_wgmma(device):
        raise UnsupportedConfig(f"triton_decode: the Gluon kernels need a Hopper GPU (compute capability 9), "
                                f"not {device}")


def _tma_descriptors(q: torch.Tensor, cache: PagedCache, config: DecodeConfig) -> tuple | None:
    """The TMA descriptors of the kernels that copy by TMA, where ``tma_loader`` is on and the cache is contiguous from
    a 16-byte boundary (its rows are TMA rows): ``decode_wgmma_ws``'s of the query and the cache (``[rows, 576]`` bf16
    in ``[64, 64]`` boxes) for 64 rows of bf16 in Gluon with a query contiguous alike (any page size: its loader gathers
    pages under a tile, the cache's descriptor unused then); in pages of whole 64-key tiles, ``decode_rs_fp8``'s of the
    cache's codes, rope and scales for decode_ws's tile of fp8_ds_mla (per-key tile scales), of nvfp4 (a 128-byte
    chunk's 16 block scales a key), of mxfp4_nsa (a key's 16 ue8m0 block exponents) and of fp8_e4m3 (e4m3 rope, no
    scales: None). Else None (``decode_wgmma`` copies key by key, ``decode_ws`` decodes through registers)."""
    tile = decode_wgmma_ws.KEYS.value  # keys (and query rows) per box; 64 columns: the 128-byte swizzle
    wgmma_bf16 = config.gluon and cache.layout.name == "bf16" and (config.block_m, config.block_n) == (64, tile)
    rs = (config.gluon and cache.layout.name in RS_LAYOUTS
          and (config.block_m, config.block_n, config.num_warps) == (16, tile, decode_ws.WARPS))
    if not (config.tma_loader and _tma_rows(cache.data)):
        return None
    if wgmma_bf16 and _tma_rows(q):
        rows = (q.reshape(-1, LATENT_DIM), cache.data.view(torch.bfloat16).reshape(-1, LATENT_DIM))
        return tuple(TensorDescriptor.from_tensor(t, [tile, 64], SWIZZLED.value) for t in rows)
    if not (rs and _tma_pages(cache)):
        return None
    slots = cache.data.reshape(-1, cache.layout.bytes_per_token)
    codes = TensorDescriptor.from_tensor(slots.view(torch.float8_e4m3fn), [tile, TILE.value],
                                         decode_rs_fp8.CODES_SMEM.value)
    if cache.layout.name == "fp8_e4m3":
        return codes, TensorDescriptor.from_tensor(slots.view(torch.float8_e4m3fn), [tile, ROPE.value],
                                                   decode_rs_fp8.ROPE_E4M3_SMEM.value), None
    rope = TensorDescriptor.from_tensor(slots.view(torch.bfloat16), [tile, ROPE.value], SWIZZLED.value)
    if cache.layout.name in ("nvfp4", "mxfp4_nsa"):  # a chunk's 16 e4m3 block scales; all 16 ue8m0 exponents
        return codes, rope, TensorDescriptor.from_tensor(slots.view(torch.float8_e4m3fn),
                                                         [tile, decode_rs_fp8.BLOCKS.value],
                                                         decode_rs_fp8.BLOCKS_SMEM.value)
    return codes, rope, TensorDescriptor.from_tensor(slots.view(torch.float32), [tile, 4],
                                                     decode_rs_fp8.SCALES_SMEM.value)


def _tma_pages(cache: PagedCache) -> bool:
    """The cache's pages hold whole 64-key tiles and its rows are TMA rows: the TMA kernels can copy it."""
    return _whole_tiles(cache.page_size) and _tma_rows(cache.data)


def _whole_tiles(page_size: int) -> bool:
    """Pages of ``page_size`` keys hold whole 64-key tiles, the steps the TMA kernels copy."""
    return page_size % decode_wgmma_ws.KEYS.value == 0


def _tma_rows(t: torch.Tensor) -> bool:
    """Whether ``t``'s rows can be TMA rows: contiguous from a 16-byte boundary."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def _has_dependent_launch(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): CUDA devices of compute capability 9.0 (Hopper) and newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _partials_fit_l2(workspace_bytes: int, device: torch.device) -> bool:
    """Whether the split partials (``workspace_bytes``) are few enough to keep in the device's L2 for the merge: at
    most ``PARTIALS_L2_SHARE`` of it."""
    return (device.type == "cuda" and 0 < workspace_bytes
            <= PARTIALS_L2_SHARE * torch.cuda.get_device_properties(device).L2_cache_size)


def _dram_gbps(device: torch.device) -> float:
    """Peak DRAM bandwidth in GB/s as Triton reads it from the driver (memory clock and bus width; an index of None
    is the current device); 0 off CUDA."""
    if device.type != "cuda":
        return 0.0
    return triton.testing.get_dram_gbps(device.index)
