"""Per-request lengths: Workload, the reference and the Triton decode plan take and refuse the same ones, alike.

They used to check by three rule sets: plan_decode took a bool as a length and named neither the request of a
negative length nor the counts of a mismatch; Workload and the reference refused numpy ints that plan_decode took.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from impls.triton.decode import plan_decode
from mla_bench.layouts import PagedCache, get_layout
from mla_bench.lengths import check_kv_lens, check_page_size
from mla_bench.metadata import reference
from mla_bench.problem import build_problem
from mla_bench.workload import Workload
from reference.absorbed import latent_mqa

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # plan_decode takes CPU tensors only in the interpreter


def random_lengths(rng: random.Random) -> tuple[list[int], list[int]]:
    """A valid decode mix of 2-5 requests, a padding request (no context, one query) among them now and then."""
    kv_lens = [rng.choice([0, rng.randint(1, 70)]) for _ in range(rng.randint(2, 5))]
    return [rng.randint(1, min(kv, 4)) if kv else 1 for kv in kv_lens], kv_lens


def plan(q_lens, kv_lens, visible_lens=None, problem_q_lens=(1, 2)):
    """plan_decode of the lengths given over a decode problem of ``problem_q_lens`` tokens (up to 40 keys each)."""
    problem = build_problem(Workload(mode="decode", q_lens=problem_q_lens, kv_lens=(40,) * len(problem_q_lens),
                                     page_size=16, seed=random.randrange(100)), DEVICE)
    return plan_decode(problem.q, problem.cache, problem.meta.block_table, q_lens, kv_lens, problem.scale,
                       visible_lens)


CALLERS = {
    "workload": lambda q_lens, kv_lens: Workload(mode="decode", q_lens=q_lens, kv_lens=kv_lens),
    "reference": lambda q_lens, kv_lens: latent_mqa(torch.randn(3, 2, 576, dtype=torch.float64),
                                                    torch.randn(10, 576, dtype=torch.float64), q_lens, kv_lens, 0.1),
    "plan_decode": plan,
}


def negative(rng, q_lens, kv_lens, i):
    kv_lens[i] = -rng.randint(1, 9)
    return rf"request {i}: lengths must be >= 0, got q_len={q_lens[i]}, kv_len={kv_lens[i]}$"


def longer_query(rng, q_lens, kv_lens, i):
    kv_lens[i] = rng.randint(1, 9)
    q_lens[i] = kv_lens[i] + rng.randint(1, 3)
    return rf"request {i}: query longer than context \(q_len={q_lens[i]} > kv_len={kv_lens[i]}\)$"


def float_length(rng, q_lens, kv_lens, i):
    kv_lens[i] += 0.5 + rng.randint(0, 3)
    return rf"request {i}: kv_lens must hold ints, got {kv_lens[i]}$"


def bool_length(rng, q_lens, kv_lens, i):
    q_lens[i] = True
    return rf"request {i}: q_lens must hold ints, got True$"


def bool_tensor_length(rng, q_lens, kv_lens, i):
    q_lens[i] = torch.tensor(True)  # operator.index took it as 1
    return rf"request {i}: q_lens must hold ints, got tensor\(True\)$"


def count_mismatch(rng, q_lens, kv_lens, i):
    kv_lens.append(rng.randint(1, 9))
    return rf"q_lens has {len(q_lens)} requests but kv_lens has {len(kv_lens)}$"


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("plant", [negative, longer_query, float_length, bool_length, bool_tensor_length,
                                   count_mismatch])
def test_bad_lengths_are_refused_alike_naming_the_request(plant, caller):
    rng = random.Random()
    q_lens, kv_lens = random_lengths(rng)
    message = plant(rng, q_lens, kv_lens, rng.randrange(len(q_lens)))
    with pytest.raises(ValueError, match=message):
        CALLERS[caller](tuple(q_lens), tuple(kv_lens))


def test_numpy_lengths_are_taken_as_ints():
    q_lens, kv_lens = random_lengths(random.Random())
    workload = Workload(mode="decode", q_lens=np.array(q_lens), kv_lens=[np.int32(n) for n in kv_lens])
    assert workload.q_lens == tuple(q_lens) and workload.kv_lens == tuple(kv_lens)
    assert all(type(n) is int for n in workload.q_lens + workload.kv_lens)  # noqa: E721 - JSON needs Python ints
    problem = build_problem(workload)
    q, kv = problem.q.double(), torch.randn(sum(kv_lens), 576, dtype=torch.float64)
    for got, want in zip(latent_mqa(q, kv, np.array(q_lens), np.array(kv_lens), 0.1),
                         latent_mqa(q, kv, q_lens, kv_lens, 0.1)):
        assert torch.equal(got, want)


def test_only_a_shard_may_have_queries_longer_than_its_keys():
    """With ``visible_lens`` (a DCP shard's keys) plan_decode takes q_len > kv_len; without, it is refused."""
    kv = random.randint(1, 8)
    with pytest.raises(ValueError, match=rf"request 1: query longer than context \(q_len={kv + 1} > kv_len={kv}\)"):
        plan((1, kv + 1), (9, kv), problem_q_lens=(1, kv + 1))
    visible = torch.tensor([9, *range(1, kv + 1), kv], dtype=torch.int32, device=DEVICE)
    assert plan((1, kv + 1), (9, kv), visible, problem_q_lens=(1, kv + 1)).visible is visible


@pytest.mark.parametrize("call", [check_kv_lens, lambda kv_lens: reference.allocate_block_table(
    kv_lens, 4, torch.Generator().manual_seed(0))])
@pytest.mark.parametrize("kv_lens, says", [
    ([3, 1.0], "request 1: kv_lens must hold ints, got 1.0"),
    ([3, -1], "request 1: kv_len must be >= 0, got -1"),
    ("12", "kv_lens must be a sequence of ints, got '12'"),
])
def test_kv_lens_alone_are_refused_naming_kv_lens(call, kv_lens, says):
    """Builders that take only kv_lens name them in the message, not q_lens or a q_len they were not given."""
    with pytest.raises(ValueError, match=re.escape(says)):
        call(kv_lens)


def test_numpy_page_sizes_are_taken_alike():
    """A numpy int page size passes the page-size rule and ``PagedCache.empty``; a bool or a float neither."""
    assert PagedCache.empty(get_layout("bf16"), 2, np.int64(4)).page_size == 4
    check_page_size(np.int32(4))
    for bad in (True, 4.0, 0):
        with pytest.raises(ValueError, match=re.escape(f"page_size must be a positive int, got {bad!r}")):
            check_page_size(bad)
        with pytest.raises(ValueError, match=re.escape(f"page_size must be a positive int, got {bad!r}")):
            PagedCache.empty(get_layout("bf16"), 2, bad)


@pytest.mark.parametrize("q_lens, says", [
    ({3, 1}, "q_lens must be a sequence of ints in request order, not a set"),
    ({3: 0, 1: 0}, "q_lens must be a sequence of ints in request order, not a dict"),
    (torch.tensor(2), "q_lens must be a sequence of ints in one dimension, got 0"),
    (torch.tensor([[1], [2]]), "q_lens must be a sequence of ints in one dimension, got 2"),
])
def test_lengths_without_one_request_order_are_refused(q_lens, says):
    """A set or dict was taken in its iteration order (pairing q_lens with kv_lens by it), a 0-d tensor failed with a
    bare TypeError, a 2-D tensor's rows passed as ints where a 2-D numpy array was refused."""
    kv_lens = tuple(random.randint(3, 9) for _ in range(2))
    with pytest.raises(ValueError, match=re.escape(says)):
        Workload(mode="decode", q_lens=q_lens, kv_lens=kv_lens)


@pytest.mark.parametrize("mode, field, extra", [
    ("decode", "num_heads", {}), ("decode", "page_size", {}), ("decode", "seed", {}),
    ("sparse_decode", "topk", {}), ("chunked_prefill", "chunk_size", {}),
    ("dcp", "dcp_world", {"dcp_interleave": 1}), ("dcp", "dcp_interleave", {"dcp_world": 2}),
])
def test_numpy_ints_are_taken_by_every_workload_field_as_by_the_lengths(mode, field, extra):
    """np.int64 q_lens were taken but a numpy num_heads, page_size, topk, seed or chunk_size refused; they are taken
    alike and stored as Python ints (the workload serializes)."""
    value = random.choice([1, 2, 4])
    fields = {"topk": 2} if mode == "sparse_decode" else {"chunk_size": 8} if mode == "chunked_prefill" else {}
    fields.update(extra, **{field: np.int64(value)})
    w = Workload(mode=mode, q_lens=(1, 1), kv_lens=(9, 12), **fields)
    assert type(getattr(w, field)) is int and getattr(w, field) == value
    assert Workload.from_dict(json.loads(json.dumps(w.to_dict()))) == w
    assert Workload.uniform("decode", np.int64(value), 1, 5).batch == value


def test_numpy_dcp_fields_of_one_outside_dcp_are_stored_as_ints():
    """Outside mode dcp a numpy 1 passed the (1, 1) comparison and was kept: the label and to_dict failed to
    serialize (review of 3176da7)."""
    w = Workload(mode="decode", q_lens=(1,), kv_lens=(random.randint(2, 9),), dcp_world=np.int64(1),
                 dcp_interleave=np.int64(1))
    assert (type(w.dcp_world), type(w.dcp_interleave)) == (int, int) and json.dumps(w.to_dict()) and w.label


@pytest.mark.parametrize("kv_lens", [(2 ** 31,), (2 ** 30, 2 ** 30)])
def test_cached_tokens_past_the_int32_offsets_are_refused_by_the_workload(kv_lens):
    """kv_lens=(2**31,) was taken, then build_problem failed on torch's int32 overflow."""
    with pytest.raises(ValueError, match=rf"{sum(kv_lens)} cached tokens must each fit the metadata's int32 offsets"):
        Workload(mode="decode", q_lens=(1,) * len(kv_lens), kv_lens=kv_lens)
