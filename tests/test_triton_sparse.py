"""Sparse top-k (DeepSeek V3.2) Triton impls against the float64 reference, PAGED and RAGGED.

Invalid indices (FlashMLA's list: -2^31, -123456, -1, the source's row count, 2^31-1) are skipped; a row
with none valid gives out 0 / lse -inf, as does every row of a top-k of 0 (with no kernel launched); float16 queries
run through both impls; the wrong index transform is refused at plan time; index lists cut in pieces merged by LSE
(split-KV) pass, pieces past a list's end included. Planted bugs: -1 read as index 0, a RAGGED buffer dequantized to
bf16 (rounding FP8 keys), pieces averaged and a piece dropped from the merge, must fail the judge. On a Hopper GPU
(``pytest -m gpu``) the Gluon kernel of the fp8_ds_mla layouts is judged the same way, with a planted bug of its own.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import impls.triton  # noqa: F401
from impls.triton import cache_ops, common, sparse_kernel
from impls.triton.common import check_e4m3
from impls.triton.latent_io import LAYOUT_CODES, gather_latent
from impls.triton.merge import LOG2E
from impls.triton.sparse import TritonSparse, TritonSparseRagged
from impls.triton.sparse_kernel import (INTERPRETER_CONFIG, MIN_SPLIT_INDICES, WGMMA_CONFIG, SparseConfig,
                                        check_wgmma, default_config, index_splits, sparse_mqa, split_workspace)
from magnify import magnified
from mla_bench.errors import UnsupportedConfig
from mla_bench.problem import build_problem
from mla_bench.workload import Workload
from suites.judge import judge

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU, compiled kernels on a GPU

IMPLS = {"paged": TritonSparse, "ragged": TritonSparseRagged}
INVALID = [-2**31, -123456, -1, "rows", 2**31 - 1]


def sparse(transform, mode="sparse_decode", layout="bf16", q_lens=(1, 1, 1), kv_lens=(70, 33, 5), topk=32, **kw):
    if mode == "sparse_prefill" and q_lens == (1, 1, 1):
        q_lens = (4, 3, 1)
    return Workload(mode=mode, q_lens=q_lens, kv_lens=kv_lens, page_size=16, layout=layout, topk=topk,
                    index_transform=transform, **kw)


@pytest.mark.parametrize("transform", ["paged", "ragged"])
@pytest.mark.parametrize("mode", ["sparse_decode", "sparse_prefill"])
@pytest.mark.parametrize("layout", ["bf16", "fp8_ds_mla"])
def test_sparse_impls_pass_the_judge(transform, mode, layout):
    verdict = judge(IMPLS[transform](), build_problem(sparse(transform, mode, layout), DEVICE))
    assert verdict.status == "passed", verdict.violations or verdict.message


FLOAT16_CASES = [(transform, mode, layout) for transform in ("paged", "ragged")
                 for mode in ("sparse_decode", "sparse_prefill") for layout in ("bf16", "fp8_ds_mla")]
FLOAT16_CASES += [("paged", "sparse_prefill", "fp8_ds_mla_pow2"), ("ragged", "sparse_decode", "fp8_e4m3")]


@pytest.mark.parametrize("transform, mode, layout", FLOAT16_CASES)
def test_float16_queries_are_declared_and_pass_the_judge(transform, mode, layout):
    """The kernel takes float16 queries and writes float16 outputs (keys in the queries' dtype, float32 scores), yet
    the impls declared only bfloat16: every float16 problem was refused before plan."""
    problem = build_problem(sparse(transform, mode, layout, dtype="float16", seed=11), DEVICE)
    verdict = judge(IMPLS[transform](), problem)
    assert verdict.status == "passed", verdict.violations or verdict.message


def test_float16_queries_are_refused_by_name_by_the_gluon_kernel():
    """The Gluon kernel stages bf16 queries only (its default is bf16 only, so float16 runs the Triton kernel):
    asked for explicitly, a float16 problem is refused at plan time, naming the queries' dtype."""
    problem = build_problem(sparse("paged", layout="fp8_ds_mla", dtype="float16", num_heads=64), DEVICE)
    with pytest.raises(UnsupportedConfig, match="sparse wgmma kernel takes bf16 queries, not torch.float16"):
        TritonSparse(WGMMA_CONFIG).plan(problem)


@pytest.mark.parametrize("transform, layout", [("paged", "fp8_ds_mla_pow2"), ("ragged", "fp8_e4m3")])
def test_sparse_reads_the_other_fp8_layouts(transform, layout):
    verdict = judge(IMPLS[transform](), build_problem(sparse(transform, layout=layout, seed=3), DEVICE))
    assert verdict.status == "passed", verdict.violations or verdict.message


@pytest.mark.parametrize("layout", ["bf16", "fp8_ds_mla_pow2"])
def test_prefetching_the_next_steps_rows_changes_no_result(layout):
    """The prefetching kernel compiles (its inline assembly, on a GPU) and gives the reference's answer, with the
    next step's indices past top-k at the last step and -1 padding among them. A prefetch only hints: which lines
    it asks for shows in time, not in results, so this cannot catch a prefetch of the wrong rows."""
    impl = TritonSparse(SparseConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, prefetch=True))
    verdict = judge(impl, build_problem(sparse("paged", "sparse_prefill", layout, topk=40, seed=6), DEVICE))
    assert verdict.status == "passed", verdict.violations or verdict.message


@pytest.mark.parametrize("transform, layout", [("paged", "bf16"), ("ragged", "fp8_ds_mla")])
def test_top_k_2048(transform, layout):
    w = sparse(transform, layout=layout, q_lens=(1, 1), kv_lens=(2100, 2048), topk=2048, seed=0)
    impl = IMPLS[transform](SparseConfig(block_h=16, block_n=128, num_warps=4, num_stages=1))
    verdict = judge(impl, build_problem(w, DEVICE))
    assert verdict.status == "passed", verdict.violations or verdict.message


@pytest.mark.parametrize("transform", ["paged", "ragged"])
def test_invalid_indices_are_skipped_and_an_all_invalid_row_is_empty(transform):
    problem = build_problem(sparse(transform, "sparse_prefill"), DEVICE)
    rows = problem.cache.num_slots if transform == "paged" else problem.meta.token_slots.shape[0]
    idx, logical = problem.sparse_indices, problem.topk_indices
    for row in range(idx.shape[0] - 1):
        valid = torch.nonzero(logical[row] >= 0).flatten()
        for j, bad in zip(valid[:len(INVALID)], INVALID):
            idx[row, j] = rows if bad == "rows" else bad
            logical[row, j] = -1
    idx[-1] = torch.tensor(INVALID[:2] + [rows, -1] * 15, dtype=torch.int32)  # the last token: nothing valid
    logical[-1] = -1
    impl = IMPLS[transform]()
    verdict = judge(impl, problem)
    assert verdict.status == "passed", verdict.violations or verdict.message
    out, lse = impl.run(impl.plan(problem))
    assert bool((out[-1] == 0).all()) and bool(torch.isneginf(lse[-1]).all())


@pytest.mark.parametrize("transform", ["paged", "ragged"])
def test_top_k_0_gives_the_references_empty_rows(transform):
    """Index lists of width 0 (a workload's top-k is positive; a caller's lists need not be): every row sees no key,
    out 0 and lse -inf, as in the reference."""
    problem = build_problem(sparse(transform, "sparse_prefill", seed=12), DEVICE)
    problem.sparse_indices = problem.sparse_indices[:, :0]
    problem.topk_indices = problem.topk_indices[:, :0]
    impl = IMPLS[transform]()
    verdict = judge(impl, problem)
    assert verdict.status == "passed", verdict.violations or verdict.message
    out, lse = impl.run(impl.plan(problem))
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("config", [INTERPRETER_CONFIG, WGMMA_CONFIG], ids=["triton", "gluon"])
def test_top_k_0_launches_no_kernel(monkeypatch, gluon_stand_in, config):
    """The Gluon kernel (stood in for here: it needs a Hopper GPU) indexes a token's list up to ``topk - 1``, -1 at
    top-k 0, and was launched on empty lists: ``sparse_mqa`` writes their empty rows itself, on either kernel's path,
    and launches neither."""
    monkeypatch.setattr(sparse_kernel, "_sparse_kernel", None)  # launching it fails
    p = build_problem(sparse("paged", layout="fp8_ds_mla", num_heads=64, seed=13), DEVICE)
    tokens, heads = p.q.shape[:2]
    out = torch.full((tokens, heads, 512), float("nan"), dtype=p.q.dtype, device=DEVICE)
    lse = torch.full((tokens, heads), float("nan"), device=DEVICE)
    sparse_mqa(p.q, p.sparse_indices[:, :0], p.cache.rows(), LAYOUT_CODES["fp8_ds_mla"], p.scale, 1.0, out, lse,
               config)
    assert not gluon_stand_in.grids, "the Gluon kernel was launched on empty index lists"
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("impl, other", [(TritonSparse, "ragged"), (TritonSparseRagged, "paged")])
def test_the_other_index_transform_is_refused_at_plan_time(impl, other):
    problem = build_problem(sparse(other), DEVICE)
    verdict = judge(impl(), problem)
    assert verdict.status == "unsupported" and f"index transform {other}" in verdict.message
    with pytest.raises(UnsupportedConfig, match=f"index transform {other}"):
        impl().plan(problem)  # called directly, as a user would


class MinusOneIsIndexZero(TritonSparse):
    """Planted bug: -1 padding read as index 0."""

    def run(self, plan):
        p = plan.problem
        p.sparse_indices = p.sparse_indices.clamp(min=0)
        return super().run(plan)


class RaggedBufferInBf16(TritonSparseRagged):
    """Planted bug (SGLang's fp8 RAGGED path): keys dequantized into a bf16 buffer, rounding every key whose
    tile scale is not a power of two."""

    def run(self, plan):
        p = plan.problem
        keys = gather_latent(p.cache, p.meta.token_slots, torch.empty(len(p.meta.token_slots), 576,
                                                                         dtype=torch.bfloat16, device=p.device))
        return sparse_mqa(p.q, p.sparse_indices, keys.view(torch.uint8), 0, p.scale)


@pytest.mark.parametrize("planted, transform, layout", [(MinusOneIsIndexZero, "paged", "bf16"),
                                                         (RaggedBufferInBf16, "ragged", "fp8_ds_mla")])
def test_planted_sparse_bugs_fail_the_judge(planted, transform, layout):
    verdict = judge(planted(), build_problem(sparse(transform, "sparse_prefill", layout), DEVICE))
    assert verdict.status == "failed", verdict.message


def test_sparse_kernel_refuses_bad_inputs_by_name():
    p = build_problem(sparse("paged"), DEVICE)
    with pytest.raises(ValueError, match="indices"):
        sparse_mqa(p.q, p.sparse_indices.long(), p.cache.rows(), 0, p.scale)
    with pytest.raises(ValueError, match="q must"):
        sparse_mqa(p.q[..., :512], p.sparse_indices, p.cache.rows(), 0, p.scale)
    with pytest.raises(ValueError, match="uint8"):
        sparse_mqa(p.q, p.sparse_indices, p.cache.rows().view(torch.bfloat16), 0, p.scale)
    strided = p.meta.token_slots.repeat_interleave(2)[::2]  # read as contiguous memory: other rows
    with pytest.raises(ValueError, match=r"gather_latent: slots must be contiguous .* strides \(2,\)"):
        gather_latent(p.cache, strided, torch.empty(len(strided), 576, device=DEVICE))


def test_a_bad_scale_is_named_with_the_other_problems():
    """The scale's problem joins the inputs' in one message, instead of raising on its own first."""
    p = build_problem(sparse("paged"), DEVICE)
    with pytest.raises(ValueError, match=r"^sparse_mqa: indices must be int32 .*; softmax scale must be a finite "
                                         r"positive number, got -1.0$"):
        sparse_mqa(p.q, p.sparse_indices.long(), p.cache.rows(), 0, -1.0)


@pytest.mark.parametrize("impl, transform", [(TritonSparse, "paged"), (TritonSparseRagged, "ragged")])
def test_int64_indices_are_refused_by_plan_not_run(impl, transform):
    """torch.topk gives int64: plan took them and run's kernel refused them, an error instead of a named refusal."""
    p = build_problem(sparse(transform), DEVICE)
    p.sparse_indices = p.sparse_indices.long()
    with pytest.raises(ValueError, match=f"{impl.name}: indices must be int32 .* got torch.int64"):
        impl().plan(p)


def _slot_past_the_cache(p):
    p.meta.token_slots = p.meta.token_slots.clone()
    p.meta.token_slots[3] = p.cache.num_slots + 5


@pytest.mark.parametrize("spoil, message", [
    (_slot_past_the_cache, r"token_slots must lie in the cache's \[0, \d+\), got \[\d+, \d+\]"),
    (lambda p: setattr(p.meta, "token_slots", p.meta.token_slots[:-3]),
     r"token_slots must be .* tensor \[108\], got .*\[105\]"),
], ids=["slot past the cache", "slots short"])
def test_the_ragged_plan_refuses_token_slots_its_run_would_gather_wrongly(spoil, message):
    """A slot past the cache planned, then failed in run's gather (IndexError; a device-side assert on a GPU);
    slots short of the keys gathered a short buffer, whose missing rows the kernel skipped: a plausible answer."""
    p = build_problem(sparse("ragged"), DEVICE)
    spoil(p)
    with pytest.raises(ValueError, match=message):
        TritonSparseRagged().plan(p)


@pytest.mark.parametrize("name", ["token_slots", "cache"])
def test_the_ragged_plan_refuses_token_slots_or_a_cache_off_the_problems_device(name):
    """Run gathers the cache's rows by the slots into a buffer on the problem's device: slots elsewhere failed in
    plan's range check (NotImplementedError on meta), a cache elsewhere planned and would fail in run's gather."""
    p = build_problem(sparse("ragged"), DEVICE)
    owner = p.meta if name == "token_slots" else p
    setattr(owner, name, getattr(owner, name).to("meta"))
    with pytest.raises(ValueError, match=f"triton_sparse_ragged: {name} is on meta but the problem is on {DEVICE}"):
        TritonSparseRagged().plan(p)


@pytest.mark.parametrize("tiles", [dict(block_h=24), dict(block_n=48), dict(block_h=0), dict(block_n=8),
                                   dict(num_warps=3)])
def test_tiles_triton_cannot_build_are_refused_by_the_config(tiles):
    """Non-powers of two failed inside Triton at the first launch (block_h 0: ZeroDivisionError); block_n 8 (K of the
    value product, which a 16-bit tl.dot takes from 16) and 3 warps ran in the interpreter and failed to compile for
    sm_90."""
    with pytest.raises(ValueError, match=f"SparseConfig.{next(iter(tiles))} must be a power of two"):
        SparseConfig(**tiles)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.1])
def test_a_scale_the_reference_refuses_is_refused_by_plan(scale):
    """A NaN scale planned and ran into NaN everywhere (an infinite one too; 0 and negative ones into other
    attention), silently: called directly there is no reference to say so."""
    p = build_problem(sparse("paged"), DEVICE)
    p.scale = scale
    with pytest.raises(ValueError, match="softmax scale must be a finite positive number"):
        TritonSparse().plan(p)


@pytest.mark.parametrize("transform", ["paged", "ragged"])
def test_a_numpy_scale_is_taken(transform):
    """The reference takes a numpy float32 scale; run passed it on to the launcher, which failed on it."""
    p = build_problem(sparse(transform), DEVICE)
    p.scale = np.float32(p.scale)
    verdict = judge(IMPLS[transform](), p)
    assert verdict.status == "passed", verdict.violations or verdict.message


@pytest.mark.parametrize("transform", ["paged", "ragged"])
def test_cpu_problems_without_the_interpreter_are_refused(monkeypatch, transform):
    """Without TRITON_INTERPRET (a GPU host's CPU problems) run crashed in Triton's launcher ("0 active drivers");
    the sparse impls refuse it as the decode and prefill do."""
    monkeypatch.setattr(cache_ops, "INTERPRETED", False)  # the kernels compiled, not interpreted
    verdict = judge(IMPLS[transform](), build_problem(sparse(transform), "cpu"))
    assert verdict.status == "unsupported" and "need TRITON_INTERPRET=1" in verdict.message, verdict.message


def test_sparse_mqa_refuses_outputs_and_rows_it_would_read_or_write_wrongly():
    """An out one head short was written past its end; rows of another layout were decoded as that layout's."""
    p = build_problem(sparse("paged"), DEVICE)
    tokens, heads = p.q.shape[:2]
    base = torch.zeros(tokens * heads * 512 + 512, dtype=p.q.dtype, device=DEVICE)
    short = base[:tokens * (heads - 1) * 512].view(tokens, heads - 1, 512)
    with pytest.raises(ValueError, match=rf"out must be \[{tokens}, {heads}, 512\]"):
        sparse_mqa(p.q, p.sparse_indices, p.cache.rows(), 0, p.scale, out=short)
    assert not base.any(), "written before the refusal"
    strided = torch.empty(tokens, heads, 1024, dtype=p.q.dtype, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match=r"out must be .*, got .* strides \(4096, 1024, 2\)"):
        sparse_mqa(p.q, p.sparse_indices, p.cache.rows(), 0, p.scale, out=strided)
    with pytest.raises(ValueError, match=rf"lse must be \[{tokens}, {heads}\]"):
        sparse_mqa(p.q, p.sparse_indices, p.cache.rows(), 0, p.scale, lse=torch.empty(tokens, device=DEVICE))
    with pytest.raises(ValueError, match=r"rows must be a contiguous uint8 \[N, 656\] source of fp8_ds_mla"):
        sparse_mqa(p.q, p.sparse_indices, p.cache.rows(), LAYOUT_CODES["fp8_ds_mla"], p.scale)  # bf16 rows


def test_e4m3_layouts_are_refused_on_gpus_before_compute_capability_8_9(monkeypatch):
    """Triton compiles e4m3 (tl.float8e4nv) for sm_89 and newer: on an A100 (sm_80) the fp8 layouts' kernels failed
    to compile in run (decode's nvfp4 reads e4m3 scales too). The check reads the device's capability, faked here."""
    gpu = torch.device("cuda")
    for capability in ((8, 0), (8, 6)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        for layout in ("fp8_ds_mla", "fp8_e4m3", "fp8_ds_mla_pow2", "nvfp4"):
            with pytest.raises(UnsupportedConfig, match=f"layout '{layout}' is read as e4m3"):
                check_e4m3(gpu, layout, "x")
        for layout in ("bf16", "fp4_mx16", "mxfp4_nsa"):
            check_e4m3(gpu, layout, "x")
    for capability in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        check_e4m3(gpu, "fp8_ds_mla", "x")
    check_e4m3(torch.device("cpu"), "fp8_ds_mla", "x")


class GluonStandIn:
    """``sparse_wgmma``'s kernel where there is no Hopper GPU: records each launch's grid and computes the launch's
    tokens, piece by piece, with the Triton kernel, so that the judge sees which tokens and pieces the launches
    covered. As the kernel does, it reads its tensors through their pointers and the strides passed beside them (a
    piece's out and lse ``s_os`` and ``s_ls`` past the one before), not through the tensors' own shapes and strides."""

    def __init__(self) -> None:
        self.grids = []

    def __getitem__(self, grid):
        def launch(q, s_qt, s_qh, idx, s_it, rows, num_rows, topk, out, s_ot, s_oh, lse, s_lt, s_lh, qk_scale, heads,
                   chunk, s_os, s_ls, PER_KEY, num_warps):
            self.grids.append(grid)
            layout = LAYOUT_CODES["fp8_ds_mla_pow2" if PER_KEY else "fp8_ds_mla"]
            tokens = grid[1]
            queries = q.as_strided((tokens, heads, q.shape[-1]), (s_qt, s_qh, 1))
            lists = idx.as_strided((tokens, topk), (s_it, 1))
            for piece in range(grid[2]):
                piece_out = out.as_strided((tokens, heads, 512), (s_ot, s_oh, 1), out.storage_offset() + piece * s_os)
                piece_lse = lse.as_strided((tokens, heads), (s_lt, s_lh), lse.storage_offset() + piece * s_ls)
                sparse_mqa(queries, lists[:, piece * chunk:piece * chunk + chunk], rows[:num_rows], layout,
                           qk_scale / LOG2E, 1.0, piece_out, piece_lse, replace(INTERPRETER_CONFIG, num_splits=1))
        return launch


@pytest.fixture
def gluon_stand_in(monkeypatch) -> GluonStandIn:
    """A ``GluonStandIn`` in the Gluon kernel's place, on a device said to be a Hopper GPU."""
    stand_in = GluonStandIn()
    monkeypatch.setattr(common, "has_wgmma", lambda device: True)
    monkeypatch.setattr(sparse_kernel, "_sparse_kernel_wgmma", stand_in)
    return stand_in


@pytest.mark.parametrize("sms, pieces", [(4, 1), (132, 2)])
def test_the_gluon_kernel_is_launched_within_cudas_grid_limit(monkeypatch, gluon_stand_in, sms, pieces):
    """Its tokens go on the grid's second dimension, which CUDA caps at 65535: one launch of every token failed on a
    sparse prefill of more tokens. Launches of at most TOKENS_PER_LAUNCH tokens (lowered here) cover them all, whole
    lists or (8 tokens x 2 head blocks on 132 SMs) pieces, each launch writing its tokens' rows of the workspace."""
    limit = 2
    monkeypatch.setattr(sparse_kernel, "TOKENS_PER_LAUNCH", limit, raising=False)
    monkeypatch.setattr(common, "sm_count", lambda device: sms)
    problem = build_problem(sparse("paged", "sparse_prefill", "fp8_ds_mla", num_heads=80, topk=2 * MIN_SPLIT_INDICES,
                                   kv_lens=(300, 200, 40), seed=5), DEVICE)
    verdict = judge(TritonSparse(WGMMA_CONFIG), problem)
    assert verdict.status == "passed", verdict.violations or verdict.message
    grids = gluon_stand_in.grids
    assert grids and max(grid[1] for grid in grids) <= limit, grids
    assert {grid[0] for grid in grids} == {2} and {grid[2] for grid in grids} == {pieces}  # two 64-head blocks


@pytest.mark.parametrize("splits", [2, 3])
def test_the_gluon_kernels_pieces_are_launched_and_merged(gluon_stand_in, splits):
    """Cut lists through the Gluon kernel's launch (stood in for): a grid of ``splits`` pieces, each piece's partial
    in the workspace views passed to it (3: the last past the list's end), merged by LSE."""
    problem = build_problem(sparse("paged", "sparse_decode", "fp8_ds_mla", num_heads=80, topk=128, kv_lens=LISTS,
                                   seed=6), DEVICE)
    verdict = judge(TritonSparse(replace(WGMMA_CONFIG, num_splits=splits)), problem)
    assert verdict.status == "passed", verdict.violations or verdict.message
    assert set(gluon_stand_in.grids) == {(2, 3, splits)}


def test_the_gluon_kernel_cuts_few_tokens_lists_by_default(monkeypatch, gluon_stand_in):
    """Its default config cuts lists too (3 tokens x 2 head blocks on a 132-SM plan: as many 128-index pieces as
    top-k 256 holds), through the plan's workspace."""
    monkeypatch.setattr(common, "sm_count", lambda device: 132)
    problem = build_problem(sparse("paged", "sparse_decode", "fp8_ds_mla", num_heads=80, topk=2 * MIN_SPLIT_INDICES,
                                   kv_lens=(300, 200, 40), seed=7), DEVICE)
    verdict = judge(TritonSparse(WGMMA_CONFIG), problem)
    assert verdict.status == "passed", verdict.violations or verdict.message
    assert set(gluon_stand_in.grids) == {(2, 3, 2)}


# ---- the Gluon kernel (Hopper) ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["fp8_ds_mla", "fp8_ds_mla_pow2"])
def test_the_gluon_kernel_is_the_default_for_64_head_blocks_of_fp8_ds_mla_on_hopper(layout):
    gpu = torch.device("cuda")
    code = LAYOUT_CODES[layout]
    assert default_config(gpu, 128, code, hopper=True) == WGMMA_CONFIG
    assert default_config(gpu, 64, code, hopper=True) == WGMMA_CONFIG
    assert not default_config(gpu, 32, code, hopper=True).wgmma  # would pad half the block
    assert not default_config(gpu, 128, code, torch.float16, hopper=True).wgmma
    assert not default_config(gpu, 128, code, hopper=False).wgmma
    for other in ("bf16", "fp8_e4m3"):  # the Triton kernel is as fast or faster there
        assert not default_config(gpu, 128, LAYOUT_CODES[other], hopper=True).wgmma
    assert not default_config(torch.device("cpu"), 128, LAYOUT_CODES["fp8_ds_mla"]).wgmma


def test_the_gluon_kernel_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="wgmma runs"):
        SparseConfig(block_h=32, block_n=64, num_warps=8, wgmma=True)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    with pytest.raises(UnsupportedConfig, match="fp8_ds_mla caches, not 'fp8_e4m3'"):
        check_wgmma(WGMMA_CONFIG, cpu, LAYOUT_CODES["fp8_e4m3"], bf16)
    with pytest.raises(UnsupportedConfig, match="bf16 queries"):
        check_wgmma(WGMMA_CONFIG, cpu, LAYOUT_CODES["fp8_ds_mla"], torch.float16)
    with pytest.raises(UnsupportedConfig, match="Hopper"):
        check_wgmma(WGMMA_CONFIG, cpu, LAYOUT_CODES["fp8_ds_mla"], bf16)
    verdict = judge(TritonSparse(WGMMA_CONFIG), build_problem(sparse("paged", layout="fp8_ds_mla"), cpu))
    why = "Hopper" if cache_ops.triton_unavailable(cpu) is None else "TRITON_INTERPRET"  # a GPU host: no interpreter
    assert verdict.status == "unsupported" and why in verdict.message, verdict.message


def _hopper() -> torch.device:
    device = torch.device("cuda")
    if not common.has_wgmma(device):
        pytest.skip("needs a Hopper GPU (compute capability 9)")
    return device


WGMMA_CASES = {  # (transform, mode, layout, heads, kv_lens, topk)
    "decode-h128-topk2048": ("paged", "sparse_decode", "fp8_ds_mla", 128, (2100, 2048, 5), 2048),
    "prefill-h80-ragged": ("ragged", "sparse_prefill", "fp8_ds_mla", 80, (70, 33, 5), 40),
    "prefill-h64-pow2": ("paged", "sparse_prefill", "fp8_ds_mla_pow2", 64, (300, 129, 64), 100),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(WGMMA_CASES))
def test_the_gluon_kernel_passes_the_judge_on_hopper(case):
    """Top-k 2048 and top-k cut mid-step, padded head blocks (80 heads), invalid indices among the valid ones, RAGGED
    and PAGED; the judge poisons outputs and unused cache slots (masked copies must keep them out)."""
    transform, mode, layout, heads, kv_lens, topk = WGMMA_CASES[case]
    problem = build_problem(sparse(transform, mode, layout, kv_lens=kv_lens, topk=topk, num_heads=heads, seed=4),
                            _hopper())
    problem.sparse_indices[0, ::7] = -1
    problem.topk_indices[0, ::7] = -1
    verdict = judge(IMPLS[transform](WGMMA_CONFIG), problem)
    assert verdict.status == "passed", verdict.violations or verdict.message
    if heads == 128:
        assert IMPLS[transform]().plan(problem).config.wgmma  # the default there


@pytest.mark.gpu
@pytest.mark.parametrize("case, splits", [("decode-h128-topk2048", 16), ("decode-h128-topk2048", 3),
                                          ("prefill-h80-ragged", 2)])
def test_the_gluon_kernels_pieces_pass_the_judge_on_hopper(case, splits):
    """Lists cut in 16 pieces of 128 indices, in 3 of 704 (the last short), and top-k 40 in 2 pieces of 64 (the
    second past the list's end: no key, out 0, lse -inf); each piece stores a float32 partial the merge weighs."""
    transform, mode, layout, heads, kv_lens, topk = WGMMA_CASES[case]
    problem = build_problem(sparse(transform, mode, layout, kv_lens=kv_lens, topk=topk, num_heads=heads, seed=5),
                            _hopper())
    problem.sparse_indices[0, ::5] = -1
    problem.topk_indices[0, ::5] = -1
    impl = IMPLS[transform](replace(WGMMA_CONFIG, num_splits=splits))
    verdict = judge(impl, problem)
    assert verdict.status == "passed", verdict.violations or verdict.message
    assert impl.plan(problem).workspace[0].shape[0] == splits


@pytest.mark.gpu
@pytest.mark.parametrize("q_factor, kv_factor", [(2.0 ** 20, 2.0 ** 23), (2.0 ** -30, 2.0 ** -20)],
                         ids=["beyond-float16-max", "below-float16-min"])
def test_the_gluon_kernels_float16_products_hold_queries_and_scales_of_any_magnitude(q_factor, kv_factor):
    problem = magnified(build_problem(sparse("paged", "sparse_prefill", "fp8_ds_mla", num_heads=64, seed=8),
                                      _hopper()), q_factor, kv_factor)
    verdict = judge(TritonSparse(WGMMA_CONFIG), problem)
    assert verdict.status == "passed", verdict.violations or verdict.message


@pytest.mark.gpu
def test_a_row_without_a_valid_index_is_empty_through_the_gluon_kernel():
    problem = build_problem(sparse("paged", layout="fp8_ds_mla", num_heads=64, seed=2), _hopper())
    problem.sparse_indices[-1] = -1
    problem.topk_indices[-1] = -1
    impl = TritonSparse(WGMMA_CONFIG)
    verdict = judge(impl, problem)
    assert verdict.status == "passed", verdict.violations or verdict.message
    out, lse = impl.run(impl.plan(problem))
    assert bool((out[-1] == 0).all()) and bool(torch.isneginf(lse[-1]).all())


@pytest.mark.gpu
def test_a_planted_bug_through_the_gluon_kernel_fails_the_judge():
    """Each token's last index dropped: the kernel must read every index of the list, to its end."""

    class GluonDropsTheLastIndex(TritonSparse):
        def run(self, plan):
            p = plan.problem
            return sparse_mqa(p.q, p.sparse_indices[:, :-1], p.cache.rows(), plan.layout, p.scale, 1.0, plan.out,
                              plan.lse, plan.config)

    problem = build_problem(sparse("paged", layout="fp8_ds_mla", kv_lens=(70, 65, 64), topk=64, num_heads=64,
                                   seed=3), _hopper())
    verdict = judge(GluonDropsTheLastIndex(WGMMA_CONFIG), problem)
    assert verdict.status == "failed", "the Gluon kernel ignored the list's last index"


# ---- index lists cut in pieces (split-KV over the top-k list, merged by LSE) ------------------------------------


def split_config(problem, splits: int | None) -> SparseConfig:
    """The problem's default tiles on this device, its lists cut in ``splits`` pieces."""
    config = default_config(problem.q.device, problem.q.shape[1], LAYOUT_CODES[problem.cache.layout.name],
                            problem.q.dtype)
    return replace(config, num_splits=splits)


# top-k 128 over requests of 150, 33 and 5 keys: with 32- or 64-index steps, 3 pieces leave the last one past the
# list's end, and 5 the last one (32, the interpreter's) or three (64); the shorter requests' later pieces see no key
# (their lists end in -1 padding).
LISTS = (150, 33, 5)


@pytest.mark.parametrize("transform", ["paged", "ragged"])
@pytest.mark.parametrize("layout, mode, splits", [("bf16", "sparse_decode", 2), ("fp8_ds_mla", "sparse_prefill", 3),
                                                  ("fp8_e4m3", "sparse_decode", 5),
                                                  ("fp8_ds_mla_pow2", "sparse_decode", 3)])
def test_index_lists_cut_in_pieces_pass_the_judge(transform, layout, mode, splits):
    """Each piece writes a normalized partial that the merge weighs by its lse; pieces that see no key (lse -inf) add
    nothing, though the judge poisons the workspace they leave."""
    p = build_problem(sparse(transform, mode, layout, topk=128, kv_lens=LISTS, seed=splits), DEVICE)
    impl = IMPLS[transform](split_config(p, splits))
    verdict = judge(impl, p)
    assert verdict.status == "passed", verdict.violations or verdict.message
    parts, part_lse = impl.plan(p).workspace
    assert parts.shape == (splits, *p.q.shape[:2], 512) and part_lse.shape == (splits, *p.q.shape[:2])


def test_few_tokens_on_a_large_gpu_are_cut_by_default_and_pass_the_judge(monkeypatch):
    """Three tokens on a GPU of 132 multiprocessors (the interpreter's plan says 4): the default cuts their lists."""
    monkeypatch.setattr(common, "sm_count", lambda device: 132)
    p = build_problem(sparse("paged", topk=2 * MIN_SPLIT_INDICES, kv_lens=(300, 200, 40)), DEVICE)
    impl = TritonSparse()
    plan = impl.plan(p)
    assert plan.workspace is not None and plan.workspace[0].shape[0] == 2
    verdict = judge(impl, p)
    assert verdict.status == "passed", verdict.violations or verdict.message


def test_the_lists_are_cut_to_fill_one_wave_in_whole_steps_and_no_empty_piece():
    one = SparseConfig(block_h=16, block_n=64, num_warps=4)
    assert index_splits(1, 16, 2048, one, 132) == (2048 // MIN_SPLIT_INDICES, MIN_SPLIT_INDICES)  # no piece shorter
    assert index_splits(64, 16, 2048, one, 132) == (2, 1024)  # whole waves: 3 pieces would spill into a second
    assert index_splits(32, 16, 2048, replace(one, programs_per_sm=2), 132) == (8, 256)  # 256 for 264
    assert index_splits(132, 16, 2048, one, 132)[0] == 1    # the tokens fill the GPU alone
    assert index_splits(32, 128, 2048, one, 132)[0] == 1    # so do their head blocks
    for tokens, heads, topk in [(1, 16, 2048), (3, 16, 130), (5, 128, 2047), (40, 16, 64), (2, 64, 129), (0, 16, 64),
                                (7, 16, 0)]:
        splits, chunk = index_splits(tokens, heads, topk, one, 132)
        assert chunk % one.block_n == 0 and splits * chunk >= topk, (tokens, heads, topk)
        assert splits == 1 or (splits - 1) * chunk < topk, "a piece past the list's end"
    assert index_splits(4, 16, 100, replace(one, num_splits=5), 132) == (5, 64)  # forced: pieces 2-4 empty
    assert index_splits(32, 128, 2048, WGMMA_CONFIG, 132) == (2, 1024)  # the Gluon kernel's 64-head blocks
    assert index_splits(64, 128, 2048, WGMMA_CONFIG, 132)[0] == 1  # 128 programs already, 256 would be 2 waves


def test_the_default_wave_is_one_program_per_multiprocessor_and_two_for_bf16():
    """The counts measured best (NOTES.md, session 65): bf16 two, the scaled layouts, pow2 and the Gluon kernel one."""
    gpu = torch.device("cuda")
    for layout, programs in (("bf16", 2), ("fp8_ds_mla", 1), ("fp8_e4m3", 1), ("fp8_ds_mla_pow2", 1)):
        for heads, hopper in ((16, False), (128, True)):
            assert default_config(gpu, heads, LAYOUT_CODES[layout], hopper=hopper).programs_per_sm == programs, layout


@pytest.mark.parametrize("fields, message", [
    (dict(num_splits=0), "num_splits must be None or an int >= 1, got 0"),
    (dict(num_splits=True), "num_splits must be None or an int >= 1, got True"),
    (dict(num_splits=2.0), "num_splits must be None or an int >= 1, got 2.0"),
    (dict(num_splits=65536), "which CUDA caps at 65535, got 65536"),
    (dict(programs_per_sm=0), "programs_per_sm must be an int >= 1, got 0"),
])
def test_piece_counts_the_kernel_cannot_run_are_refused_by_the_config(fields, message):
    with pytest.raises(ValueError, match=message):
        SparseConfig(**fields)


def test_a_workspace_unlike_the_pieces_partials_is_refused_and_a_missing_one_is_allocated():
    """The kernel writes the workspace as contiguous float32 ``[S, T, H, 512]`` and ``[S, T, H]`` on q's device: one
    of other pieces, dtype, shape, layout (head-major) or device is refused; none given, ``sparse_mqa`` allocates it."""
    p = build_problem(sparse("paged", topk=128, kv_lens=LISTS, seed=5), DEVICE)
    config = split_config(p, 3)
    rows, code = p.cache.rows(), LAYOUT_CODES["bf16"]
    parts, part_lse = split_workspace(p.q, p.sparse_indices, config)
    head_major = parts.transpose(1, 2).contiguous().transpose(1, 2)
    for bad in [(parts[:2], part_lse[:2]), (parts.double(), part_lse), (parts, part_lse[..., :1]), parts,
                (head_major, part_lse), (parts, part_lse.to("meta"))]:
        with pytest.raises(ValueError, match=r"sparse_mqa: the workspace must be contiguous float32 \[3, "):
            sparse_mqa(p.q, p.sparse_indices, rows, code, p.scale, config=config, workspace=bad)
    given = sparse_mqa(p.q, p.sparse_indices, rows, code, p.scale, config=config, workspace=(parts, part_lse))
    own = sparse_mqa(p.q, p.sparse_indices, rows, code, p.scale, config=config)
    assert torch.equal(given[0], own[0]) and torch.equal(given[1], own[1])


def test_the_plans_poison_reaches_the_workspace():
    """The judge poisons what a plan holds before each run: a piece that left rows of its partial unwritten then
    merges NaN into the answer instead of last run's values."""
    p = build_problem(sparse("paged", topk=128, kv_lens=LISTS), DEVICE)
    impl = TritonSparse(split_config(p, 2))
    plan = impl.plan(p)
    impl.poison(plan)
    assert all(bool(t.isnan().all()) for t in plan.workspace)


class PiecesAveraged(TritonSparse):
    """Planted bug: the pieces' partials averaged, not weighed by their lse."""

    def run(self, plan):
        out, lse = super().run(plan)
        out.copy_(plan.workspace[0].mean(0))
        return out, lse


class LastPieceDropped(TritonSparse):
    """Planted bug: the merge reads one piece fewer than the kernel wrote."""

    def run(self, plan):
        out, lse = super().run(plan)
        parts, part_lse = plan.workspace
        sparse_kernel.merge_parts(parts[:-1].contiguous(), part_lse[:-1].contiguous(), out, lse)
        return out, lse


@pytest.mark.parametrize("planted", [PiecesAveraged, LastPieceDropped])
def test_planted_merge_bugs_fail_the_judge(planted):
    p = build_problem(sparse("paged", topk=128, kv_lens=LISTS, seed=2), DEVICE)
    verdict = judge(planted(split_config(p, 2)), p)
    assert verdict.status == "failed", verdict.message


@pytest.mark.parametrize("splits", [1, 2], ids=["whole", "cut"])
@pytest.mark.parametrize("out_dtype, lse_dtype, message", [
    (torch.bfloat16, torch.float64, r"lse must be \[3, 4\] float32, got torch.float64"),
    (torch.bfloat16, torch.bfloat16, r"lse must be \[3, 4\] float32, got torch.bfloat16"),
    (torch.int16, torch.float32, r"out must be \[3, 4, 512\] floating point .*, got torch.int16"),
])
def test_outputs_the_merge_cannot_write_are_refused_before_any_launch(splits, out_dtype, lse_dtype, message):
    """The merge of cut lists takes a float32 lse and a floating-point out: another lse, or an integer out, was
    written where the lists were whole and a ValueError from merge_parts after the kernel ran where they were cut, so
    the same call passed or raised by batch size and multiprocessor count. Now refused up front either way."""
    p = build_problem(sparse("paged", topk=128, kv_lens=LISTS, seed=7), DEVICE)
    config = split_config(p, splits)
    workspace = split_workspace(p.q, p.sparse_indices, config)
    for tensor in workspace or ():
        tensor.fill_(float("nan"))
    out = torch.full((3, 4, 512), 7, dtype=out_dtype, device=DEVICE)
    lse = torch.full((3, 4), 7, dtype=lse_dtype, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        sparse_mqa(p.q, p.sparse_indices, p.cache.rows(), 0, p.scale, 1.0, out, lse, config, workspace)
    assert bool((out == 7).all() and (lse == 7).all()), "written before the refusal"
    assert all(bool(t.isnan().all()) for t in workspace or ()), "a kernel launched before the refusal"


def test_queries_of_no_heads_give_empty_outputs():
    """q ``[T, 0, 576]`` passes the checks, as T = 0 and top-k 0 do: ``index_splits`` divided the GPU's programs by
    the tokens' zero head blocks (ZeroDivisionError in plan and run) where the whole lists launched an empty grid."""
    p = build_problem(sparse("paged", topk=128, kv_lens=LISTS), DEVICE)
    assert index_splits(3, 0, 128, INTERPRETER_CONFIG, 132) == (1, 128)
    p.q = p.q[:, :0]
    impl = TritonSparse()
    out, lse = impl.run(impl.plan(p))
    assert out.shape == (3, 0, 512) and lse.shape == (3, 0)


def test_cut_lists_of_several_head_blocks_pass_the_judge():
    """40 heads are three 16-head blocks (the last padded): each block's pieces land at their heads' rows of the
    workspace, in the interpreter's tiles and a GPU's alike."""
    p = build_problem(sparse("ragged", topk=128, kv_lens=LISTS, num_heads=40, seed=4), DEVICE)
    verdict = judge(TritonSparseRagged(split_config(p, 3)), p)
    assert verdict.status == "passed", verdict.violations or verdict.message


@pytest.mark.parametrize("where", ["query", "key"])
def test_a_nan_reaches_out_and_lse_through_cut_lists(where):
    """A NaN query row, or a NaN key that a token's list selects, gives that row NaN in out and lse when its list is
    cut, as when it is whole (a NaN must never merge into a plausible number); the other rows stay finite."""
    p = build_problem(sparse("paged", topk=128, kv_lens=LISTS, seed=9), DEVICE)
    if where == "query":
        p.q[1, 2, 5] = float("nan")
    else:  # token 1's last selected key: a bf16 value in its nope columns
        slot = int(p.sparse_indices[1][p.sparse_indices[1] >= 0][-1])
        p.cache.rows()[slot, 40:42] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8, device=DEVICE)  # bf16 NaN
    impl = TritonSparse(split_config(p, 3))
    out, lse = impl.run(impl.plan(p))
    nan_rows = torch.zeros(out.shape[:2], dtype=torch.bool, device=DEVICE)
    nan_rows[1, 2 if where == "query" else slice(None)] = True
    assert torch.equal(torch.isnan(lse), nan_rows) and torch.equal(torch.isnan(out).all(-1), nan_rows)
    assert not torch.isnan(out[~nan_rows]).any()


def test_a_planned_run_allocates_no_workspace(monkeypatch):
    """CUDA graphs replay ``run`` without its allocations: with a plan, the cut lists' partials come from it."""
    p = build_problem(sparse("paged", topk=128, kv_lens=LISTS), DEVICE)
    impl = TritonSparse(split_config(p, 2))
    plan = impl.plan(p)

    def refuse(*args, **kwargs):
        raise AssertionError("run allocated a workspace")

    monkeypatch.setattr(sparse_kernel, "split_workspace", refuse)
    out, lse = impl.run(plan)
    assert plan.workspace is not None and not torch.isnan(out).any()


@pytest.mark.parametrize("tensor_scale", [None, float("nan"), -1.0, 0.0, "x", True])
def test_sparse_mqa_requires_a_valid_per_layer_scale_for_fp8_e4m3(tensor_scale):
    """The per-layer scale defaulted to 1.0 and was never checked: called without it, an fp8_e4m3 cache gave an lse
    126 off and outputs 120x, with no error (-1.0 plausible wrong numbers, NaN NaN, None an interpreter error)."""
    p = build_problem(sparse("paged", layout="fp8_e4m3"), DEVICE)
    with pytest.raises(ValueError, match=r"^sparse_mqa: layout fp8_e4m3: tensor_scale must be a finite positive"):
        sparse_mqa(p.q, p.sparse_indices, p.cache.rows(), LAYOUT_CODES["fp8_e4m3"], p.scale, tensor_scale)


@pytest.mark.parametrize("transform", ["paged", "ragged"])
@pytest.mark.parametrize("tensor_scale", [float("nan"), None])
def test_a_per_layer_scale_reassigned_after_the_cache_was_built_is_refused(transform, tensor_scale):
    """PagedCache checks its scale when built, but the field may be reassigned: NaN ran into NaN outputs, None was
    read as 1.0 (plausible wrong numbers); plan and run refuse it, as do the cache ops."""
    p = build_problem(sparse(transform, layout="fp8_e4m3"), DEVICE)
    impl = IMPLS[transform]()
    plan = impl.plan(p)
    p.cache.tensor_scale = tensor_scale
    with pytest.raises(ValueError, match="layout fp8_e4m3: tensor_scale must be a finite positive number"):
        impl.plan(p)
    with pytest.raises(ValueError, match="layout fp8_e4m3: tensor_scale must be a finite positive number"):
        impl.run(plan)
    values = torch.randn(2, 576, device=DEVICE)
    with pytest.raises(ValueError, match="layout fp8_e4m3: tensor_scale must be a finite positive number"):
        cache_ops.write_cache_triton(p.cache, values, torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="layout fp8_e4m3: tensor_scale must be a finite positive number"):
        cache_ops.gather_cache_triton(p.cache, torch.tensor([0, 1], device=DEVICE))


def test_sparse_mqa_refuses_an_out_that_overlaps_itself():
    """An out expanded along its heads (stride 0) was written by every head block in turn, keeping one."""
    p = build_problem(sparse("paged"), DEVICE)
    tokens, heads = p.q.shape[:2]
    out = torch.randn(tokens, 1, 512, device=DEVICE).to(p.q.dtype).expand(tokens, heads, 512)
    with pytest.raises(ValueError, match=rf"^sparse_mqa: out must not overlap itself \(strides \[512, 0, 1\]"):
        sparse_mqa(p.q, p.sparse_indices, p.cache.rows(), 0, p.scale, out=out)


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.float64])
def test_gather_latent_refuses_an_out_of_a_dtype_it_does_not_write(dtype):
    """An int32 or uint8 out was written with the decoded values truncated, in silence."""
    p = build_problem(sparse("ragged"), DEVICE)
    slots = p.meta.token_slots
    with pytest.raises(ValueError, match=rf"^gather_latent: out must be one of .*, got {dtype}$"):
        gather_latent(p.cache, slots, torch.randint(1, 9, (len(slots), 576), device=DEVICE).to(dtype))


@pytest.mark.parametrize("name", ["q", "indices", "rows", "out", "lse"])
def test_sparse_mqa_refuses_a_list_or_a_meta_tensor_naming_it(name):
    """A list failed with AttributeError ("'list' object has no attribute 'dim'"); inputs all on meta passed the one
    device check and failed in the launch ('Cannot copy out of meta tensor')."""
    p = build_problem(sparse("paged", seed=int(torch.randint(0, 2 ** 31, ()))), DEVICE)
    tokens, heads = p.q.shape[:2]
    given = dict(q=p.q, indices=p.sparse_indices, rows=p.cache.rows(),
                 out=torch.empty(tokens, heads, 512, dtype=p.q.dtype, device=DEVICE),
                 lse=torch.empty(tokens, heads, device=DEVICE))
    call = lambda x: sparse_mqa(x["q"], x["indices"], x["rows"], 0, p.scale, out=x["out"], lse=x["lse"])  # noqa: E731
    with pytest.raises(ValueError, match=f"^sparse_mqa: {name} must be a torch.Tensor, got list$"):
        call({**given, name: given[name].tolist()})
    with pytest.raises(ValueError, match=f"^sparse_mqa: (.*; )?{name} is on the meta device, which holds no values"):
        call({key: t.to("meta") for key, t in given.items()})
