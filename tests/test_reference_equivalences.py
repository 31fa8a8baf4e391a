"""The float64 reference agrees with itself across formulations: each identity here could fail."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from mla_bench.dims import PRESETS
from reference.absorbed import latent_mqa
from reference.chunked import chunked_prefill, context_lens, prefill_with_context
from reference.core import attend, causal_visible, ragged_attention
from reference.dcp import dcp_latent_mqa
from reference.layer import MLAWeights, mla_layer_absorbed, mla_layer_mha, rope
from reference.merge import merge_attn_states, merge_many
from reference.mha import mha_attention, mha_keys
from reference.sparse import indexed_latent_mqa, sparse_latent_mqa

MIXES = {
    "decode": ((1, 1, 1), (37, 64, 5)),
    "mtp": ((3, 3), (64, 20)),
    "prefill": ((20, 7), (20, 7)),
    "varlen with context": ((5, 1, 0, 8), (100, 64, 9, 8)),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@functools.lru_cache(maxsize=None)
def layer_setup(preset: str, seed: int):
    """Weights and hidden states per preset (a small hidden size keeps them light; heads and ranks are the
    preset's own), shared by the request mixes."""
    dims = dataclasses.replace(PRESETS[preset], hidden_size=256)
    g = gen(seed)
    weights = MLAWeights.random(dims, g)
    hidden = torch.randn(max(sum(kv) for _, kv in MIXES.values()), dims.hidden_size, generator=g, dtype=torch.float64)
    return dims, weights, hidden


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_mha_path_equals_absorbed_path(preset, mix):
    q_lens, kv_lens = MIXES[mix]
    dims, weights, hidden = layer_setup(preset, 11)
    hidden = hidden[:sum(kv_lens)]
    out_mha, lse_mha = mla_layer_mha(weights, dims, hidden, q_lens, kv_lens)
    out_abs, lse_abs = mla_layer_absorbed(weights, dims, hidden, q_lens, kv_lens)
    assert out_mha.shape == (sum(q_lens), dims.hidden_size)
    assert rel(out_abs, out_mha) < 1e-12
    assert float((lse_abs - lse_mha).abs().max()) < 1e-12


@pytest.mark.parametrize("layer", [mla_layer_mha, mla_layer_absorbed])
@pytest.mark.parametrize("q_lens, kv_lens, rows, message", [
    # a layer's new tokens are keys: no padding rows
    ((2, 1), (0, 5), 5, "request 0: query longer than context \\(q_len=2 > kv_len=0\\)"),
    ((1, 2), (4, 1), 5, "request 1: query longer than context"),
    ((1, 1.0), (4, 3), 7, "q_lens must hold ints, got 1.0"),
    ((1, True), (4, 3), 7, "q_lens must hold ints, got True"),
    ((1,), (4, 3), 7, "q_lens has 1 requests but kv_lens has 2"),
    ((1, 1), (4, 3), 6, "hidden is \\[6, 256\\]; expected \\[sum\\(kv_lens\\) = 7"),
])
def test_bad_layer_lengths_are_named(layer, q_lens, kv_lens, rows, message):
    dims, weights, hidden = layer_setup("tiny", 11)
    with pytest.raises(ValueError, match=message):
        layer(weights, dims, hidden[:rows], q_lens, kv_lens)


def test_the_layer_depends_on_its_weights_and_positions():
    q_lens, kv_lens = MIXES["varlen with context"]
    dims, weights, hidden = layer_setup("tiny", 11)
    hidden = hidden[:sum(kv_lens)]
    out = mla_layer_mha(weights, dims, hidden, q_lens, kv_lens)[0]
    other = mla_layer_mha(layer_setup("tiny", 12)[1], dims, hidden, q_lens, kv_lens)[0]
    assert rel(other, out) > 0.1
    # the same tokens as one request instead of four: other positions and other keys, other output
    merged = mla_layer_mha(weights, dims, hidden, (sum(q_lens),), (sum(kv_lens),))[0]
    assert merged.shape == out.shape and rel(merged, out) > 0.1


def test_rope_rotates_by_position_so_scores_depend_on_the_distance_only():
    """Position 0 leaves a vector as it is, each pair keeps its length, and q . k is the same when both move by the
    same offset but not when one moves alone. (The layer identity above cannot see RoPE: both paths share it.)"""
    g = gen(13)
    q, k = (torch.randn(5, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
    pos_q, pos_k = torch.randint(0, 4096, (5,), generator=g), torch.randint(0, 4096, (5,), generator=g)
    assert torch.equal(rope(q, torch.zeros(5, dtype=torch.int64), 10000.0), q)
    pairs = lambda x: x.view(*x.shape[:-1], 32, 2).norm(dim=-1)  # noqa: E731
    assert torch.allclose(pairs(rope(q, pos_q, 10000.0)), pairs(q), rtol=1e-12)
    score = lambda a, b: (rope(q, a, 10000.0) * rope(k, b, 10000.0)).sum(-1)  # noqa: E731
    assert torch.allclose(score(pos_q + 777, pos_k + 777), score(pos_q, pos_k), rtol=1e-9, atol=1e-9)
    assert not torch.allclose(score(pos_q + 777, pos_k), score(pos_q, pos_k), rtol=1e-3, atol=1e-3)


def random_mha_step(q_lens, kv_lens, heads=3, seed=0):
    """New-token MHA inputs, a context latent and up-projection weights, all float64."""
    g = gen(seed)
    t, n_ctx = sum(q_lens), sum(context_lens(q_lens, kv_lens))
    return dict(
        q=torch.randn(t, heads, 192, generator=g, dtype=torch.float64),
        k_nope=torch.randn(t, heads, 128, generator=g, dtype=torch.float64),
        k_pe=torch.randn(t, 64, generator=g, dtype=torch.float64),
        v=torch.randn(t, heads, 128, generator=g, dtype=torch.float64),
        context=torch.randn(n_ctx, 576, generator=g, dtype=torch.float64),
        w_uk=torch.randn(heads, 512, 128, generator=g, dtype=torch.float64) / 512 ** 0.5,
        w_uv=torch.randn(heads, 512, 128, generator=g, dtype=torch.float64) / 512 ** 0.5,
    )


def test_chunked_prefill_equals_unchunked_for_every_chunk_size():
    q_lens, kv_lens = (3, 2, 4), (16, 2, 11)  # contexts 13, 0 and 7 tokens
    step = random_mha_step(q_lens, kv_lens)
    scale = 0.135
    expect_out, expect_lse = prefill_with_context(**step, q_lens=q_lens, kv_lens=kv_lens, scale=scale)
    for chunk in range(1, max(kv_lens) + 3):
        out, lse = chunked_prefill(**step, q_lens=q_lens, kv_lens=kv_lens, scale=scale, chunk_size=chunk)
        assert rel(out, expect_out) < 1e-12, chunk
        assert float((lse - expect_lse).abs().max()) < 1e-12, chunk


def test_chunked_prefill_that_drops_a_chunk_is_different():
    q_lens, kv_lens = (2,), (30,)
    step = random_mha_step(q_lens, kv_lens, seed=1)
    full = chunked_prefill(**step, q_lens=q_lens, kv_lens=kv_lens, scale=0.1, chunk_size=8)[0]
    step["context"] = step["context"][:24]  # the last chunk lost
    with pytest.raises(ValueError, match="context has 24 tokens"):
        chunked_prefill(**step, q_lens=q_lens, kv_lens=kv_lens, scale=0.1, chunk_size=8)
    truncated = chunked_prefill(**step, q_lens=q_lens, kv_lens=(24 + 2,), scale=0.1, chunk_size=8)[0]
    assert rel(truncated, full) > 1e-3


def random_latent_step(q_lens, kv_lens, heads=4, seed=0):
    g = gen(seed)
    q = torch.randn(sum(q_lens), heads, 576, generator=g, dtype=torch.float64) * 0.5
    kv = torch.randn(sum(kv_lens), 576, generator=g, dtype=torch.float64)
    return q, kv


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("interleave", [1, 2, 16])
def test_dcp_equals_single_rank(world, interleave):
    # Lengths include shards that hold nothing (5 tokens over 8 ranks), a padding request and MTP queries.
    q_lens, kv_lens = (1, 3, 1, 2), (37, 70, 5, 0)
    q, kv = random_latent_step(q_lens, kv_lens, seed=world * 100 + interleave)
    expect_out, expect_lse = latent_mqa(q, kv, q_lens, kv_lens, 0.135)
    out, lse = dcp_latent_mqa(q, kv, q_lens, kv_lens, 0.135, world, interleave)
    assert torch.isfinite(out).all()
    assert rel(out, expect_out) < 1e-12
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expect_lse))
    finite = torch.isfinite(expect_lse)
    assert float((lse[finite] - expect_lse[finite]).abs().max()) < 1e-12


def test_sparse_with_every_index_equals_dense():
    q_lens, kv_lens = (1, 1, 4), (30, 9, 12)
    q, kv = random_latent_step(q_lens, kv_lens, seed=3)
    g = gen(4)
    rows = []
    for q_len, kv_len in zip(q_lens, kv_lens):
        for i in range(q_len):
            visible = kv_len - q_len + i + 1
            order = torch.randperm(visible, generator=g)
            rows.append(torch.cat([order, torch.full((30 - visible,), -1)]))
    indices = torch.stack(rows).to(torch.int32)
    out, lse = sparse_latent_mqa(q, kv, indices, q_lens, kv_lens, 0.135)
    expect_out, expect_lse = latent_mqa(q, kv, q_lens, kv_lens, 0.135)
    assert rel(out, expect_out) < 1e-12
    assert float((lse - expect_lse).abs().max()) < 1e-12


@pytest.mark.parametrize("invalid", [-1, -(2 ** 31), -123456, 40, 2 ** 31 - 1])
def test_sparse_subset_equals_dense_restricted_to_it_and_ignores_invalid_indices(invalid):
    kv_len = 40
    q, kv = random_latent_step((1,), (kv_len,), seed=5)
    subset = torch.randperm(kv_len, generator=gen(6))[:13]
    padded = torch.cat([subset, torch.full((7,), invalid)])[torch.randperm(20, generator=gen(7))]
    out, lse = sparse_latent_mqa(q, kv, padded[None].to(torch.int64), (1,), (kv_len,), 0.135)
    visible = torch.zeros(1, kv_len, dtype=torch.bool)
    visible[0, subset] = True
    expect_out, expect_lse = attend(q, kv[:, None], kv[:, None, :512], visible, 0.135)
    assert rel(out, expect_out) < 1e-12
    assert float((lse - expect_lse).abs().max()) < 1e-12


def test_sparse_bound_is_each_requests_own_length():
    """Index kv_len of a request that is not the last names a real row (the next request's first): invalid all the
    same, as -1 is."""
    q, kv = random_latent_step((1, 1), (40, 5), seed=9)
    indices = torch.tensor([[3, 40, 11, 39], [0, 4, 5, 1]], dtype=torch.int64)
    got = sparse_latent_mqa(q, kv, indices, (1, 1), (40, 5), 0.135)
    invalid = torch.tensor([[False, True, False, False], [False, False, True, False]])
    expect = sparse_latent_mqa(q, kv, torch.where(invalid, -1, indices), (1, 1), (40, 5), 0.135)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])


def test_sparse_of_no_requests_is_empty():
    q, kv = torch.randn(0, 2, 576, dtype=torch.float64), torch.randn(0, 576, dtype=torch.float64)
    out, lse = sparse_latent_mqa(q, kv, torch.zeros(0, 4, dtype=torch.int64), (), (), 0.135)
    assert out.shape == (0, 2, 512) and lse.shape == (0, 2)


def test_sparse_row_without_valid_index_is_empty():
    q, kv = random_latent_step((2,), (10,), seed=8)
    indices = torch.tensor([[-1, -1, 10], [3, -1, -1]], dtype=torch.int32)
    out, lse = sparse_latent_mqa(q, kv, indices, (2,), (10,), 0.135)
    assert bool((out[0] == 0).all()) and bool(torch.isneginf(lse[0]).all())
    assert torch.isfinite(lse[1]).all()


def test_sparse_without_any_key_is_empty():
    """A batch of padding requests (kv_len 0) has no key row at all: every query row is out 0, lse -inf, by both
    sparse entry points (they indexed the absent row 0 and raised IndexError)."""
    q = torch.randn(3, 2, 576, generator=gen(11), dtype=torch.float64)
    kv = torch.randn(0, 576, dtype=torch.float64)
    indices = torch.randint(-3, 8, (3, 5), generator=gen(12), dtype=torch.int32)
    for out, lse in (sparse_latent_mqa(q, kv, indices, (2, 1), (0, 0), 0.135),
                     indexed_latent_mqa(q, kv, indices, 0.135)):
        assert out.shape == (3, 2, 512) and bool((out == 0).all()) and bool(torch.isneginf(lse).all())


def test_non_causal_calls_take_more_queries_than_keys():
    """New tokens over one chunk of context (vLLM's context pass): without a causal mask a request may have more
    queries than keys, and each sees all of them; with the mask such a request is still refused."""
    q_lens, kv_lens = (6, 2, 3), (4, 5, 0)
    q, kv = random_latent_step(q_lens, kv_lens, seed=13)
    g = gen(14)
    k_nope = torch.randn(9, 4, 128, generator=g, dtype=torch.float64)
    v = torch.randn(9, 4, 128, generator=g, dtype=torch.float64)
    latent = latent_mqa(q, kv, q_lens, kv_lens, 0.135, causal=False)
    ragged = ragged_attention(q, kv[:, None], kv[:, None, :512], q_lens, kv_lens, 0.135, causal=False)
    mha = mha_attention(q[..., :192], k_nope, kv[:, 512:], v, q_lens, kv_lens, 0.135, causal=False)
    for request, rows, keys in ((0, slice(0, 6), slice(0, 4)), (1, slice(6, 8), slice(4, 9))):
        expect = attend(q[rows], kv[keys, None], kv[keys, None, :512], None, 0.135)
        expect_mha = attend(q[rows, :, :192], mha_keys(k_nope[keys], kv[keys, 512:]), v[keys], None, 0.135)
        for (out, lse), (want_out, want_lse) in ((latent, expect), (ragged, expect), (mha, expect_mha)):
            assert rel(out[rows], want_out) < 1e-12, request
            assert float((lse[rows] - want_lse).abs().max()) < 1e-12, request
    for out, lse in (latent, ragged, mha):  # the padding request's rows see nothing
        assert bool((out[8:] == 0).all()) and bool(torch.isneginf(lse[8:]).all())
    with pytest.raises(ValueError, match="query longer than context"):
        latent_mqa(q, kv, q_lens, kv_lens, 0.135)


def split_attention(parts: int, seed: int):
    """Attention over 30 keys, and the partial attentions over ``parts`` disjoint key groups."""
    q, kv = random_latent_step((5,), (30,), seed=seed)
    k, v = kv[:, None], kv[:, None, :512]
    groups = torch.randperm(30, generator=gen(seed)).tensor_split(parts)
    partials = []
    for group in groups:
        visible = torch.zeros(5, 30, dtype=torch.bool)
        visible[:, group] = True
        partials.append(attend(q, k, v, visible, 0.135))
    return attend(q, k, v, None, 0.135), partials


def test_merge_is_associative_commutative_and_equals_the_union():
    (full_out, full_lse), (a, b, c) = split_attention(3, seed=9)
    left = merge_attn_states(*merge_attn_states(*a, *b), *c)
    right = merge_attn_states(*a, *merge_attn_states(*b, *c))
    swapped = merge_attn_states(*merge_attn_states(*c, *a), *b)
    for out, lse in (left, right, swapped, merge_many([a, b, c])):
        assert rel(out, full_out) < 1e-12
        assert float((lse - full_lse).abs().max()) < 1e-12


def test_merge_treats_plus_inf_as_empty_and_never_makes_nan():
    _, (a, b) = split_attention(2, seed=10)
    empty_out = torch.full_like(a[0], float("nan"))  # whatever an empty partial holds must not leak
    for empty_lse in (float("inf"), float("-inf")):
        lse = torch.full_like(a[1], empty_lse)
        out, merged_lse = merge_attn_states(*a, empty_out.nan_to_num(0.0), lse)
        assert torch.equal(out, a[0]) and torch.equal(merged_lse, a[1])
    out, lse = merge_attn_states(torch.zeros_like(a[0]), torch.full_like(a[1], float("inf")),
                                 torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


def test_causal_mask_aligns_queries_to_the_end_of_the_keys():
    assert causal_visible(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
