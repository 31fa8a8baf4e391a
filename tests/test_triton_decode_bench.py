"""The decode benchmark's own pieces that run without a GPU: its correctness sweep covers what the issue asks,
its device-drawn timing problems are valid inputs (the kernel on one matches float64 attention), a profile
narrows to the layouts asked for, and a quantized row's time is put against bf16's at its own shape."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from impls.triton.decode import DecodeConfig
from suites.bench_decode import LAYOUTS, PROFILES, Shape, against_bf16, config_check_workload, config_label, \
    correctness_workloads, print_table, select_entries, timing_problem, triton_impl
from mla_bench.layouts import NOPE_DIM
from mla_bench.layouts.ops import gather_cache
from reference.core import attend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the kernels take CPU tensors only interpreted


def test_the_correctness_sweep_covers_every_layout_page_size_and_query_mode():
    workloads = correctness_workloads()
    assert {w.layout for w in workloads} == set(LAYOUTS)
    assert {1, 7, 16, 32, 48, 64, 128} <= {w.page_size for w in workloads}
    q_modes = {"single" if set(w.q_lens) == {1} else "uniform" if len(set(w.q_lens)) == 1 else "varlen"
               for w in workloads}
    assert q_modes == {"single", "uniform", "varlen"}
    assert {16, 20, 32, 64, 128} <= {w.dims.num_heads for w in workloads}
    assert any(0 in w.kv_lens for w in workloads) and max(max(w.kv_lens) for w in workloads) >= 128 * 1024


def test_a_config_label_says_when_the_split_kernel_is_launched_without_the_overlap():
    assert config_label(DecodeConfig(overlap_launch=False)).endswith(" no-overlap")
    assert "overlap" not in config_label(DecodeConfig())


def test_config_checks_use_the_shapes_heads_layout_page_size_and_query_length():
    shape = Shape(128, 64, 4096, q_len=2, page_size=1, layout="nvfp4")
    w = config_check_workload(shape)
    assert (w.dims.num_heads, w.layout, w.page_size, set(w.q_lens)) == (128, "nvfp4", 1, {2})


@pytest.mark.parametrize("heads, preset", [(16, "deepseek-v3-tp8"), (64, "kimi-k2"), (128, "deepseek-v3"),
                                           (32, "deepseek-v3"), (20, "deepseek-v3")])
def test_a_shape_of_any_head_count_makes_its_workload(heads, preset):
    """Shapes of the presets' head counts take those presets; any other count, DeepSeek-V3's with its heads."""
    shape = Shape(heads, 4, 300, q_len=2)
    for w in (shape.workload(), config_check_workload(shape)):
        assert (w.preset, w.dims.num_heads) == (preset, heads)


def test_a_timing_problem_is_a_valid_input():
    shape = Shape(16, 2, 45, q_len=2, page_size=16, layout="fp8_ds_mla")
    problem = timing_problem(shape, DEVICE, seed=1)
    impl = triton_impl(None)
    out, lse = impl.run(impl.plan(problem))
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


def _record(shape: Shape, ms: float, impl: str = "triton", default: bool = True) -> dict:
    """A latency record as ``run_latency`` writes it, with only what the table and the ratio read."""
    return {"shape": asdict(shape), "label": shape.label, "impl": impl, "config": "c",
            "default": default and impl == "triton", "ms": ms,
            "GBps": 1.0, "copy_fraction": 0.5, "TFLOPs": 1.0, "floor_ms": ms / 2, "copy_same_bytes_ms": ms / 2}


def test_a_quantized_row_is_timed_against_the_bf16_default_of_its_own_shape(capsys):
    bf16_b64, bf16_b128 = _record(Shape(16, 64, 4096), 0.1126), _record(Shape(16, 128, 4096), 0.2091)
    other_config = _record(Shape(16, 64, 4096), 0.0999, default=False)  # not the default: not the base
    peer = _record(Shape(16, 64, 4096), 0.0500, impl="flashinfer_mla")
    fp8 = _record(Shape(16, 64, 4096, layout="fp8_ds_mla"), 0.0730)
    fp8_b128 = _record(Shape(16, 128, 4096, layout="fp8_ds_mla"), 0.1321)
    paged = _record(Shape(16, 64, 4096, page_size=128, layout="fp8_ds_mla"), 0.0723)  # no bf16 at page 128
    peer_fp8 = _record(Shape(16, 64, 4096, layout="fp8_ds_mla"), 0.0600, impl="flashinfer_mla")
    bf16_b64["copy_fraction"] = 0.8992  # just under the 0.90: the table must not round it up
    records = [fp8, bf16_b128, bf16_b64, other_config, peer, fp8_b128, paged, peer_fp8]  # a wrong base comes last
    against_bf16(records)
    assert fp8["x_bf16"] == pytest.approx(0.0730 / 0.1126)
    assert fp8_b128["x_bf16"] == pytest.approx(0.1321 / 0.2091)
    assert not {"x_bf16"} & (paged.keys() | peer_fp8.keys() | bf16_b64.keys() | other_config.keys())
    print_table(records)
    rows = {(line[:34].strip(), line[35:].split()[0]): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows[fp8["label"], "default"].endswith(f"{0.0730 / 0.1126:6.3f}x")
    assert rows[bf16_b64["label"], "default"][35:].split()[4] == "0.899"  # which, config, us, GB/s, copy
    assert not rows[peer_fp8["label"], "flashinfer_mla"].rstrip().endswith("x")
    assert not rows[paged["label"], "default"].rstrip().endswith("x")


def test_every_quantized_shape_of_the_final_profile_has_its_bf16_shape_beside_it():
    shapes = {shape for shape, _ in PROFILES["final"]}
    quantized = {shape for shape in shapes if shape.layout != "bf16" and shape.heads == 16 and shape.q_len == 1}
    assert {(s.batch, s.ctx) for s in quantized if s.layout == "fp8_ds_mla"} >= {(64, 4096), (128, 4096), (64, 16384)}
    assert all(Shape(**{**asdict(s), "layout": "bf16"}) in shapes for s in quantized)
