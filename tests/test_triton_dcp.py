"""Decode context parallel: shards, the context reorg, and real multi-process runs over gloo (W=2 and W=3).

The reorg (chunked prefill's context gathered across ranks) is checked for every W, interleave, page size and
chunk size, chunks starting mid-page included, against the float64 reference reorg and the unsharded cache.
Planted bug: a combine that NaNs on a row no rank saw must be caught. Refusals come before any rank runs: an
interleave that does not divide the page size (vLLM's rule) and a layout the chosen shard attention cannot read.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import time

import pytest
import torch

import impls.triton  # noqa: F401
from impls.triton.chunked import context_segments
from impls.triton.dcp import run_dcp
from impls.triton.dcp.comm import HeadComm
from suites.sweeps import as_dcp
from impls.triton.dcp.impl import TritonDcp
from impls.triton.dcp.reorg import local_part_slots, padded_part_len, reorg_source_rows
from impls.triton.dcp.shard import build_shard, local_count
from mla_bench.compare import compare
from mla_bench.errors import UnsupportedConfig
from mla_bench.layouts.ops import gather_cache
from mla_bench.metadata.reference import check_dcp, cumulative, dcp_local_len, dcp_rank_of_position
from mla_bench.problem import build_problem
from mla_bench.tolerances import tolerance_for
from mla_bench.workload import Workload
from reference import dcp_reorg
from reference.expected import expected
from suites.accuracy import judge_workload
from suites.capability import names_combination
from suites.judge import judge

KV_LENS = (37, 1, 0, 20)  # a request shorter than one interleave block (empty shards), a padding request


def dcp_workload(world, interleave, page=4, layout="bf16", q_lens=(1, 1, 1, 2), kv_lens=KV_LENS, **kw):
    return Workload(mode="dcp", q_lens=q_lens, kv_lens=kv_lens, page_size=page, layout=layout, dcp_world=world,
                    dcp_interleave=interleave, **kw)


def test_local_count_is_vllms_local_length():
    for world, interleave, rank in itertools.product((1, 2, 3, 4), (1, 2, 3, 8), range(4)):
        if rank < world:
            positions = torch.arange(70)
            expect = [dcp_local_len(int(p), rank, world, interleave) for p in positions]
            assert local_count(positions, rank, world, interleave).tolist() == expect


@pytest.mark.parametrize("heads,world", [(16, 2), (16, 3), (2, 3), (128, 4)])
def test_head_groups_are_contiguous_slices_in_tensor_split_order(heads, world):
    """Each rank's heads are a slice (a view: capturable in a CUDA graph) and the slices tile the heads in order
    with tensor_split's sizes, empty groups included when there are fewer heads than ranks."""
    comms = [HeadComm(heads, rank, world) for rank in range(world)]
    expected_groups = [g.tolist() for g in torch.arange(heads).tensor_split(world)]
    got = [list(range(heads))[comm.my_heads] for comm in comms]
    assert got == expected_groups
    x = torch.randn(3, heads, 5)
    assert all(x[:, comm.my_heads]._base is x for comm in comms)  # a view, not a gathered copy
    assert comms[0].width == max(len(g) for g in expected_groups)


@pytest.mark.parametrize("world, interleave", [(2, 1), (3, 2), (4, 8)])
def test_a_shard_holds_its_tokens_in_order_and_the_causal_frontiers(world, interleave):
    problem = build_problem(dcp_workload(world, interleave, q_lens=(1, 3, 0, 2), kv_lens=(37, 3, 0, 20)))
    everything = gather_cache(problem.cache, problem.meta.token_slots)
    starts = cumulative(list(problem.meta.kv_lens))
    for rank in range(world):
        shard = build_shard(problem, rank, world, interleave)
        local = gather_cache(shard.cache, shard.token_slots)
        expect, visible = [], []
        for b, (q_len, kv_len) in enumerate(zip(problem.meta.q_lens, problem.meta.kv_lens)):
            mine = [p for p in range(kv_len) if dcp_rank_of_position(p, world, interleave) == rank]
            expect += [starts[b] + p for p in mine]
            visible += [sum(1 for p in mine if p <= kv_len - q_len + i) for i in range(q_len)]
        assert torch.equal(local, everything[expect])
        assert shard.visible_lens.tolist() == visible
        used = torch.zeros(shard.cache.num_slots, dtype=torch.bool)
        used[shard.token_slots] = True
        assert bool((shard.cache.rows()[~used] == 0xFF).all()), "unused local bytes must stay poisoned"


def decoded_slots(cache) -> torch.Tensor:
    """Every slot of a cache decoded once (float64; poisoned slots read NaN): rows to index by slot."""
    return cache.layout.dequantize(cache.rows(), cache.tensor_scale)


def test_reorg_restores_sequence_order_for_every_world_interleave_page_and_chunk():
    checked = 0
    for page in (1, 4, 16):
        for world, interleave in itertools.product((1, 2, 3, 4), (1, 2, 3, 8)):
            problem = build_problem(dcp_workload(world, interleave, page=page))
            shards = [build_shard(problem, r, world, interleave) for r in range(world)]
            slot_rows = [decoded_slots(shard.cache) for shard in shards]
            global_rows = decoded_slots(problem.cache)
            starts = cumulative(list(problem.meta.kv_lens))
            for chunk in (1, 5, 16, 1000):
                for pieces in context_segments(list(problem.meta.kv_lens), chunk):
                    rows = torch.cat([torch.arange(starts[b] + s, starts[b] + e) for b, s, e in pieces])
                    unsharded = global_rows[problem.meta.token_slots[rows]]
                    # the reference: each rank's part by plain loops, reorganized by plain loops
                    ref_parts = []
                    for shard in shards:
                        local_starts = shard.local_starts
                        slots = [int(shard.token_slots[local_starts[b] + dcp_reorg.local_index(p, shard.rank, world,
                                                                                                  interleave)])
                                 for b, p in dcp_reorg.part_positions(pieces, shard.rank, world, interleave)]
                        ref_parts.append(slot_rows[shard.rank][torch.tensor(slots, dtype=torch.int64)])
                    assert torch.equal(dcp_reorg.reorg(ref_parts, pieces, world, interleave), unsharded)
                    # ours: local slot ranges, padded parts as the all-gather delivers them, source rows
                    padded = padded_part_len(pieces, world, interleave)
                    gathered = torch.full((world * padded, 576), float("nan"), dtype=torch.float64)
                    for shard in shards:
                        part = slot_rows[shard.rank][local_part_slots(shard, pieces)]
                        assert torch.equal(part, ref_parts[shard.rank])
                        gathered[shard.rank * padded:shard.rank * padded + len(part)] = part
                    ours = gathered[reorg_source_rows(pieces, world, interleave, padded)]
                    assert torch.equal(ours, unsharded)
                    checked += 1
    assert checked > 500


# gloo ranks compute on the CPU in Triton's interpreter: the CI setup. On a GPU host DCP runs over NCCL (the
# equivalence suite's test covers it there), and that host's Triton 3.6 interpreter cannot run these kernels at all
# under numpy 2.5 (seen on the H200 machine: any loop with a run-time bound raises "only 0-dimensional arrays can be
# converted to Python scalars" inside the interpreter).
gloo_on_cpu = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="gloo DCP ranks use Triton's interpreter: a CPU-host (CI) test; NCCL on GPUs")


def check_against_reference(problem, out, lse, layout="bf16"):
    ref = expected(problem)
    metrics = compare(out, lse, ref.out, ref.lse)
    violations = tolerance_for("bfloat16", layout).violations(metrics)
    assert not violations, violations


@gloo_on_cpu
def test_dcp_over_two_gloo_ranks_with_the_triton_attention_and_the_context_reorg():
    w = dcp_workload(2, 1, page=4)
    outcome = run_dcp(w, backend="gloo", attention="triton_sparse", reorg_chunk=5)
    check_against_reference(build_problem(w), outcome.out, outcome.lse)
    assert outcome.reorg_max_diff == 0.0
    assert torch.isneginf(outcome.lse[2]).all() and bool((outcome.out[2] == 0).all())  # the padding request


@gloo_on_cpu
def test_dcp_impl_over_three_gloo_ranks_with_empty_shards_mtp_and_fp8():
    problem = build_problem(dcp_workload(3, 2, page=8, layout="fp8_ds_mla", q_lens=(2, 1, 1, 1)))
    verdict = judge(TritonDcp(attention="torch"), problem)
    assert verdict.status == "passed", verdict.violations or verdict.message


def naive_rescale(part, all_lse, rank):
    """Planted bug: the combine without its guard (NaN where no rank saw a key)."""
    total = torch.logsumexp(all_lse, dim=0)
    return part * torch.exp(all_lse[rank] - total)[..., None], total


def test_a_combine_that_nans_on_an_empty_row_is_caught():
    w = dcp_workload(2, 1)
    outcome = run_dcp(w, backend="gloo", attention="torch", rescale=naive_rescale)
    ref = expected(build_problem(w))
    assert compare(outcome.out, outcome.lse, ref.out, ref.lse).nonfinite_mismatch > 0


def rescale_where_rank_1_fails_and_rank_0_hangs(part, all_lse, rank):
    """Planted: rank 1 fails in the combine while rank 0 waits for ever, as NCCL ranks wait for a dead peer."""
    if rank == 1:
        raise ValueError("planted: rank 1 fails")
    time.sleep(600)


def test_a_failed_rank_ends_the_run_soon_naming_the_rank_that_failed_first():
    """run_dcp waited the whole timeout (600 s by default) for the survivors, then named rank 0's secondary error."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DCP rank failed \(error_1, the first of 1 to report") as failure:
        run_dcp(dcp_workload(2, 1), backend="gloo", attention="torch",
                rescale=rescale_where_rank_1_fails_and_rank_0_hangs, timeout_s=300)
    assert time.monotonic() - start < 60 and "planted: rank 1 fails" in str(failure.value)


@gloo_on_cpu
def test_a_decode_workload_runs_as_dcp_through_the_accuracy_suite():
    decode = Workload(mode="decode", q_lens=(1, 1), kv_lens=(33, 9), page_size=8)
    results = list(judge_workload(as_dcp(decode, 2, 4), [TritonDcp(attention="torch")], torch.device("cpu")))
    assert [r.status for r in results] == ["passed"] and "W2 I4" in results[0].label
    with pytest.raises(ValueError, match="decode workloads"):
        as_dcp(Workload(mode="prefill", q_lens=(2,), kv_lens=(4,)), 2)


def test_run_dcp_refuses_other_modes_and_missing_gpus():
    with pytest.raises(ValueError, match="mode dcp"):
        run_dcp(Workload(mode="decode", q_lens=(1,), kv_lens=(4,)))
    with pytest.raises(ValueError, match="takes bfloat16 queries, the workload's are float16"):  # were rounded
        run_dcp(dcp_workload(2, 1).replace(dtype="float16"), backend="gloo")
    with pytest.raises(ValueError, match="unknown shard attention 'bogus'"):  # was an error in every rank, each run
        TritonDcp(attention="bogus")
    with pytest.raises(ValueError, match="a shard attention needs name, layouts, prepare"):  # an object, not a name
        run_dcp(dcp_workload(2, 1), backend="gloo", attention=object())
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="GPUs"):
            run_dcp(dcp_workload(2, 1), backend="nccl")


ODD_INTERLEAVE = re.escape("DCP needs an interleave that divides the page size; got interleave=3, page_size=4")


def test_run_dcp_and_the_impl_refuse_an_interleave_that_does_not_divide_the_page_size_as_the_metadata_does():
    """vLLM asserts ``block_size % cp_kv_cache_interleave_size == 0`` and the bench's DCP slot mappings refuse the
    rest (``check_dcp``); run_dcp ran such a layout anyway and the impl passed it, so the entry points disagreed."""
    w = dcp_workload(2, 3, page=4)
    with pytest.raises(ValueError, match=ODD_INTERLEAVE) as from_metadata:
        check_dcp(4, 2, 3)
    with pytest.raises(ValueError, match=ODD_INTERLEAVE) as from_run:
        run_dcp(w, backend="gloo", attention="torch")
    assert str(from_run.value) == str(from_metadata.value)  # one check, one message
    with pytest.raises(ValueError, match=ODD_INTERLEAVE):  # an interleave given to run_dcp, not the workload's
        run_dcp(dcp_workload(2, 1, page=4), interleave=3, backend="gloo", attention="torch")
    verdict = judge(TritonDcp(attention="torch"), build_problem(w))
    assert (verdict.status, verdict.message) == ("unsupported", f"triton_dcp: {from_metadata.value}")



def test_a_cuda_problem_with_too_few_gpus_is_refused_naming_dcp(monkeypatch):
    """On one GPU the refusal must name the op it refuses: the capability matrix fails a refusal that names no op,
    layout or transform (it failed every dcp cell of a one-GPU run: "W=2 ranks need 2 GPUs, 1 visible")."""
    import impls.triton.dcp.impl as dcp_impl

    monkeypatch.setattr(dcp_impl, "default_backend", lambda world: "gloo")  # what one visible GPU gives
    problem = dataclasses.replace(build_problem(dcp_workload(2, 1)), device=torch.device("cuda"))
    with pytest.raises(UnsupportedConfig) as refused:
        TritonDcp().plan(problem)
    assert names_combination(str(refused.value), problem.workload, "triton_dcp"), refused.value


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.1])
def test_a_scale_the_reference_refuses_is_refused_by_plan_before_any_rank_runs(scale):
    """The plan passed it: each triton_decode rank then failed once started (a RuntimeError, not a refusal), and the
    torch attention answered with it (a NaN lse for a NaN scale)."""
    problem = build_problem(dcp_workload(2, 1))
    problem.scale = scale
    for attention in ("triton_decode", "torch"):
        with pytest.raises(ValueError, match="softmax scale must be a finite positive number"):
            TritonDcp(attention=attention).plan(problem)


@pytest.mark.parametrize("spoil, got", [
    (lambda q: q.float(), r"torch.float32 \[5, 4, 576\]"),  # the decode attention rounded it to bf16 silently
    (lambda q: q[:-1], r"torch.bfloat16 \[4, 4, 576\]"),   # a rank failed once started
    (lambda q: q[:, :2], r"torch.bfloat16 \[5, 2, 576\]"),
], ids=["float32", "a token short", "half the heads"])
def test_queries_other_than_the_workloads_are_refused_by_plan_before_any_rank_runs(spoil, got):
    """The plan passed queries of another dtype or shape than the workload's, whatever the shard attention."""
    problem = build_problem(dcp_workload(2, 1))
    problem.q = spoil(problem.q)
    for attention in ("triton_decode", "torch"):
        with pytest.raises(ValueError, match=r"triton_dcp: q must be torch.bfloat16 \[5, 4, 576\] \(the workload's "
                                             r"dtype, tokens and heads\), got " + got):
            TritonDcp(attention=attention).plan(problem)


FP4_LAYOUTS = {"fp4_mx16", "mxfp4_nsa", "nvfp4"}
BF16_AND_FP8 = {"bf16", "fp8_e4m3", "fp8_ds_mla", "fp8_ds_mla_pow2"}


@pytest.mark.parametrize("attention, reads", [("triton_decode", BF16_AND_FP8 | FP4_LAYOUTS),
                                              ("torch", BF16_AND_FP8 | FP4_LAYOUTS), ("triton_sparse", BF16_AND_FP8)])
def test_the_impl_declares_the_layouts_of_its_shard_attention(attention, reads):
    """Each attention's layouts as found by running it over gloo (the sparse kernel's latent readers have no FP4);
    the impl declared the decode's whatever attention it was made with."""
    assert TritonDcp(attention=attention).capabilities.layouts == reads
    assert TritonDcp.capabilities.layouts == BF16_AND_FP8 | FP4_LAYOUTS  # the registered impl: the default attention


def test_a_layout_the_shard_attention_cannot_read_is_refused_before_any_rank_runs():
    """triton_sparse reads no FP4 cache: each rank failed once it had built its shard, a rank error, not a refusal."""
    w = dcp_workload(2, 1, layout="nvfp4")
    with pytest.raises(UnsupportedConfig, match="triton_dcp: unsupported layout nvfp4"):
        TritonDcp(attention="triton_sparse").plan(build_problem(w))
    with pytest.raises(ValueError, match=r"run_dcp: the triton_sparse shard attention reads layouts "
                                         r"\['bf16', 'fp8_ds_mla', 'fp8_ds_mla_pow2', 'fp8_e4m3'\], not 'nvfp4'"):
        run_dcp(w, backend="gloo", attention="triton_sparse")


@gloo_on_cpu
@pytest.mark.parametrize("attention, layout", [("torch", "nvfp4"), ("triton_decode", "mxfp4_nsa"),
                                               ("triton_sparse", "fp8_e4m3")])
def test_a_shard_attention_reads_the_layouts_it_declares(attention, layout):
    """One layout at the edge of each declaration, run for real (FP4 for those that claim it)."""
    w = dcp_workload(2, 2, layout=layout)
    outcome = run_dcp(w, backend="gloo", attention=attention)
    check_against_reference(build_problem(w), outcome.out, outcome.lse, layout)
