"""triton_prefill (ragged causal MHA, qk 192 = nope 128 | shared rope 64, v 128) against the float64 reference.

Planted bugs: attending without the causal mask, and sizing the grid by the last request's query length
(ATOM's max_qo_len bug) must fail the judge.
"""

from __future__ import annotations

import pytest
import torch

import impls.triton  # noqa: F401
from impls.triton import cache_ops
from impls.triton.prefill import TritonPrefill
from impls.triton.prefill_kernel import PrefillConfig, causal_pairs, mha_prefill, prefill_flops
from mla_bench.problem import build_problem
from mla_bench.registry import resolve
from mla_bench.workload import Workload
from suites.judge import judge

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU, compiled kernels on a GPU

MIXES = [
    ((6, 1, 9), (6, 30, 20)),        # full prompt, one new token on a context, a prefix of 11
    ((17, 0, 70), (40, 5, 70)),      # several query blocks and unmasked key blocks, a request asking nothing
    ((3,), (3,)),                    # one short request
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mix", range(len(MIXES)))
def test_triton_prefill_passes_the_judge(mix, dtype):
    q_lens, kv_lens = MIXES[mix]
    w = Workload(mode="prefill", q_lens=q_lens, kv_lens=kv_lens, dtype=dtype, seed=mix)
    verdict = judge(resolve("triton_prefill").load(), build_problem(w, DEVICE))
    assert verdict.status == "passed", verdict.violations or verdict.message


class NotCausal(TritonPrefill):
    """Planted bug: every query sees every key of its request."""

    def run(self, plan):
        p = plan.problem
        return mha_prefill(p.q, p.k_nope, p.k_pe, p.v, p.meta.query_start_loc, p.meta.kv_start_loc,
                           p.meta.max_qo_len, p.scale, causal=False, out=plan.out, lse=plan.lse)


SMALL_TILES = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


class LastRequestsQueryLength(TritonPrefill):
    """Planted bug: the grid sized by the last request's query count, not the longest (ATOM). Small query
    tiles, so that the short last request covers fewer tiles than the long first one on a GPU too."""

    def run(self, plan):
        p = plan.problem
        return mha_prefill(p.q, p.k_nope, p.k_pe, p.v, p.meta.query_start_loc, p.meta.kv_start_loc,
                           p.meta.q_lens[-1], p.scale, out=plan.out, lse=plan.lse, config=SMALL_TILES)


@pytest.mark.parametrize("planted", [NotCausal, LastRequestsQueryLength])
def test_planted_prefill_bugs_fail_the_judge(planted):
    w = Workload(mode="prefill", q_lens=(20, 5, 3), kv_lens=(26, 5, 9))
    verdict = judge(planted(), build_problem(w, DEVICE))
    assert verdict.status == "failed", verdict.message


def test_prefill_refuses_bad_inputs_by_name():
    p = build_problem(Workload(mode="prefill", q_lens=(4,), kv_lens=(6,)), DEVICE)
    args = (p.meta.query_start_loc, p.meta.kv_start_loc, 4, p.scale)
    with pytest.raises(ValueError, match="k_pe"):
        mha_prefill(p.q, p.k_nope, p.k_pe[:, :32], p.v, *args)
    with pytest.raises(ValueError, match="q must be"):
        mha_prefill(p.q[..., :128], p.k_nope, p.k_pe, p.v, *args)
    with pytest.raises(ValueError, match="float16"):
        mha_prefill(p.q.float(), p.k_nope, p.k_pe, p.v, *args)
    with pytest.raises(ValueError, match="int32"):
        mha_prefill(p.q, p.k_nope, p.k_pe, p.v, p.meta.query_start_loc.long(), *args[1:])


def test_a_bad_scale_is_named_with_the_other_problems():
    """The scale's problem joins the shapes' in one message, instead of raising on its own first."""
    p = build_problem(Workload(mode="prefill", q_lens=(4,), kv_lens=(6,)), DEVICE)
    with pytest.raises(ValueError, match=r"^mha_prefill: k_pe must .*; softmax scale must be a finite positive "
                                         r"number, got nan$"):
        mha_prefill(p.q, p.k_nope, p.k_pe[:, :32], p.v, p.meta.query_start_loc, p.meta.kv_start_loc, 4, float("nan"))


def test_float32_prefill_is_refused_at_plan_time():
    w = Workload(mode="prefill", q_lens=(2,), kv_lens=(2,), dtype="float32")
    verdict = judge(TritonPrefill(), build_problem(w, DEVICE))
    assert verdict.status == "unsupported" and "dtype float32" in verdict.message


def test_causal_flops_count_only_visible_pairs():
    q_lens, kv_lens = (3, 5, 0), (7, 5, 4)
    brute = sum(int((torch.arange(kv)[None, :] <= kv - q + torch.arange(q)[:, None]).sum())
                for q, kv in zip(q_lens, kv_lens))
    assert causal_pairs(q_lens, kv_lens) == brute == 3 * 4 + 6 + 15
    assert prefill_flops(q_lens, kv_lens, heads=2) == 2 * 320 * 2 * brute


def _rows_dropped(p, *names):
    for name in names:
        setattr(p, name, getattr(p, name)[:-1])


def _offsets(p, name, values):
    setattr(p.meta, name, torch.tensor(values, dtype=torch.int32, device=DEVICE))


def _on_meta(owner, name):
    """``owner.name`` replaced by a tensor of its shape and dtype on torch's meta device, another than the rest's."""
    setattr(owner, name, torch.empty_like(getattr(owner, name), device="meta"))


PLAN_REFUSALS = {  # what run() read wrongly or failed on halfway, each refused by plan now
    "nan scale": (lambda p: setattr(p, "scale", float("nan")), "softmax scale"),  # out all NaN
    "tensor scale": (lambda p: setattr(p, "scale", torch.tensor(p.scale)), "softmax scale"),  # a pointer to Triton
    "float32 q": (lambda p: setattr(p, "q", p.q.float()), "bfloat16 or float16"),
    "int64 offsets": (lambda p: setattr(p.meta, "query_start_loc", p.meta.query_start_loc.long()), "int32"),
    "short keys": (lambda p: _rows_dropped(p, "k_nope", "k_pe", "v"), "k_nope has 8 rows but the lengths give 9"),
    "short queries": (lambda p: _rows_dropped(p, "q"), "q has 6 rows but the lengths give 7"),
    # offsets that disagree with the lengths: rows written past out (heap corruption), keys read past k (NaN)
    "query offsets past q": (lambda p: _offsets(p, "query_start_loc", [0, 4, 12]),
                             r"query_start_loc must hold the lengths' 3 offsets: entry 2 is \[12\], .* give \[7\]"),
    "key offsets past k": (lambda p: _offsets(p, "kv_start_loc", [0, 6, 40]), r"cu_seqlens_k .* entry 2 is \[40\]"),
    "a request's offsets dropped": (lambda p: [_offsets(p, name, getattr(p.meta, name)[:2].tolist())
                                               for name in ("query_start_loc", "kv_start_loc")],
                                    r"query_start_loc .* entry 2 is \[\], the lengths give \[7\]"),  # left unwritten
    # a tensor on another device: Triton reads its address as one of q's device (a failed launch, or worse)
    "k_pe elsewhere": (lambda p: _on_meta(p, "k_pe"), r"k_pe is on meta but q is on (cpu|cuda:\d+)"),
    "offsets elsewhere": (lambda p: _on_meta(p.meta, "kv_start_loc"), r"cu_seqlens_k is on meta but q is on"),
    "q elsewhere": (lambda p: _on_meta(p, "q"), r"q is on meta but the problem is on (cpu|cuda)"),  # out, lse go there
}


@pytest.mark.parametrize("case", PLAN_REFUSALS)
def test_prefill_plan_refuses_what_its_run_would_read_wrongly(case):
    """Short keys were read past their end (a plausible answer), short queries' rows written past ``out``, a NaN
    scale gave NaN everywhere: all of them ran."""
    spoil, message = PLAN_REFUSALS[case]
    p = build_problem(Workload(mode="prefill", q_lens=(4, 3), kv_lens=(6, 3)), DEVICE)
    spoil(p)
    with pytest.raises(ValueError, match=message):
        TritonPrefill().plan(p)


def test_mha_prefill_refuses_strided_offsets():
    """The kernel reads cu_seqlens as contiguous memory: a strided view's other elements were taken as offsets."""
    p = build_problem(Workload(mode="prefill", q_lens=(4, 3), kv_lens=(6, 3)), DEVICE)
    cu_q = p.meta.query_start_loc.repeat_interleave(2)[::2]
    cu_k = p.meta.kv_start_loc.repeat_interleave(2)[::2]
    with pytest.raises(ValueError, match=r"contiguous int32 .* strides \(2,\)"):
        mha_prefill(p.q, p.k_nope, p.k_pe, p.v, cu_q, cu_k, 4, p.scale)


@pytest.mark.parametrize("field", ["block_m", "block_n"])
def test_prefill_config_refuses_tiles_that_are_not_powers_of_two(field):
    """Such a tile failed inside Triton (``tl.arange``) at the first run, after plan accepted it."""
    with pytest.raises(ValueError, match=f"{field} must be a power of two, got 24"):
        PrefillConfig(**{field: 24})


def test_cpu_problems_without_the_interpreter_are_refused(monkeypatch):
    """Without TRITON_INTERPRET (a GPU host's CPU problems) the run crashed in Triton's launcher ("0 active
    drivers"); the prefill paths refuse it as the decode does."""
    monkeypatch.setattr(cache_ops, "INTERPRETED", False)  # the kernels compiled, not interpreted
    verdict = judge(TritonPrefill(), build_problem(Workload(mode="prefill", q_lens=(2,), kv_lens=(2,)), "cpu"))
    assert verdict.status == "unsupported" and "need TRITON_INTERPRET=1" in verdict.message, verdict.message


@pytest.mark.parametrize("max_q_len, message", [
    (0, r"max_q_len must be the longest request's query count, in \[1, 71\] .*, got 0"),
    (-1, r"max_q_len must be .* in \[1, 71\] .*, got -1"),
    (72, r"max_q_len must be .* in \[1, 71\] .*, got 72"),
    (3.0, "max_q_len must be an int, got 3.0"),
    (True, "max_q_len must be an int, got True"),
    ("tensor", r"max_q_len must be an int, got tensor\(70"),
])
def test_mha_prefill_refuses_a_max_q_len_that_cannot_size_its_grid(max_q_len, message):
    """0 or less returned the uninitialized outputs (an lse error of 1.6e13), a float failed in the interpreter, a
    tensor with a Triton type error: the grid is sized by it on the host."""
    p = build_problem(Workload(mode="prefill", q_lens=(70, 1), kv_lens=(70, 1)), DEVICE)
    max_q_len = torch.tensor(70) if max_q_len == "tensor" else max_q_len
    with pytest.raises(ValueError, match=f"^mha_prefill: {message}"):
        mha_prefill(p.q, p.k_nope, p.k_pe, p.v, p.meta.query_start_loc, p.meta.kv_start_loc, max_q_len, p.scale)


@pytest.mark.parametrize("name, dtype", [("out", torch.int32), ("lse", torch.int32), ("lse", torch.bfloat16)])
def test_mha_prefill_refuses_outputs_of_a_dtype_it_would_truncate_into(name, dtype):
    """An int32 out and an int32 or bf16 lse were written, truncated, where sparse_mqa refuses them."""
    p = build_problem(Workload(mode="prefill", q_lens=(4, 3), kv_lens=(6, 3)), DEVICE)
    tokens, heads = p.q.shape[:2]
    shape = (tokens, heads, 128) if name == "out" else (tokens, heads)
    given = {name: torch.randint(-5, 5, shape, device=DEVICE).to(dtype)}
    want = "floating point" if name == "out" else "float32"
    with pytest.raises(ValueError, match=rf"^mha_prefill: {name} must be \[{tokens}, {heads}.*{want}.*{dtype}"):
        mha_prefill(p.q, p.k_nope, p.k_pe, p.v, p.meta.query_start_loc, p.meta.kv_start_loc, 4, p.scale, **given)


def test_mha_prefill_refuses_outputs_that_overlap_themselves_or_lie_elsewhere():
    """An lse expanded along its heads (stride 0) kept one head's value; an out on another device was written as an
    address on q's."""
    p = build_problem(Workload(mode="prefill", q_lens=(4, 3), kv_lens=(6, 3)), DEVICE)
    tokens, heads = p.q.shape[:2]
    args = (p.q, p.k_nope, p.k_pe, p.v, p.meta.query_start_loc, p.meta.kv_start_loc, 4, p.scale)
    lse = torch.randn(tokens, 1, device=DEVICE).expand(tokens, heads)
    with pytest.raises(ValueError, match=rf"^mha_prefill: lse must not overlap itself \(strides \[1, 0\]"):
        mha_prefill(*args, lse=lse)
    with pytest.raises(ValueError, match=f"^mha_prefill: out is on meta but q is on {DEVICE}"):
        mha_prefill(*args, out=torch.empty(tokens, heads, 128, dtype=p.q.dtype, device="meta"))


def test_mha_prefill_refuses_a_scale_that_overflows_float32_with_log2e():
    """The kernel's scale * log2(e) is a float32: 1e39 (finite in float64) made every score inf, and NaN."""
    p = build_problem(Workload(mode="prefill", q_lens=(4, 3), kv_lens=(6, 3)), DEVICE)
    scale = float(torch.empty((), dtype=torch.float64).uniform_(2.4e38, 1e300))
    with pytest.raises(ValueError, match=r"^mha_prefill: softmax scale must be at most 2\.35866e\+38"):
        mha_prefill(p.q, p.k_nope, p.k_pe, p.v, p.meta.query_start_loc, p.meta.kv_start_loc, 4, scale)
