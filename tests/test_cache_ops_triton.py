"""The Triton cache ops: bit-level helpers against the reference formats, the write/gather API, and planted bugs.

The per-layout byte equality of the kernels is exercised by the roundtrip suite (tests/test_roundtrip_suite.py);
here each conversion helper is checked on many values at once (one interpreted program per helper), and the
Python API on its edge cases.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from impls.triton import cache_ops_kernels as K
from impls.triton.cache_ops import gather_cache_triton, triton_unavailable, write_cache_triton
from mla_bench.errors import UnsupportedConfig
from mla_bench.layouts import LAYOUTS, LATENT_DIM, PagedCache, get_layout
from mla_bench.layouts.formats import bf16_bytes, ceil_log2, e2m1_encode, e4m3_decode, e4m3_encode, ue8m0_decode
from mla_bench.layouts.fp8 import FP8DSMLALayout
from mla_bench.layouts.ops import gather_cache
from suites.roundtrip import check_write, latent_values

pytestmark = pytest.mark.skipif(triton_unavailable("cuda" if torch.cuda.is_available() else "cpu") is not None,
                                reason="Triton cannot run here")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 1024 if DEVICE == "cuda" else 1 << 16  # one interpreted program does it all on CPU


@triton.jit
def _float_to_code_kernel(x_ptr, den_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    den = tl.load(den_ptr + offs, mask=inside, other=1.0)
    if OP == 0:
        out = K._e4m3_code(x)
    elif OP == 1:
        out = K._bf16_bits(x)
    elif OP == 2:
        out = K._e2m1_code_away(x, den)
    elif OP == 3:
        out = K._e2m1_code_even(x, den)
    else:
        out = K._bits(K._pow2_ceil(x))
    tl.store(out_ptr + offs, out, mask=inside)


@triton.jit
def _code_to_float_kernel(code_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    code = tl.load(code_ptr + offs, mask=inside, other=0)
    if OP == 0:
        out = K._e4m3_value(code)
    elif OP == 1:
        out = K._ue8m0_value(code)
    else:
        out = K._e2m1_value(code)
    tl.store(out_ptr + offs, out, mask=inside)


def float_to_code(op: int, x: torch.Tensor, den: torch.Tensor | None = None) -> torch.Tensor:
    x = x.float().contiguous().to(DEVICE)
    den = (torch.ones_like(x) if den is None else den.float().expand_as(x).contiguous()).to(DEVICE)
    out = torch.empty(x.shape, dtype=torch.int32, device=DEVICE)
    _float_to_code_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, den, out, x.numel(), OP=op, BLOCK=BLOCK)
    return out.cpu()


def code_to_float(op: int, codes: torch.Tensor) -> torch.Tensor:
    codes = codes.to(torch.int32).contiguous().to(DEVICE)
    out = torch.empty(codes.shape, dtype=torch.float32, device=DEVICE)
    _code_to_float_kernel[(triton.cdiv(codes.numel(), BLOCK),)](codes, out, codes.numel(), OP=op, BLOCK=BLOCK)
    return out.cpu()


def random_floats(n: int, seed: int) -> torch.Tensor:
    """fp32 values from random bit patterns: every exponent, subnormals, Inf, NaN of both signs."""
    bits = torch.randint(-2 ** 31, 2 ** 31, (n,), dtype=torch.int64, generator=torch.Generator().manual_seed(seed))
    return bits.to(torch.int32).view(torch.float32)


def e4m3_probe_values() -> torch.Tensor:
    """Every e4m3 value, every midpoint between neighbours and one fp32 ulp either side, both signs, saturation."""
    grid = torch.unique(e4m3_decode(torch.arange(256, dtype=torch.uint8)).float())
    grid = grid[torch.isfinite(grid)]
    mid = ((grid[1:].double() + grid[:-1].double()) / 2).float()
    near = torch.cat([mid, torch.nextafter(mid, torch.tensor(-1e9)), torch.nextafter(mid, torch.tensor(1e9))])
    special = torch.tensor([448.0, 449.0, 463.9, 464.0, 465.0, 1e30, float("inf"), float("nan"), 0.0, -0.0, 1e-45,
                            2.0 ** -6, 2.0 ** -7, 2.0 ** -10, 2.0 ** -10 * 1.0001, 3e38])
    values = torch.cat([grid, near, special])
    return torch.cat([values, -values, random_floats(200_000, 0)])


def test_e4m3_code_equals_the_reference_rounding_everywhere():
    x = e4m3_probe_values()
    assert torch.equal(float_to_code(0, x), e4m3_encode(x).to(torch.int32))


def test_bf16_bits_round_to_nearest_even_with_one_nan_pattern():
    x = torch.cat([random_floats(200_000, 1), torch.tensor([3.3961e38, 3.4e38, -float("nan"), 1e-40, -0.0])])
    expect = bf16_bytes(x).view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(float_to_code(1, x), expect)


def test_e2m1_codes_follow_both_tie_rules():
    gen = torch.Generator().manual_seed(2)
    magnitudes = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e-40])
    ratio = torch.cat([magnitudes, -magnitudes, torch.rand(50_000, generator=gen) * 14 - 7])
    # power-of-two denominators (MX) and arbitrary fp32 products (nvfp4's e4m3 scale times a global scale)
    pow2 = torch.exp2(torch.randint(-30, 30, ratio.shape, generator=gen).float())
    arbitrary = (torch.rand(ratio.shape, generator=gen) + 0.01) * pow2
    arbitrary[:5] = 0.0  # a zero scale encodes 0
    assert torch.equal(float_to_code(2, ratio * pow2, pow2), e2m1_encode(ratio * pow2, pow2, "away").to(torch.int32))
    x = (ratio * arbitrary).float()
    assert torch.equal(float_to_code(3, x, arbitrary), e2m1_encode(x, arbitrary, "even").to(torch.int32))


def test_pow2_ceil_is_exact_next_to_powers_of_two():
    x = random_floats(100_000, 3).abs()
    x = x[torch.isfinite(x) & (x >= torch.finfo(torch.float32).tiny) & (x < 2.0 ** 127)]
    x = torch.cat([x, torch.tensor([1.0, 2.0 ** -20, 2.0 ** 3 * (1 + 2 ** -23), 2.0 ** 3 * (1 - 2 ** -24)])])
    assert torch.equal(float_to_code(4, x), torch.exp2(ceil_log2(x).float()).view(torch.int32))


@pytest.mark.parametrize("op, decode", [(0, lambda c: e4m3_decode(c.to(torch.uint8))),
                                        (1, lambda c: ue8m0_decode(c.to(torch.uint8)))])
def test_every_scale_and_element_code_decodes_exactly(op, decode):
    codes = torch.arange(256)
    got, expect = code_to_float(op, codes), decode(codes).float()
    assert torch.equal(torch.isnan(got), torch.isnan(expect))
    finite = ~torch.isnan(expect)
    assert torch.equal(got[finite].view(torch.int32), expect[finite].view(torch.int32))  # -0.0 stays -0.0


def test_e2m1_values_including_negative_zero():
    expect = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    assert torch.equal(code_to_float(2, torch.arange(16)).view(torch.int32), expect.view(torch.int32))


# ---- the Python API -----------------------------------------------------------------------------------------------
def small_cache(name: str, values: torch.Tensor, blocks: int = 2, page: int = 4) -> PagedCache:
    layout = get_layout(name)
    return PagedCache.empty(layout, blocks, page, DEVICE, layout.fit_tensor_scale(values))


def test_padding_slots_are_skipped_and_unwritten_slots_stay_poisoned():
    values = latent_values(3, seed=4)
    slots = torch.tensor([5, -1, 0])
    cache = small_cache("fp8_ds_mla", values)
    write_cache_triton(cache, values.to(DEVICE), slots.to(DEVICE))
    rows = cache.rows().cpu()
    assert torch.equal(rows[5], cache.layout.quantize(values[:1])[0])
    assert torch.equal(rows[0], cache.layout.quantize(values[2:])[0])
    untouched = [s for s in range(cache.num_slots) if s not in (0, 5)]
    assert bool((rows[untouched] == 0xFF).all())


def test_nonfinite_inputs_are_refused_before_any_write_unless_propagated():
    values = latent_values(3, seed=5)
    values[2, 17] = float("nan")
    slots = torch.tensor([1, 2, 3], device=DEVICE)
    cache = small_cache("nvfp4", values[:2])
    with pytest.raises(ValueError, match=r"NaN/Inf input values \(first at token 2, column 17\)"):
        write_cache_triton(cache, values.to(DEVICE), slots)
    assert bool((cache.data == 0xFF).all())
    write_cache_triton(cache, values.to(DEVICE), slots, propagate_nonfinite=True)
    assert torch.equal(cache.rows()[1:4].cpu(), cache.layout.quantize(values, cache.tensor_scale,
                                                                      propagate_nonfinite=True))
    # a NaN in a padding row is never written, so it is no reason to refuse
    clean = small_cache("nvfp4", values[:2])
    write_cache_triton(clean, values.to(DEVICE), torch.tensor([1, 2, -1], device=DEVICE))


def test_gather_returns_fp32_and_bf16_of_the_exact_dequantization():
    values = latent_values(4, seed=6)
    for name in ("fp8_e4m3", "mxfp4_nsa"):
        cache = small_cache(name, values)
        write_cache_triton(cache, values.to(DEVICE), torch.tensor([7, 2, 4, 0], device=DEVICE))
        slots = torch.tensor([0, 2, 2, 7], device=DEVICE)
        exact = gather_cache(cache, slots)
        assert torch.equal(gather_cache_triton(cache, slots, torch.float32).cpu(), exact.float().cpu())
        assert torch.equal(gather_cache_triton(cache, slots).cpu(), exact.float().bfloat16().cpu())


@pytest.mark.parametrize("bad, message", [
    (dict(values=torch.zeros(2, 575)), r"values must be \[N, 576\]"),
    (dict(values=torch.zeros(2, 576, dtype=torch.float64)), "values must be one of"),
    (dict(values=torch.zeros(576, 2).t()), "contiguous rows"),
    (dict(slots=torch.tensor([0, 1, 2])), r"slot_mapping must be a contiguous int32 or int64 tensor \[2\], got "
                                          r"torch.int64"),
    (dict(slots=torch.tensor([0.0, 1.0])), "int32 or int64"),
    (dict(slots=torch.tensor([0, 8])), "points past the cache"),
    (dict(slots=torch.tensor([3, 3])), "slot_mapping writes 2 tokens to slot 3"),  # as write_cache refuses
])
def test_bad_write_arguments_are_refused_by_name(bad, message):
    cache = small_cache("bf16", torch.ones(1, LATENT_DIM))
    values = bad.get("values", torch.ones(2, LATENT_DIM)).to(DEVICE)
    with pytest.raises(ValueError, match=message):
        write_cache_triton(cache, values, bad.get("slots", torch.tensor([0, 1])).to(DEVICE))
    assert bool((cache.data == 0xFF).all())


def test_strided_slots_are_refused_not_read_as_contiguous_memory():
    """The kernels read a slot tensor's memory as contiguous: [3, 9, 5, 14][::2] was validated as [3, 5] and written
    to slots 3 and 9 (and [3, 1000, 5, 1000][::2] wrote past the cache)."""
    cache = small_cache("bf16", torch.ones(1, LATENT_DIM))
    slots = torch.tensor([0, 1000, 1, 1000], device=DEVICE)[::2]
    with pytest.raises(ValueError, match=r"slot_mapping must be a contiguous .* with strides \[2\]"):
        write_cache_triton(cache, torch.ones(2, LATENT_DIM, device=DEVICE), slots)
    with pytest.raises(ValueError, match=r"token_slots must be a contiguous .* with strides \[2\]"):
        gather_cache_triton(cache, slots)


def test_bad_gather_arguments_are_refused_by_name():
    cache = small_cache("bf16", torch.ones(1, LATENT_DIM))
    with pytest.raises(ValueError, match="token slots must lie in"):
        gather_cache_triton(cache, torch.tensor([0, 8], device=DEVICE))
    with pytest.raises(ValueError, match="token slots must lie in"):
        gather_cache_triton(cache, torch.tensor([-1], device=DEVICE))
    with pytest.raises(ValueError, match="out_dtype"):
        gather_cache_triton(cache, torch.tensor([0], device=DEVICE), torch.float16)
    assert gather_cache_triton(cache, torch.empty(0, dtype=torch.long, device=DEVICE)).shape == (0, LATENT_DIM)


class NoFloorDSMLA(FP8DSMLALayout):
    """A look-alike layout (SGLang's fast path without a scale floor): the kernels must not claim to implement it."""

    def __init__(self) -> None:
        super().__init__(pow2=False)


def test_a_layout_without_a_kernel_is_unsupported_not_miscomputed():
    cache = PagedCache.empty(NoFloorDSMLA(), 1, 4, DEVICE)
    with pytest.raises(UnsupportedConfig, match="no kernel for layout 'fp8_ds_mla'"):
        write_cache_triton(cache, torch.ones(1, LATENT_DIM, device=DEVICE), torch.tensor([0], device=DEVICE))


def test_every_registered_layout_has_a_write_and_a_gather_kernel():
    from impls.triton.cache_ops import has_kernel

    assert all(has_kernel(layout) for layout in LAYOUTS.values())


def _write_without_skipping_padding(cache, values, slots, propagate_nonfinite=False):
    """Planted bug: padding slots (-1) wrap around to the cache's last slot instead of being skipped."""
    wrapped = torch.where(slots < 0, slots + cache.num_slots, slots)
    encoded = cache.layout.quantize(values.cpu(), cache.tensor_scale, propagate_nonfinite)
    cache.rows()[wrapped] = encoded.to(cache.data.device)


def test_the_write_check_catches_a_writer_that_writes_padding_rows():
    problems, metrics = check_write(get_layout("fp8_ds_mla"), _write_without_skipping_padding, gather_cache_triton,
                                    torch.device(DEVICE), seed=0)
    assert metrics["mismatched_bytes"] > 0
    assert any("bytes differ" in p for p in problems)


def test_kernels_defined_while_the_interpreter_setting_was_changed_are_refused(tmp_path, monkeypatch):
    """An impl that set TRITON_INTERPRET on import and imported a module of ours is refused and the variable put
    back, but the kernels defined meanwhile kept the other setting: later Triton impls ran interpreted on a GPU,
    timed as compiled, with no word (review of 72f23e7). Every Triton impl's refusal now names the module."""
    import importlib.util

    from impls.triton.decode import TritonDecode
    from mla_bench.problem import build_problem
    from mla_bench.workload import Workload

    problem = build_problem(Workload(mode="decode", q_lens=(1,), kv_lens=(5,), page_size=16), DEVICE)
    assert triton_unavailable(DEVICE) is None and TritonDecode().refusal(problem) is None
    (tmp_path / "late.py").write_text("import triton\n\n\n@triton.jit\ndef kernel(x):\n    pass\n")
    with monkeypatch.context() as changed:
        changed.setenv("TRITON_INTERPRET", "1" if DEVICE == "cuda" else "0")  # what this host does not run
        spec = importlib.util.spec_from_file_location("impls.triton.late", tmp_path / "late.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "impls.triton.late", module)
    says = (f"the Triton kernels of impls.triton.late were defined {'interpreted' if DEVICE == 'cuda' else 'compiled'}"
            " but Triton")
    assert triton_unavailable(DEVICE).startswith(says), triton_unavailable(DEVICE)
    assert TritonDecode().refusal(problem).startswith(says), TritonDecode().refusal(problem)


def test_the_interpreter_knob_set_from_python_is_refused_and_a_blocked_module_is_no_error(monkeypatch):
    """``triton.knobs.runtime.interpret = ...`` sets TRITON_INTERPRET and keeps an override that the bench's restore
    of the variable leaves: kernels imported later took the override, unseen (helper 95). A module blocked in
    sys.modules (None) raised TypeError inside every refusal."""
    from triton import knobs

    monkeypatch.setitem(sys.modules, "impls.triton.blocked", None)
    assert triton_unavailable(DEVICE) is None
    try:
        with monkeypatch.context() as restored:
            restored.setenv("TRITON_INTERPRET", "0")  # then put back as the bench does (set, or unset on a GPU host)
            knobs.runtime.interpret = DEVICE == "cuda"
        assert re.match("triton.knobs.runtime.interpret is (True|False) but TRITON_INTERPRET says otherwise",
                        triton_unavailable(DEVICE) or "")
    finally:
        del knobs.runtime.interpret
    assert triton_unavailable(DEVICE) is None


@pytest.mark.parametrize("value", ["true", "on", "2", "false"])
def test_every_module_reads_the_interpreter_setting_as_triton_does(value):
    """``common.INTERPRETING`` (tile sizes, float32 upcasts) took anything but "" and "0" as on, where triton.jit
    takes only 1/true/yes/on/y: with "false" or "2" the kernels compiled with the interpreter's choices (helper 95)."""
    code = ("from triton.runtime.interpreter import InterpretedFunction\n"
            "from impls.triton import common, decode\n"
            "print(common.INTERPRETING, isinstance(decode._decode_split_kernel, InterpretedFunction), "
            "common.stale_kernels())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": value}, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    on = str(value in ("true", "on"))
    assert done.stdout.split() == [on, on, "None"], done.stdout
