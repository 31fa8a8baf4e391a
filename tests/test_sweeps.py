"""The sweeps cover what they claim, and the command line's filters reshape them as documented."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest
import torch

from mla_bench.layouts import LAYOUTS
from mla_bench.problem import build_problem
from mla_bench.registry import Capabilities, ImplNotInstalled, discover
from mla_bench.workload import Mode, Workload
from suites import sweeps
from suites.base import RunContext


def _ctx(**fields) -> RunContext:
    return RunContext(impls=[], device=torch.device(fields.pop("device", "cpu")), **fields)


def test_tiny_sweep_covers_the_edges():
    tiny = sweeps.tiny()
    assert {w.mode for w in tiny} == set(Mode)
    decode = [w for w in tiny if w.mode is Mode.DECODE]
    assert {w.query_len_kind for w in decode} == {"single", "uniform", "varlen"}
    assert any(0 in w.kv_lens for w in decode)                                       # an empty request
    assert any(max(w.q_lens) != w.q_lens[-1] for w in decode)                        # last q_len is not the max
    assert {1, 16, 64, 13} <= {w.page_size for w in decode}                          # incl. non power of two
    on_boundary = [w for w in decode if any(kv and kv % w.page_size == 0 for kv in w.kv_lens) and w.page_size > 1]
    off_boundary = [w for w in decode if any(kv % w.page_size for kv in w.kv_lens)]
    assert on_boundary and off_boundary
    sparse = [w for w in tiny if w.mode.sparse]
    assert any(w.topk > min(w.kv_lens) for w in sparse)                               # -1 padded index lists
    assert {w.index_transform for w in sparse} == {"paged", "ragged"}
    assert {(w.mode, w.index_transform) for w in sparse} == {(m, t) for m in (Mode.SPARSE_DECODE, Mode.SPARSE_PREFILL)
                                                             for t in ("paged", "ragged")}
    assert any(0 in w.kv_lens for w in sparse)                                        # an empty request
    dcp = [w for w in tiny if w.mode is Mode.DCP]                                     # a rank holding none of a
    assert any(kv < w.dcp_world * w.dcp_interleave for w in dcp for kv in w.kv_lens)  # request's tokens
    assert all(w.dims.num_heads == 4 for w in tiny)


def test_gpu_sweep_is_serving_shapes():
    gpu = sweeps.gpu()
    decode = [w for w in gpu if w.mode is Mode.DECODE]
    assert {w.dims.num_heads for w in decode} == {16, 128}
    assert {w.batch for w in decode} == {1, 32, 128} and {max(w.kv_lens) for w in decode} == {4096, 8192, 16384}
    assert {w.page_size for w in decode} == {64} and any(w.mode is Mode.PREFILL for w in gpu)


@cache
def _topk_indices(workload: Workload) -> torch.Tensor:
    return build_problem(workload).topk_indices  # cached: gpu and gpu-quick share their padded workloads


@pytest.mark.parametrize("name", ["gpu", "gpu-quick"])
def test_gpu_sweeps_pad_sparse_index_lists(name):
    """Every request of the serving shapes saw top-k keys or more, so no index list held -1 on a GPU: engines'
    handling of it, and of requests shorter than top-k, went untested there. Now each sparse (preset, mode, layout,
    transform) of the sweep has a workload with short requests (built here on the CPU: their rows carry -1): an
    empty decode request (a row of -1 only) and prompts whose first tokens see fewer than top-k keys."""
    sparse = [w for w in sweeps.SWEEPS[name]() if w.mode.sparse]
    short = [w for w in sparse if min(w.kv_lens) < w.topk]  # only these can carry -1 (and are small to build)
    kinds = {(w.preset, w.mode, w.layout, w.index_transform) for w in sparse}
    assert {(w.preset, w.mode, w.layout, w.index_transform) for w in short} == kinds
    for w in short:
        requests = torch.split(_topk_indices(w), list(w.q_lens))  # each request's rows
        assert any(bool((rows == -1).any()) for rows in requests), w.label
        if w.mode is Mode.SPARSE_DECODE:
            assert any(kv == 0 and bool((rows == -1).all()) for kv, rows in zip(w.kv_lens, requests)), w.label
        else:
            assert any(len(rows) > 1 and bool((rows[0] == -1).any()) for rows in requests), w.label


def test_select_picks_the_sweep_from_preset_and_device():
    assert all(w.preset == "tiny" for w in sweeps.select(_ctx()))
    assert sweeps.default_sweep(None, "cuda") == "gpu" and sweeps.default_sweep("tiny", "cuda") == "tiny"
    kimi = sweeps.select(_ctx(preset="kimi-k2", sweep="gpu-quick"))
    assert kimi and all(w.preset == "kimi-k2" for w in kimi)
    assert {w.batch for w in kimi if w.mode is Mode.DECODE} == {1, 32}


def test_a_gpu_sweep_refuses_the_tiny_preset_instead_of_building_others():
    with pytest.raises(ValueError, match="sweep gpu-quick takes the presets deepseek-v3, .*not 'tiny'"):
        sweeps.select(_ctx(preset="tiny", sweep="gpu-quick"))
    assert "tiny" in sweeps.sweep_presets("tiny") and "tiny" not in sweeps.sweep_presets("gpu")


@pytest.mark.parametrize("fields, message", [
    (dict(preset="tinyy"), "unknown preset 'tinyy'"),
    (dict(sweep="x"), "unknown sweep 'x'"),
    (dict(modes=["decod"]), "unknown mode 'decod'; modes: decode, prefill"),
    (dict(modes=["Decode"]), "unknown mode 'Decode'"),
    (dict(modes=["prefill"], layouts=["nope"]), "unknown cache layout 'nope'"),  # even where no workload reads it
    (dict(page_sizes=[16, 0]), "page_size must be a positive int, got 0"),
    (dict(seed=-1), "seed must be an int >= 0"),
    (dict(seed=2 ** 32), "seed must be an int >= 0 and < 2**32"),  # torch's generator keeps 32 bits of a seed
    (dict(dcp_interleave=4), "--dcp-interleave applies to decode context parallel runs only"),
])
def test_check_filters_refuses_what_no_workload_can_take(fields, message):
    with pytest.raises(ValueError) as info:
        sweeps.check_filters(_ctx(**fields))
    assert message in str(info.value)


def test_check_filters_accepts_the_largest_seed_the_generator_takes():
    sweeps.check_filters(_ctx(seed=2 ** 32 - 1, modes=["decode"], layouts=["fp8_ds_mla"], page_sizes=[1],
                              dcp_world=2, dcp_interleave=4))


def test_filters_keep_modes_and_rerun_layouts_and_page_sizes():
    only = sweeps.select(_ctx(modes=["prefill"]))
    assert only and {w.mode for w in only} == {Mode.PREFILL}
    paged = sweeps.select(_ctx(modes=["decode", "prefill"], page_sizes=[1, 32], seed=7))
    decode = [w for w in paged if w.mode is Mode.DECODE]
    assert {w.page_size for w in decode} == {1, 32} and all(w.seed == 7 for w in paged)
    assert len({w.key for w in paged}) == len(paged)                                  # no duplicates
    assert {w.page_size for w in paged if w.mode is Mode.PREFILL} == {64}             # prefill reads no cache


def test_dcp_turns_the_decode_workloads_into_sharded_ones():
    plain = [w for w in sweeps.select(_ctx()) if w.mode is Mode.DECODE]
    dcp = sweeps.select(_ctx(dcp_world=3, dcp_interleave=2))
    assert dcp and {(w.mode, w.dcp_world, w.dcp_interleave) for w in dcp} == {(Mode.DCP, 3, 2)}
    assert {(w.q_lens, w.kv_lens, w.layout, w.page_size) for w in plain} <= \
        {(w.q_lens, w.kv_lens, w.layout, w.page_size) for w in dcp}
    with pytest.raises(ValueError, match="--dcp applies to decode workloads"):
        sweeps.as_dcp(next(w for w in sweeps.select(_ctx()) if w.mode is Mode.PREFILL), 2)


def test_shards_split_without_overlap():
    items = list(range(11))
    parts = [sweeps.shard(items, _ctx(shard=i, shards=3)) for i in range(3)]
    assert sorted(sum(parts, [])) == items and all(parts)


TINIEST_DECODE = ((1, 1), (9, 20))  # the tiny sweep's smallest decode (q_lens, kv_lens)


def test_conformance_bends_heads_and_page_sizes_to_the_smallest_declared_ones():
    caps = Capabilities(modes={"decode"}, head_counts=frozenset({64, 128}), page_sizes=frozenset({64}))
    bent = sweeps.conformance(caps)
    assert {w.dims.num_heads for w in bent if w.mode is not Mode.DECODE} == {64}
    assert {w.page_size for w in bent if w.mode.uses_cache} == {64}
    assert len({w.key for w in bent}) == len(bent)


def test_conformance_checks_the_largest_head_count_and_page_size_once_on_the_smallest_decode():
    """Only the smallest declared head count and page size were checked: a kernel that breaks at its largest head
    count (another head tile) or page size, or at a page size that is not a power of two, passed. Each is one more
    test, on the smallest shape; the values in between add none."""
    caps = Capabilities(modes={"decode"}, head_counts=frozenset({64, 96, 128}),
                        page_sizes=frozenset({16, 24, 48, 64, 128}))
    bent = sweeps.conformance(caps)
    extra = [w for w in bent if w.dims.num_heads == 128 or w.page_size in (24, 128)]
    assert sorted((w.dims.num_heads, w.page_size) for w in extra) == [(64, 24), (64, 128), (128, 16)]
    assert {(w.mode, w.q_lens) for w in extra} == {(Mode.DECODE, TINIEST_DECODE[0])}
    assert {w.kv_lens for w in extra} == {TINIEST_DECODE[1], (33, 44), (137, 148)}  # for a page size, a page longer
    assert len(bent) == len(sweeps.tiny()) + len(extra)
    assert not any(w.dims.num_heads == 96 or w.page_size == 48 for w in bent)


def test_conformance_checks_every_declared_dtype_in_every_declared_mode():
    """No workload of the tiny sweep is float16: an impl that declares it was never checked in it."""
    caps = Capabilities(modes={"decode", "chunked_prefill"}, dtypes={"bfloat16", "float16"})
    half = [w for w in sweeps.conformance(caps) if w.dtype == "float16"]
    assert sorted(w.mode.value for w in half) == ["chunked_prefill", "decode"]
    assert all(caps.refusal(w, "cpu") is None for w in half)
    assert not any(w.dtype == "float16" for w in sweeps.conformance(replace(caps, dtypes={"bfloat16"})))


def test_conformance_puts_the_cache_where_an_impl_keeps_it_off_the_cpu():
    """On a GPU an impl with its cache in host memory only was refused every workload (the cache was put with the
    queries) and tested on nothing. On a CPU host nothing changes; an impl taking either placement gets the host
    cache once, on the smallest decode."""
    host_only = Capabilities(modes={"decode"}, cache_devices={"cpu"})
    on_gpu = sweeps.conformance(host_only, "cuda")
    assert {w.cache_device for w in on_gpu if w.mode.uses_cache} == {"cpu"}
    assert {w.cache_device for w in on_gpu if not w.mode.uses_cache} == {None}
    assert all(w.cache_device is None for w in sweeps.conformance(host_only, "cpu"))
    either = sweeps.conformance(replace(host_only, cache_devices={"cpu", "cuda"}), "cuda")
    assert [(w.mode, w.q_lens, w.kv_lens) for w in either if w.cache_device] == [(Mode.DECODE, *TINIEST_DECODE)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # capabilities read the device type only: no GPU needed
def test_conformance_gives_every_builtin_impl_each_mode_and_dtype_it_declares(device):
    for name, entry in sorted(discover().items()):
        try:
            caps = entry.load().capabilities
        except ImplNotInstalled:
            continue
        if device in caps.devices:
            accepted = {(w.mode, w.dtype) for w in sweeps.conformance(caps, device) if caps.refusal(w, device) is None}
            assert accepted == {(mode, dtype) for mode in caps.modes for dtype in caps.dtypes}, name


EDGE_PAGES = frozenset({1, 13, 16, 64})  # the tiny sweep's page sizes: none bends


def test_conformance_gives_an_fp8_only_decode_impl_the_edge_cases_in_its_layout():
    """The tiny sweep's decode edge cases are bf16: an impl declaring fp8_ds_mla alone was checked on the sweep's one
    FP8 workload (and it a page longer at pages 1, 13 and 64), never on an empty request, lengths on page boundaries,
    or single and uniform queries. Each bf16 decode workload it accepts moves, in its place, to fp8_ds_mla."""
    caps = Capabilities(modes={"decode"}, layouts={"fp8_ds_mla"}, page_sizes=EDGE_PAGES)
    bent = sweeps.conformance(caps)
    accepted = [w for w in bent if caps.refusal(w, "cpu") is None]
    assert {w.layout for w in accepted} == {"fp8_ds_mla"}
    assert any(0 in w.kv_lens for w in accepted) and {1, 13, 16, 64} <= {w.page_size for w in accepted}
    assert {w.query_len_kind for w in accepted} == {"single", "uniform", "varlen"}
    assert any(w.query_len_kind == "varlen" and 0 in w.kv_lens for w in accepted)
    moved = [w.replace(layout="fp8_ds_mla") if w.mode is Mode.DECODE and w.layout == "bf16" and w.dtype == "bfloat16"
             else w for w in sweeps.tiny()]  # the float32 one stays: the impl refuses float32
    assert [w.key for w in bent] == [w.key for w in moved]


@pytest.mark.parametrize("layouts", [{"bf16"}, {"bf16", "fp8_ds_mla"}, set(LAYOUTS)])
def test_conformance_moves_no_workload_of_an_impl_that_declares_bf16(layouts):
    """An impl that declares bf16 takes the sweep's edge cases there: its workloads stay the tiny sweep's as they
    were (same keys, same order), none copied to its other layouts."""
    caps = Capabilities(modes={"decode"}, layouts=layouts, page_sizes=EDGE_PAGES)
    assert [w.key for w in sweeps.conformance(caps)] == [w.key for w in sweeps.tiny()]
