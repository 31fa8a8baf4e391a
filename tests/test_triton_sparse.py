"""Sparse top-k (DeepSeek V3.2) Triton impls against the float64 reference, PAGED and RAGGED.

Invalid indices (FlashMLA's list: -2^31, -123456, -1, the source's row count, 2^31-1) are skipped; a row
with none valid gives out 0 / lse -inf; the wrong index transform is refused at plan time. Planted bugs: -1
read as index 0, and a RAGGED buffer dequantized to bf16 (rounding FP8 keys), must fail the judge.
"""

from __future__ import annotations

import pytest
import torch

import impls.triton  # noqa: F401
from impls.triton.latent_io import gather_latent
from impls.triton.sparse import TritonSparse, TritonSparseRagged
from impls.triton.sparse_kernel import SparseConfig, sparse_mqa
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
    out, lse = impl.run(impl.checked_plan(problem))
    assert bool((out[-1] == 0).all()) and bool(torch.isneginf(lse[-1]).all())


@pytest.mark.parametrize("impl, other", [(TritonSparse, "ragged"), (TritonSparseRagged, "paged")])
def test_the_other_index_transform_is_refused_at_plan_time(impl, other):
    problem = build_problem(sparse(other), DEVICE)
    verdict = judge(impl(), problem)
    assert verdict.status == "unsupported" and f"index transform {other}" in verdict.message
    with pytest.raises(UnsupportedConfig, match=other.upper()):
        impl().plan(problem)  # refused even when the capability check is skipped


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
