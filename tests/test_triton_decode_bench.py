"""The decode benchmark's own pieces that run without a GPU: its correctness sweep covers what the issue asks,
its device-drawn timing problems are valid inputs (the kernel on one matches float64 attention), and a profile
narrows to the layouts asked for."""

from __future__ import annotations

import pytest
import torch

from suites.bench_decode import LAYOUTS, PROFILES, Shape, config_check_workload, correctness_workloads, \
    select_entries, timing_problem, triton_impl
from mla_bench.layouts import NOPE_DIM
from mla_bench.layouts.ops import gather_cache
from reference.core import attend


def test_the_correctness_sweep_covers_every_layout_page_size_and_query_mode():
    workloads = correctness_workloads()
    assert {w.layout for w in workloads} == set(LAYOUTS)
    assert {1, 7, 16, 32, 48, 64, 128} <= {w.page_size for w in workloads}
    q_modes = {"single" if set(w.q_lens) == {1} else "uniform" if len(set(w.q_lens)) == 1 else "varlen"
               for w in workloads}
    assert q_modes == {"single", "uniform", "varlen"}
    assert {16, 20, 32, 64, 128} <= {w.dims.num_heads for w in workloads}
    assert any(0 in w.kv_lens for w in workloads) and max(max(w.kv_lens) for w in workloads) >= 128 * 1024


def test_config_checks_use_the_shapes_heads_layout_page_size_and_query_length():
    shape = Shape(128, 64, 4096, q_len=2, page_size=1, layout="nvfp4")
    w = config_check_workload(shape)
    assert (w.dims.num_heads, w.layout, w.page_size, set(w.q_lens)) == (128, "nvfp4", 1, {2})


def test_a_timing_problem_is_a_valid_input():
    shape = Shape(16, 2, 45, q_len=2, page_size=16, layout="fp8_ds_mla")
    problem = timing_problem(shape, torch.device("cpu"), seed=1)
    impl = triton_impl(None)
    out, lse = impl.run(impl.checked_plan(problem))
    keys = gather_cache(problem.cache, problem.meta.token_slots)
    for t in range(4):  # query token t of request t // 2 sees 44 + t % 2 keys
        k = keys[45 * (t // 2):45 * (t // 2) + 44 + t % 2]
        ref_out, ref_lse = attend(problem.q[t:t + 1], k[:, None], k[:, None, :NOPE_DIM], None, problem.scale)
        assert torch.allclose(out[t].double(), ref_out[0], rtol=2e-2, atol=2e-2)
        assert torch.allclose(lse[t].double(), ref_lse[0], atol=1e-3)


def test_a_profile_narrows_to_the_layouts_asked_for():
    chosen = select_entries(PROFILES["rows64"], ["nvfp4", "mxfp4_nsa"])
    assert {shape.layout for shape, _ in chosen} == {"nvfp4", "mxfp4_nsa"}
    assert len(chosen) == sum(shape.layout in ("nvfp4", "mxfp4_nsa") for shape, _ in PROFILES["rows64"])
    assert select_entries(PROFILES["rows64"], None) is PROFILES["rows64"]
    with pytest.raises(ValueError, match=r"unknown layouts \['fp4'\]"):
        select_entries(PROFILES["rows64"], ["nvfp4", "fp4"])
    with pytest.raises(ValueError, match="no shape of the layouts"):
        select_entries(PROFILES["ncu"], ["mxfp4_nsa"])
