"""The reference refuses bad input with an error naming the problem, before any work."""

from __future__ import annotations

import re
from fractions import Fraction

import numpy
import pytest
import torch

from mla_bench.problem import build_problem
from mla_bench.workload import Workload
from reference.absorbed import latent_mqa, paged_latent_mqa
from reference.chunked import chunked_prefill, prefill_with_context
from reference.core import attend, ragged_attention
from reference.dcp import dcp_latent_mqa
from reference.dcp_reorg import local_index, part_positions, reorg
from reference.merge import merge_attn_states, merge_many
from reference.mha import mha_attention
from reference.sparse import indexed_latent_mqa, sparse_latent_mqa

Q = torch.randn(3, 2, 576, dtype=torch.float64)
KV = torch.randn(10, 576, dtype=torch.float64)


@pytest.mark.parametrize("call, message", [
    (lambda: latent_mqa(Q[..., :575], KV, (3,), (10,), 0.1), "q must have last dimension 576"),
    (lambda: latent_mqa(Q, KV[:, None], (3,), (10,), 0.1), "kv must have 2 dimensions"),
    (lambda: latent_mqa(Q.long(), KV, (3,), (10,), 0.1), "q must be a float16, bfloat16, float32 or float64"),
    (lambda: latent_mqa(Q, KV, (3,), (9,), 0.1), "sum\\(kv_lens\\)=9"),
    (lambda: latent_mqa(Q, KV, (3, 0), (10,), 0.1), "q_lens has 2 requests"),
    (lambda: latent_mqa(Q, KV, (-3,), (10,), 0.1), "must be >= 0"),
    (lambda: latent_mqa(Q, KV[:2], (3,), (2,), 0.1), "query longer than context"),
    (lambda: attend(Q, KV[:, None].to("meta"), KV[:, None, :512], None, 0.1), "different devices"),
    (lambda: attend(Q, KV[:, None], KV[:5, None, :512], None, 0.1), "matching N"),
    (lambda: mha_attention(torch.randn(3, 2, 192), torch.randn(10, 3, 128), torch.randn(10, 64),
                           torch.randn(10, 3, 128), (3,), (10,), 0.1), "query heads"),
    (lambda: sparse_latent_mqa(Q, KV, torch.zeros(3, 4), (3,), (10,), 0.1), "int32/int64"),
    (lambda: sparse_latent_mqa(Q, KV, torch.zeros(2, 4, dtype=torch.int32), (3,), (10,), 0.1), "2 rows"),
    (lambda: dcp_latent_mqa(Q, KV, (3,), (10,), 0.1, 0, 1), "world must be a positive int"),
    (lambda: dcp_latent_mqa(Q, KV, (3,), (10,), 0.1, 2, 0), "interleave must be a positive int"),
    (lambda: chunked_prefill(torch.randn(1, 2, 192), torch.randn(1, 2, 128), torch.randn(1, 64),
                             torch.randn(1, 2, 128), torch.randn(4, 576), torch.randn(2, 512, 128),
                             torch.randn(2, 512, 128), (1,), (5,), 0.1, 0), "chunk_size must be a positive int"),
    (lambda: merge_attn_states(torch.randn(3, 2, 8), torch.randn(3, 2), torch.randn(3, 2, 4), torch.randn(3, 2)),
     "shapes differ"),
    (lambda: dcp_latent_mqa(Q, KV[:, :300], (3,), (10,), 0.1, 2, 1), "kv must have last dimension 576"),
    (lambda: dcp_latent_mqa(Q[..., :300], KV[:, :300], (3,), (10,), 0.1, 2, 1), "q must have last dimension 576"),
    (lambda: attend(Q, KV[:, None], KV[:, None, :512], torch.ones(3, 10, dtype=torch.int64), 0.1),
     "visible must be a bool tensor \\(or None\\), got torch.int64"),
    (lambda: attend(Q, KV[:, None], KV[:, None, :512], torch.ones(3, 10), 0.1),
     "visible must be a bool tensor \\(or None\\), got torch.float32"),
    (lambda: attend(Q, KV[:, None], KV[:, None, :512], [[True] * 10] * 3, 0.1),
     "visible must be a bool tensor \\(or None\\), got list"),
])
def test_bad_reference_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def f64(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


PREFILL_LENS = ((1, 2), (4, 6))  # q_lens, kv_lens


def prefill_step(heads: int = 2) -> dict[str, torch.Tensor]:
    """Fresh inputs of a prefill with context for PREFILL_LENS: 3 new tokens, 7 context tokens."""
    return dict(q=f64(3, heads, 192), k_nope=f64(3, heads, 128), k_pe=f64(3, 64), v=f64(3, heads, 128),
                context=f64(7, 576), w_uk=f64(heads, 512, 128) / 512 ** 0.5, w_uv=f64(heads, 512, 128) / 512 ** 0.5)


def chunked(inputs: dict, scale, lens=PREFILL_LENS) -> tuple[torch.Tensor, torch.Tensor]:
    return chunked_prefill(**inputs, q_lens=lens[0], kv_lens=lens[1], scale=scale, chunk_size=3)


def unchunked(inputs: dict, scale, lens=PREFILL_LENS) -> tuple[torch.Tensor, torch.Tensor]:
    return prefill_with_context(**inputs, q_lens=lens[0], kv_lens=lens[1], scale=scale)


@pytest.mark.parametrize("prefill", [chunked, unchunked])
@pytest.mark.parametrize("name, cut, message", [
    ("q", lambda t: torch.cat([t, t[:2]]), r"q must have shape \[3, 2, 192\], got \[5, 2, 192\]"),
    ("k_nope", lambda t: t[:2], r"k_nope must have shape \[3, 2, 128\], got \[2, 2, 128\]"),
    ("k_pe", lambda t: t[:2], r"k_pe must have shape \[3, 64\], got \[2, 64\]"),
    ("v", lambda t: t[:2], r"v must have shape \[3, 2, 128\], got \[2, 2, 128\]"),
    ("w_uk", lambda t: t[..., :100], r"w_uk must have shape \[2, 512, 128\], got \[2, 512, 100\]"),
    ("w_uv", lambda t: t[:1], r"w_uv must have shape \[2, 512, 128\], got \[1, 512, 128\]"),
    ("context", lambda t: t[:, :512], r"context must have last dimension 576, got shape \[7, 512\]"),
])
def test_prefill_with_context_names_the_tensor_of_a_wrong_shape(prefill, name, cut, message):
    """Extra query rows were answered 0 / -inf, short keys failed on a mask, a narrow w_uk inside einsum."""
    inputs = prefill_step()
    inputs[name] = cut(inputs[name])
    with pytest.raises(ValueError, match=message):
        prefill(inputs, 0.1)


@pytest.mark.parametrize("call", [
    lambda q, rows, idx: indexed_latent_mqa(q, rows, idx, 0.1),
    lambda q, rows, idx: sparse_latent_mqa(q, rows, idx, (3,), (10,), 0.1),
], ids=["indexed", "sparse"])
@pytest.mark.parametrize("bad, message", [
    (dict(idx=torch.full((3, 4), -1.0) + 0.7), r"must be int32/int64 \[T, topk\], got torch.float32 \[3, 4\]"),
    (dict(idx=torch.zeros(3, dtype=torch.int64)), r"must be int32/int64 \[T, topk\], got torch.int64 \[3\]"),
    (dict(idx=[[0] * 4] * 3), r"must be int32/int64 \[T, topk\], got list"),
    (dict(idx=torch.zeros(2, 4, dtype=torch.int64)), r"has 2 rows for q.shape\[0\]=3"),
    (dict(q=f64(3, 2, 512)), r"q must have last dimension 576, got shape \[3, 2, 512\]"),
    (dict(q=f64(3, 576)), r"q must have 3 dimensions"),
    (dict(rows=f64(10, 512)), r"must have last dimension 576, got shape \[10, 512\]"),
])
def test_indexed_and_sparse_references_validate_alike(call, bad, message):
    """A float index -1 + 0.7 used to truncate to the valid 0; 1-D indices and wrong widths failed inside torch."""
    inputs = {"q": f64(3, 2, 576), "rows": f64(10, 576), "idx": torch.randint(-1, 10, (3, 4)), **bad}
    with pytest.raises(ValueError, match=message):
        call(inputs["q"], inputs["rows"], inputs["idx"])


def test_rows_the_indices_do_not_select_may_hold_poison():
    """PAGED indices address every cache slot, unused (NaN) ones too: only the rows named are checked."""
    q, rows = f64(3, 2, 576), f64(10, 576)
    idx = torch.randint(0, 6, (3, 4))
    clean = indexed_latent_mqa(q, rows, idx, 0.1)
    rows[6:] = float("nan")
    poisoned = indexed_latent_mqa(q, rows, idx, 0.1)
    assert torch.equal(clean[0], poisoned[0]) and torch.equal(clean[1], poisoned[1])
    idx[torch.randint(3, ()), torch.randint(4, ())] = 7
    with pytest.raises(ValueError, match=r"rows \(the rows the indices select\) holds NaN or inf \(576 of "):
        indexed_latent_mqa(q, rows, idx, 0.1)


ABSORBED_LENS = ((1, 2), (4, 6))
ALL_POSITIONS = torch.arange(6).repeat(3, 1)  # every position of every request (past kv_len: invalid, skipped)

# Every public float64 entry point: fresh float inputs, and a call on them with a scale (and lengths, where it
# takes them: ``lens``, (q_lens, kv_lens)).
ENTRY_POINTS = {
    "attend": (lambda: dict(q=f64(3, 2, 16), k=f64(5, 1, 16), v=f64(5, 1, 8)),
               lambda x, scale: attend(x["q"], x["k"], x["v"], None, scale)),
    "ragged_attention": (lambda: dict(q=f64(3, 2, 16), k=f64(10, 2, 16), v=f64(10, 2, 8)),
                         lambda x, scale, lens=ABSORBED_LENS: ragged_attention(x["q"], x["k"], x["v"], *lens, scale)),
    "latent_mqa": (lambda: dict(q=f64(3, 2, 576), kv=f64(10, 576)),
                   lambda x, scale, lens=ABSORBED_LENS: latent_mqa(x["q"], x["kv"], *lens, scale)),
    "dcp_latent_mqa": (lambda: dict(q=f64(3, 2, 576), kv=f64(10, 576)),
                       lambda x, scale, lens=ABSORBED_LENS: dcp_latent_mqa(x["q"], x["kv"], *lens, scale, 2, 2)),
    "sparse_latent_mqa": (lambda: dict(q=f64(3, 2, 576), kv=f64(10, 576)),
                          lambda x, scale, lens=ABSORBED_LENS: sparse_latent_mqa(x["q"], x["kv"], ALL_POSITIONS,
                                                                                 *lens, scale)),
    "indexed_latent_mqa": (lambda: dict(q=f64(3, 2, 576), rows=f64(10, 576)),
                           lambda x, scale: indexed_latent_mqa(x["q"], x["rows"], torch.arange(10).repeat(3, 1),
                                                               scale)),
    "mha_attention": (lambda: dict(q=f64(3, 2, 192), k_nope=f64(10, 2, 128), k_pe=f64(10, 64), v=f64(10, 2, 128)),
                      lambda x, scale, lens=ABSORBED_LENS: mha_attention(x["q"], x["k_nope"], x["k_pe"], x["v"],
                                                                         *lens, scale)),
    "chunked_prefill": (prefill_step, chunked),
    "prefill_with_context": (prefill_step, unchunked),
}
TAKES_LENGTHS = sorted(set(ENTRY_POINTS) - {"attend", "indexed_latent_mqa"})


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_refuses_a_non_finite_input_by_name(entry):
    """NaN or inf anywhere in an input gave a NaN answer (or none at all where it was masked): now an error."""
    make, call = ENTRY_POINTS[entry]
    out, lse = call(make(), 0.1)
    assert bool(torch.isfinite(out).all())
    for name in make():
        for bad in (float("nan"), float("inf"), float("-inf")):
            inputs = make()
            flat = inputs[name].view(-1)
            flat[torch.randint(flat.numel(), ())] = bad
            with pytest.raises(ValueError, match=rf"^{re.escape(name)}\b.* holds NaN or inf \(1 of {flat.numel()} "):
                call(inputs, 0.1)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("scale", ["0.1", torch.tensor(0.1), 0, -0.1, float("nan"), float("inf"), True, None])
def test_every_entry_point_refuses_a_bad_scale(entry, scale):
    make, call = ENTRY_POINTS[entry]
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        call(make(), scale)


@pytest.mark.parametrize("entry", TAKES_LENGTHS)
def test_lengths_given_as_iterators_give_the_answer_of_tuples(entry):
    """The checks spent a one-shot iterator and the loops after them saw no request: every row 0 / -inf."""
    make, call = ENTRY_POINTS[entry]
    inputs = make()
    lens = call.__defaults__[0]
    expect = call(inputs, 0.1, lens)
    got = call(inputs, 0.1, tuple(iter(part) for part in lens))
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])
    assert bool(torch.isfinite(expect[1]).any())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_float8_input_is_refused_by_name(dtype):
    """float8 passed the floating-point check and failed inside torch.isfinite."""
    with pytest.raises(ValueError, match=f"q must be a float16, bfloat16, float32 or float64 tensor .*got {dtype}"):
        latent_mqa(Q.to(dtype), KV, (3,), (10,), 0.1)


@pytest.mark.parametrize("rows, uses", [((2, 3), "[3, 2]"), ((3, 1), "[3, 2]"), ((4, 2), "[3, 2]")])
def test_dcp_reorg_names_parts_of_the_wrong_length(rows, uses):
    """Positions 0-4 at W=2, I=1: rank 0 holds 0, 2, 4 and rank 1 holds 1, 3. A short part was an IndexError."""
    parts = [f64(n, 576) for n in rows]
    with pytest.raises(ValueError, match=re.escape(f"reorg: parts hold {list(rows)} rows, the chunk uses {uses}")):
        reorg(parts, [(0, 0, 5)], 2, 1)


@pytest.mark.parametrize("call, says", [
    (lambda: reorg([], [(0, 0, 5)], 0, 1), "world must be a positive int, got 0"),
    (lambda: reorg([f64(5, 576)], [(0, 0, 5)], 1, 0), "interleave must be a positive int, got 0"),
    (lambda: reorg([f64(2, 576), f64(1, 576)], [(0, 0, 1), (1, -2, 0)], 2, 1),
     "piece 1 (request 1) must have 0 <= start <= end, got start=-2, end=0"),
    (lambda: reorg([f64(0, 576), f64(0, 576)], [(0, 3, 1)], 2, 1),
     "piece 0 (request 0) must have 0 <= start <= end, got start=3, end=1"),
    (lambda: part_positions([(0, 0, 5)], 0, 2, 0), "interleave must be a positive int, got 0"),
    (lambda: part_positions([(0, -1, 5)], 0, 2, 1), "piece 0 (request 0) must have 0 <= start <= end"),
    (lambda: local_index(3, 0, 0, 1), "world must be a positive int, got 0"),
    (lambda: local_index(-2, 0, 2, 1), "position must be >= 0, got -2"),
])
def test_dcp_reorg_refuses_a_world_or_interleave_of_zero_and_negative_positions(call, says):
    """World or interleave 0 was a ZeroDivisionError; a negative position was given a rank as if it were a token
    (reorg took parts for positions -2 and -1), and local_index of one was 0."""
    with pytest.raises(ValueError, match=re.escape(says)):
        call()


def test_world_interleave_and_chunk_size_take_numpy_ints_as_lengths_do():
    """The world, interleave and chunk-size checks refused numpy ints ('world must be a positive int, got 2') that
    q_lens / kv_lens take."""
    dcp = dcp_latent_mqa(Q, KV, (3,), (10,), 0.1, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(dcp_latent_mqa(Q, KV, (3,), (10,), 0.1, numpy.int64(2),
                                                                 numpy.int32(2)), dcp))
    inputs = prefill_step()
    expect = chunked(inputs, 0.1)
    got = chunked_prefill(**inputs, q_lens=PREFILL_LENS[0], kv_lens=PREFILL_LENS[1], scale=0.1,
                          chunk_size=numpy.int64(3))
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])
    parts = [f64(3, 576), f64(2, 576)]
    assert torch.equal(reorg(parts, [(0, 0, 5)], numpy.int64(2), numpy.int16(1)), reorg(parts, [(0, 0, 5)], 2, 1))
    with pytest.raises(ValueError, match=re.escape("world must be a positive int, got True")):
        dcp_latent_mqa(Q, KV, (3,), (10,), 0.1, True, 1)


def test_a_nan_in_the_paged_cache_or_the_queries_is_named():
    problem = build_problem(Workload(mode="decode", q_lens=(1, 2), kv_lens=(5, 9), page_size=4,
                                     seed=int(torch.randint(1000, ()))))
    paged_latent_mqa(problem.q, problem.cache, problem.meta, problem.scale)
    problem.cache.rows()[problem.meta.token_slots[torch.randint(14, ())]] = 0xFF  # a written bf16 slot reads NaN
    with pytest.raises(ValueError, match=r"kv holds NaN or inf \(576 of "):
        paged_latent_mqa(problem.q, problem.cache, problem.meta, problem.scale)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        paged_latent_mqa(problem.q, problem.cache, problem.meta, "0.1")


def merge_parts(count: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(f64(4, 3, 8), f64(4, 3) * 3) for _ in range(count)]


@pytest.mark.parametrize("parts, message", [
    (lambda: [], "merge: no parts to merge"),
    (lambda: merge_parts(2) + [(f64(5, 3, 8), f64(5, 3))], r"shapes differ: part 2 has out \[5, 3, 8\]"),
    (lambda: merge_parts(1) + [(f64(4, 3, 8), f64(4, 2))], r"shapes differ: part 1 has out \[4, 3, 8\], lse \[4, 2\]"),
    (lambda: [(f64(4, 3, 8).float(), f64(4, 3, 1))], "part 0 lse must have 2 dimensions"),
])
def test_merge_refuses_no_parts_and_parts_of_other_shapes(parts, message):
    with pytest.raises(ValueError, match=message):
        merge_many(parts())


@pytest.mark.parametrize("tensor, message", [(1, r"part \d lse holds NaN"), (0, r"part \d out holds NaN or inf")])
def test_merge_refuses_a_nan_lse_and_a_non_finite_out_of_a_non_empty_row(tensor, message):
    """A NaN lse came back as out 0 (masked into a plausible zero) with lse NaN."""
    parts = merge_parts(3)
    part = parts[int(torch.randint(3, ()))]
    row, head = int(torch.randint(4, ())), int(torch.randint(3, ()))
    part[tensor][row, head] = float("nan")
    with pytest.raises(ValueError, match=message):
        merge_many(parts)


def test_merge_keeps_its_empty_part_conventions():
    """-inf and +inf mark an empty part, whose out may be anything: merged as absent, never refused."""
    (out_a, lse_a), (out_b, lse_b) = merge_parts(2)
    row = int(torch.randint(4, ()))
    lse_b[row], out_b[row] = float("-inf"), float("nan")
    lse_a[(row + 1) % 4], out_a[(row + 1) % 4] = float("inf"), float("inf")
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[row], out_a[row]) and torch.equal(lse[row], lse_a[row])
    assert torch.equal(out[(row + 1) % 4], out_b[(row + 1) % 4])


def test_a_softmax_scale_past_float32s_range_is_refused_as_the_kernels_would_make_nan():
    """scale=1e39 is finite in float64, where the reference computed a plausible answer; every kernel computes
    scale * log2(e) in float32, where it is inf (mla_decode gave NaN)."""
    scale = float(numpy.random.default_rng().uniform(2.4e38, 1e300))
    with pytest.raises(ValueError, match=r"softmax scale must be at most 2\.35866e\+38 \(float32's largest value"):
        latent_mqa(torch.randn(3, 2, 576, dtype=torch.float64), torch.randn(10, 576, dtype=torch.float64), (3,),
                   (10,), scale)


@pytest.mark.parametrize("entry", sorted(set(ENTRY_POINTS) - {"sparse_latent_mqa", "indexed_latent_mqa"}))
def test_every_entry_point_refuses_inputs_on_the_meta_device_by_name(entry):
    """Meta inputs passed the structural checks and failed inside the value check ('Tensor.item() cannot be called on
    meta tensors'). (The sparse entries take cpu indices, which meta inputs are refused beside as another device.)"""
    make, call = ENTRY_POINTS[entry]
    inputs = {name: t.to("meta") for name, t in make().items()}
    with pytest.raises(ValueError, match=r"^\w+ is on the meta device, which holds no values(; |$)"):
        call(inputs, 0.1)


def test_sparse_references_and_merge_refuse_meta_tensors_by_name():
    q, kv, idx = f64(3, 2, 576).to("meta"), f64(10, 576).to("meta"), torch.randint(-1, 10, (3, 4), device="meta")
    says = r"^q is on the meta device, which holds no values; "
    with pytest.raises(ValueError, match=says):
        indexed_latent_mqa(q, kv, idx, 0.1)
    with pytest.raises(ValueError, match=says):
        sparse_latent_mqa(q, kv, idx, (3,), (10,), 0.1)
    with pytest.raises(ValueError, match=r"^merge: part 1 out is on the meta device, which holds no values; part 1 "):
        merge_many([(f64(3, 2, 8), f64(3, 2)), (f64(3, 2, 8).to("meta"), f64(3, 2).to("meta"))])


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_takes_a_fraction_scale_as_its_value(entry):
    """Fraction(1, 10) passed the scale check (a numbers.Real) and raised TypeError inside torch."""
    make, call = ENTRY_POINTS[entry]
    inputs = make()
    got, expect = call(inputs, Fraction(1, 10)), call(inputs, 0.1)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])


@pytest.mark.parametrize("causal", [None, 0, 1, "yes"])
@pytest.mark.parametrize("call", [
    lambda causal: latent_mqa(f64(3, 2, 576), f64(10, 576), *ABSORBED_LENS, 0.1, causal=causal),
    lambda causal: ragged_attention(f64(3, 2, 16), f64(10, 2, 16), f64(10, 2, 8), *ABSORBED_LENS, 0.1, causal),
    lambda causal: mha_attention(f64(3, 2, 192), f64(10, 2, 128), f64(10, 64), f64(10, 2, 128), *ABSORBED_LENS, 0.1,
                                 causal=causal),
], ids=["latent_mqa", "ragged_attention", "mha_attention"])
def test_causal_must_be_a_bool(call, causal):
    """causal=None (or 0) silently meant non-causal: every query saw its request's future keys."""
    with pytest.raises(ValueError, match=f"^causal must be a bool, got {re.escape(repr(causal))}$"):
        call(causal)


def test_merge_many_takes_any_iterable_of_parts():
    """A generator of parts raised TypeError: object of type 'generator' has no len()."""
    parts = [(f64(4, 3, 8), f64(4, 3)) for _ in range(3)]
    expect = merge_many(parts)
    got = merge_many(part for part in parts)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])


@pytest.mark.parametrize("world, interleave, name", [(2, 10 ** 30, "interleave"), (2 ** 70, 1, "world"),
                                                     (2 ** 63, 1, "world"), (2, 2 ** 63, "interleave")])
def test_dcp_refuses_a_world_or_interleave_past_int64_by_name(world, interleave, name):
    """interleave=10**30 raised OverflowError from torch, world=2**70 "Overflow when unpacking long long"."""
    q, kv = f64(3, 2, 576), f64(10, 576)
    with pytest.raises(ValueError, match=f"^{name} must be at most {2 ** 63 - 1}, as token positions and ranks are "
                                         f"int64, got {world if name == 'world' else interleave}$"):
        dcp_latent_mqa(q, kv, *ABSORBED_LENS, 0.1, world, interleave)
    whole = dcp_latent_mqa(q, kv, *ABSORBED_LENS, 0.1, 2, 2 ** 63 - 1)  # the largest interleave: rank 0 holds all
    single = dcp_latent_mqa(q, kv, *ABSORBED_LENS, 0.1, 1, 1)
    assert torch.allclose(whole[0], single[0]) and torch.allclose(whole[1], single[1])
