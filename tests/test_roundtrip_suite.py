"""The roundtrip suite end to end on this machine, its capability matrix, and the planted bugs it must flag."""

from __future__ import annotations

import io
import random

import pytest
import torch
from rich.console import Console

from mla_bench.errors import UnsupportedConfig
from mla_bench.layouts import NOPE_DIM, get_layout
from mla_bench.layouts.formats import (E2M1_MAX, E4M3_MAX, E4M3_NAN, FLT_MIN, UE8M0_NAN, e2m1_encode, e4m3_decode,
                                       e4m3_encode, f32_bytes, pack_nibbles)
from mla_bench.layouts.fp4 import FP4MX16Layout, MXFP4NSALayout, NVFP4Layout, mx_encode
from mla_bench.layouts.fp8 import FP8DSMLALayout, FP8PerTensorLayout
from mla_bench.registry import Capabilities, ImplEntry, discover
from mla_bench.workload import Mode
from impls.torch_eager import TorchEager
from impls.triton.cache_ops import gather_cache_triton, write_cache_triton
from suites.base import RunContext
from suites.capability import capability_table, cells, names_combination, print_capability_matrix, run_matrix
from suites.roundtrip import RoundtripSuite, check_device_codec, check_gather

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CHECKS = {"codec bounds", "edge inputs", "triton write", "triton gather", "conversions", "paged vs ragged",
          "capability", "capability matrix"} | ({"device codec"} if DEVICE.type == "cuda" else set())


@pytest.fixture(scope="module")
def results():
    """The suite over this project's impls. Where a peer is installed its real findings (vLLM's fp8_e4m3 lse,
    NOTES.md) are failed cells of its own, not this suite's failure."""
    ctx = RunContext(impls=[e for e in discover().values() if not e.target.startswith("impls.external.")],
                     device=DEVICE)
    return list(RoundtripSuite().run(ctx))


def test_every_check_passes_for_every_layout(results):
    assert {r.check for r in results} == CHECKS
    assert [f"{r.check} {r.label}: {r.message[:200]}" for r in results if not r.ok] == []
    triton = [r for r in results if r.check.startswith("triton")]
    assert len(triton) == 14 and all(r.status == "passed" for r in triton)
    assert all(r.metrics["mismatched_bytes"] == 0 for r in triton if r.check == "triton write")


def test_capability_cells_record_the_tolerances_the_gate_bounds_them_by(results):
    """Without them the gate compared none of the cells' error metrics (helper 88)."""
    cells = [r for r in results if r.check == "capability" and r.status == "passed" and "kernel.rel_l2" in r.metrics]
    assert cells and all(r.details["tolerance"]["kernel"]["rel_l2"] > 0 and "e2e" in r.details["tolerance"]
                         for r in cells)


def test_results_are_labelled_and_serializable(results):
    for result in results:
        assert result.suite == "roundtrip" and result.label
        assert type(result).from_dict(result.to_dict()) == result


def test_the_capability_matrix_covers_every_layout_and_transform(results):
    summary = next(r for r in results if r.check == "capability matrix")
    details = summary.details
    assert details["columns"] == ["bf16", "fp8_e4m3", "fp8_ds_mla", "fp8_ds_mla_pow2", "fp4_mx16", "mxfp4_nsa",
                                  "nvfp4", "no cache"]
    rows = {(row["impl"], row["op"]): row["cells"] for row in details["rows"]}
    assert rows[("torch_eager", "decode")]["bf16"] == "passed"
    assert rows[("torch_eager", "decode")]["fp8_ds_mla"] == "unsupported"
    assert rows[("torch_eager", "prefill")]["no cache"] == "passed"
    assert ("torch_eager", "sparse_prefill (ragged)") in rows
    out = io.StringIO()
    print_capability_matrix(results, Console(file=out, width=250))
    text = out.getvalue()
    assert "capability matrix" in text and "sparse_decode (paged)" in text and "refused" in text


# ---- planted codec bugs -------------------------------------------------------------------------------------------
class PlantedDSMLA(FP8DSMLALayout):
    """fp8_ds_mla with one planted bug, named ``planted_name``, under the scale policy ``planted_pow2``."""

    planted_name = ""
    planted_pow2 = False

    def __init__(self) -> None:
        super().__init__(pow2=self.planted_pow2)
        self.name = self.planted_name

    def _with_tile_scales(self, x, scale_of_amax):
        """The token's bytes with its codes and tile scales from ``scale_of_amax(amax)``, over each 128-column tile."""
        raw = super()._encode(x, None)
        tiles = x[:, :NOPE_DIM].float().reshape(-1, 4, 128)
        scale = scale_of_amax(tiles.abs().amax(dim=-1))
        codes = e4m3_encode(tiles / scale[..., None]).reshape(-1, NOPE_DIM)
        return torch.cat([codes, f32_bytes(scale), raw[:, NOPE_DIM + 16:]], dim=1)


class NoScaleFloor(PlantedDSMLA):
    """SGLang's fast path: tile scale amax / 448 with no floor, so an all-zero tile gets 0/0 = NaN."""

    planted_name = "planted_no_scale_floor"

    def _encode(self, x, tensor_scale):
        return self._with_tile_scales(x, lambda amax: amax / 448)


class TruncatedRope(PlantedDSMLA):
    """Rope values cut to bfloat16 by dropping the low 16 bits instead of rounding to nearest even."""

    planted_name = "planted_truncated_rope"

    def _encode(self, x, tensor_scale):
        raw = super()._encode(x, tensor_scale)
        truncated = (x[:, NOPE_DIM:].float().contiguous().view(torch.int32) >> 16).to(torch.int16)
        return torch.cat([raw[:, :NOPE_DIM + 16], truncated.view(torch.uint8)], dim=1)


class TensorScaleWithoutFloor(FP8PerTensorLayout):
    """Per-layer scale amax / 448 with no floor: a layer of zeros (a profiling run's) gets scale 0."""

    name = "planted_tensor_scale_without_floor"

    def fit_tensor_scale(self, x):
        finite = x.float().abs()[torch.isfinite(x)]
        return float(finite.max()) / E4M3_MAX if finite.numel() else 0.0


class TensorScaleOverNonfinite(FP8PerTensorLayout):
    """Per-layer scale from the amax of every value, NaN/Inf included: one bad token spoils the layer's scale."""

    name = "planted_tensor_scale_over_nonfinite"

    def fit_tensor_scale(self, x):
        return max(float(x.float().abs().max()) / E4M3_MAX, FLT_MIN)


class Float32Rope(PlantedDSMLA):
    """Rope stored as float32 (the cast to bf16 forgotten): 784 bytes a token where the format has 656."""

    planted_name = "planted_float32_rope"

    def _encode(self, x, tensor_scale):
        raw = super()._encode(x, tensor_scale)
        return torch.cat([raw[:, :NOPE_DIM + 16], f32_bytes(x[:, NOPE_DIM:])], dim=1)


class Pow2CodesExactScale(PlantedDSMLA):
    """Codes divided by the power-of-two scale, but the exact amax / 448 stored: pow2 in one place, not the other."""

    planted_name = "planted_pow2_codes_exact_scale"
    planted_pow2 = True

    def _encode(self, x, tensor_scale):
        raw = super()._encode(x, tensor_scale)
        exact = (x[:, :NOPE_DIM].float().reshape(-1, 4, 128).abs().amax(dim=-1) / E4M3_MAX).clamp(min=FLT_MIN)
        return torch.cat([raw[:, :NOPE_DIM], f32_bytes(exact), raw[:, NOPE_DIM + 16:]], dim=1)


class TileScaleOver240(PlantedDSMLA):
    """Tile scale amax / 240, e4m3fnuz's largest value (a ROCm mix-up): steps 1.87x coarser than the format's."""

    planted_name = "planted_tile_scale_over_240"

    def _encode(self, x, tensor_scale):
        return self._with_tile_scales(x, lambda amax: (amax / 240).clamp(min=FLT_MIN))


class TensorScaleOver240(FP8PerTensorLayout):
    """Per-layer scale amax / 240 (e4m3fnuz's largest value): the error bound, which takes that scale, still holds."""

    name = "planted_tensor_scale_over_240"

    def fit_tensor_scale(self, x):
        return super().fit_tensor_scale(x) * E4M3_MAX / 240


class NVFP4ScaleWithoutFloor(NVFP4Layout):
    """nvfp4's global scale amax / (6 * 448) without a floor: 0 in float32 for amax below ~1.9e-42."""

    name = "planted_nvfp4_scale_without_floor"

    def fit_tensor_scale(self, x):
        nope = x[:, :NOPE_DIM].float().abs()
        amax = float(torch.where(torch.isfinite(nope), nope, 0.0).max())
        return float(torch.tensor(amax) / (E2M1_MAX * E4M3_MAX)) if amax > 0 else 1.0


class PlantedMX:
    """An MX layout named ``name`` whose finite block exponents are ``shift`` off SGLang's: on every block (+1: steps
    twice too coarse; -1: each block's largest values clip), or, ``floor_only``, those of the values times 2^-shift
    moved by ``shift`` (the review's planted 'exponent + 1'), which cancels except where the floor sets the exponent:
    the floor moved by 2^shift."""

    def __init__(self, name: str, shift: int, floor_only: bool = False) -> None:
        self.name, self.shift, self.floor_only = name, shift, floor_only

    def _mx(self, values, block, floor_after_divide):
        _, scales = mx_encode(values * 2.0 ** -self.shift if self.floor_only else values, block, floor_after_divide)
        finite = scales != UE8M0_NAN
        exponent = scales.int() - 127 + self.shift
        codes = e2m1_encode(values.float().reshape(*scales.shape, block), torch.exp2(exponent.float())[..., None],
                            ties="away")
        return (pack_nibbles(torch.where(finite[..., None], codes, 0).flatten(1)),
                torch.where(finite, exponent + 127, UE8M0_NAN).to(torch.uint8))


class MX16ExponentOff(PlantedMX, FP4MX16Layout):
    """fp4_mx16 (blocks of 16, floor 1e-10 after the divide by 6) with ``PlantedMX``'s exponents."""

    def _encode(self, x, tensor_scale):
        return torch.cat(self._mx(x, 16, floor_after_divide=True), dim=1)


class NSAExponentOff(PlantedMX, MXFP4NSALayout):
    """mxfp4_nsa (blocks of 32, floor 1e-12 before the divide by 6) with ``PlantedMX``'s exponents; rope as is."""

    def _encode(self, x, tensor_scale):
        rope = super()._encode(x, tensor_scale)[:, NOPE_DIM // 2 + NOPE_DIM // 32:]
        return torch.cat([*self._mx(x[:, :NOPE_DIM], 32, floor_after_divide=False), rope], dim=1)


class NVFP4BlockScaleOff(NVFP4Layout):
    """nvfp4 whose e4m3 block scales round ``factor * amax / (6 g)``: 2 makes the steps twice too coarse, 1/2 clips
    each block's largest values."""

    def __init__(self, factor: float) -> None:
        self.factor, self.name = factor, f"planted_nvfp4_block_scale_x{factor:g}"

    def _encode(self, x, tensor_scale):
        g = torch.tensor(tensor_scale, dtype=torch.float32)
        blocks = x[:, :NOPE_DIM].float().reshape(-1, NOPE_DIM // 16, 16)
        amax = blocks.abs().amax(dim=-1)
        scale_codes = torch.where(torch.isfinite(amax), e4m3_encode(self.factor * amax / (E2M1_MAX * g)),
                                  E4M3_NAN).to(torch.uint8)
        codes = e2m1_encode(blocks, e4m3_decode(scale_codes).float()[..., None] * g, ties="even")
        rope = super()._encode(x, tensor_scale)[:, NOPE_DIM // 2 + NOPE_DIM // 16:]
        return torch.cat([pack_nibbles(codes.flatten(1)), scale_codes, rope], dim=1)


def _run(seed: int, page_size: int = 16, **suite_args) -> list:
    """The suite without its capability matrix, on one page size."""
    suite = RoundtripSuite(matrix=False, **suite_args)
    return list(suite.run(RunContext(impls=[], device=DEVICE, page_sizes=[page_size], seed=seed)))


@pytest.mark.parametrize("layout, check, says", [
    (NoScaleFloor(), "edge inputs", "all-zero blocks decode to"),
    (TruncatedRope(), "codec bounds", "the stated bound (at token"),
    (TensorScaleWithoutFloor(), "edge inputs", "the per-layer scale fitted to all-zero values is 0.0"),
    (TensorScaleOverNonfinite(), "edge inputs", "the per-layer scale fitted to NaN/Inf-holding values is nan"),
    (Float32Rope(), "codec bounds", "its encoder wrote torch.uint8 [256, 784], expected uint8 [256, 656]"),
    (Pow2CodesExactScale(), "codec bounds", "the stated bound (at token"),
    (TileScaleOver240(), "codec bounds", ", column 5 (kv_c))"),  # the stated bound broken at the probe
    (TensorScaleOver240(), "codec bounds", "inputs: the fitted per-layer scale"),
    (NVFP4ScaleWithoutFloor(), "edge inputs", "the per-layer scale fitted to tiny values is 0.0"),
    (MX16ExponentOff("planted_mx16_exponent_plus1", +1), "codec bounds", "the stated bound (at token"),
    (MX16ExponentOff("planted_mx16_exponent_minus1", -1), "codec bounds", "the stated bound (at token"),
    (NSAExponentOff("planted_nsa_exponent_plus1", +1), "codec bounds", "the stated bound (at token"),
    (NSAExponentOff("planted_nsa_exponent_minus1", -1), "codec bounds", "the stated bound (at token"),
    (NVFP4BlockScaleOff(2), "codec bounds", "the stated bound (at token"),
    (NVFP4BlockScaleOff(0.5), "codec bounds", "the stated bound (at token"),
    # the floor twice too high: only the grid values at SGLang's MX floors (token 7 of the edge inputs) show it
    (MX16ExponentOff("planted_mx16_floor_doubled", +1, floor_only=True), "edge inputs", "1.16x bound (at token 7"),
    (NSAExponentOff("planted_nsa_floor_doubled", +1, floor_only=True), "edge inputs", "1.36x bound (at token 7"),
])
def test_planted_codec_bugs_are_flagged(layout, check, says):
    seed = random.randrange(2 ** 32)
    results = _run(seed, layouts={layout.name: layout})
    flagged = [r for r in results if r.check == check]
    assert len(flagged) == 1 and flagged[0].status in ("failed", "error"), f"seed {seed}"
    assert says in flagged[0].message, f"seed {seed}: {flagged[0].message[:300]}"
    # the Triton kernels do not claim a layout they do not implement
    assert {r.status for r in results if r.check.startswith("triton")} == {"unsupported"}


class TileScaleByReciprocal(PlantedDSMLA):
    """Tile scales ``amax * (1 / 448)``: what ``amax / 448`` on a GPU tensor computes in torch (a Python-number divisor
    becomes a multiplication by its reciprocal), one bit off the quotient for about half of all values. It encodes
    so on every ``encodes_by_reciprocal``-th call, so that on one device it stands in for a codec run on two."""

    planted_name = "planted_tile_scale_by_reciprocal"

    def __init__(self, encodes_by_reciprocal: int) -> None:
        super().__init__()
        self.every, self.calls = encodes_by_reciprocal, 0

    def _encode(self, x, tensor_scale):
        self.calls += 1
        if self.calls % self.every:
            return super()._encode(x, tensor_scale)
        return self._with_tile_scales(x, lambda amax: torch.where(
            torch.isfinite(amax), (amax * (1 / E4M3_MAX)).clamp(min=FLT_MIN), float("nan")))


def test_a_codec_encoding_differently_in_its_second_place_is_flagged_by_field():
    """The device check encodes each input on the host, then on the device: here both are the CPU, and the planted
    codec's second encoding of each input rounds its tile scales the other way, as CUDA's torch would."""
    seed = random.randrange(2 ** 32)
    problems, metrics = check_device_codec(TileScaleByReciprocal(encodes_by_reciprocal=2), torch.device("cpu"), seed)
    assert len(problems) == 3 and metrics["differing_tokens"] > 100, f"seed {seed}: {problems}"
    assert all("tokens encode differently on cpu than on the host" in p for p in problems), problems
    assert "tile scales fp32" in problems[0] and "rope bf16" not in problems[0], problems[0]
    assert check_device_codec(get_layout("fp8_ds_mla"), torch.device("cpu"), seed) == ([], {"differing_tokens": 0})


@pytest.mark.gpu
def test_a_codec_dividing_by_a_python_number_is_flagged_on_the_gpu():
    """The bug ``formats.div_rn`` fixed (session 67): ``amax / 448`` on the GPU, in every encoding there."""
    class DividingByAPythonNumber(PlantedDSMLA):
        planted_name = "planted_division_by_a_python_number"

        def _encode(self, x, tensor_scale):
            return self._with_tile_scales(x, lambda amax: torch.where(
                torch.isfinite(amax), (amax / E4M3_MAX).clamp(min=FLT_MIN), float("nan")))

    layout = DividingByAPythonNumber()
    results = [r for r in _run(random.randrange(2 ** 32), layouts={layout.name: layout}) if r.check == "device codec"]
    assert len(results) == 1 and results[0].status == "failed", results
    assert "tokens encode differently on cuda" in results[0].message and "tile scales fp32" in results[0].message


# ---- planted cache ops (write / gather kernels): each given alone, the other op is the Triton one -----------------
SCALES = slice(NOPE_DIM, NOPE_DIM + 16)  # fp8_ds_mla's four fp32 tile scales


def _planted_write(rows=lambda cache, slots: slots, scale_bytes=None, skip_padding=True, check_every_row=False,
                   ignore_row_stride=False, check_rope=True):
    """A torch cache write with the reference codec's bytes at the right slots, but for the bug its arguments plant:
    ``rows`` maps slots to cache rows, ``scale_bytes`` rewrites fp8_ds_mla's tile scales, ``skip_padding=False``
    writes slot -1 rows (to the last row), ``check_every_row`` refuses NaN in padding rows too,
    ``ignore_row_stride`` reads the values as if their rows were contiguous, ``check_rope=False`` refuses NaN/Inf in
    kv_c only (k_pe, stored as bf16, is written as it comes)."""
    def write(cache, values, slots, propagate_nonfinite=False):
        if ignore_row_stride:
            values = torch.as_strided(values, values.shape, (values.shape[1], 1))
        kept = slots >= 0 if skip_padding else torch.ones_like(slots, dtype=torch.bool)
        checked = values if check_every_row else values[kept]
        if not check_rope:
            checked = torch.cat([checked[:, :NOPE_DIM], torch.zeros_like(checked[:, NOPE_DIM:])], dim=1)
        cache.layout.check_input(checked, propagate_nonfinite)
        raw = cache.layout.quantize(values[kept], cache.tensor_scale, propagate_nonfinite=True)
        if scale_bytes:
            raw[:, SCALES] = scale_bytes(raw[:, SCALES].contiguous().view(torch.float32))
        cache.rows()[rows(cache, slots[kept].long())] = raw
    return write


def _write_validating_the_top_slot(cache, values, slots, propagate_nonfinite=False):
    """Checks the slots with ``slots.max()``, which raises on an empty step (no token)."""
    if int(slots.max()) >= cache.num_slots:
        raise ValueError("slot_mapping points past the cache")
    _planted_write()(cache, values, slots, propagate_nonfinite)


def _gather_rounding_scales_to_bf16(cache, slots, dtype):
    """FlashMLA's Hopper kernel rounds each tile scale to bf16 (exact only for power-of-two scales), here on the
    exact-scale layout: the kernel and the quantizer disagree."""
    raw = cache.rows()[slots.long()].clone()
    raw[:, SCALES] = f32_bytes(raw[:, SCALES].contiguous().view(torch.float32).bfloat16().float())
    return cache.layout.dequantize(raw).float().to(dtype)


@pytest.mark.parametrize("ops, check, says", [
    ({"write": _planted_write(scale_bytes=lambda scale: f32_bytes(1 / scale))}, "given write",
     "tile scales fp32 (bytes 512-527) in"),
    ({"write": _planted_write(rows=lambda c, s: s % c.page_size * c.num_blocks + s // c.page_size)}, "given write",
     "slots no token goes to changed"),
    ({"write": _planted_write(skip_padding=False)}, "given write", "(padding written, or a wrong slot"),
    ({"write": _planted_write(check_every_row=True)}, "given write",
     "NaN/Inf in padding rows (slot -1, never written) refused"),
    ({"write": _write_validating_the_top_slot}, "given write", "an empty write (0 tokens) raised RuntimeError"),
    ({"write": _planted_write(ignore_row_stride=True)}, "given write", "strided fp16 inputs: "),
    # the Inf in k_pe sat in a padding row on the CPU (rows 1 and 4 of 6), so only the kv_c NaN was ever refused
    ({"write": _planted_write(check_rope=False)}, "given write",
     "NaN/Inf input written without propagate_nonfinite (at token 2, column 513 (k_pe))"),
    ({"gather": _gather_rounding_scales_to_bf16}, "given gather",
     "values differ from the reference dequantization, first at token"),
])
def test_planted_cache_op_bugs_are_flagged(ops, check, says):
    """The write names the field and slot a wrong byte is in; a write given without a gather is the one checked."""
    seed = random.randrange(2 ** 32)
    results = _run(seed, layouts={"fp8_ds_mla": get_layout("fp8_ds_mla")}, **ops)
    flagged = [r for r in results if r.status != "passed"]
    assert [r.check for r in flagged] == [check], f"seed {seed}: {[(r.check, r.message[:200]) for r in flagged]}"
    assert flagged[0].status == "failed" and says in flagged[0].message, f"seed {seed}: {flagged[0].message[:400]}"


def _write_exiting_on_an_empty_step(cache, values, slots, propagate_nonfinite=False):
    if slots.numel() == 0:
        raise SystemExit(0)
    _planted_write()(cache, values, slots, propagate_nonfinite)


def _gather_raising_generator_exit(cache, slots, dtype):
    raise GeneratorExit("closed")


def test_cache_ops_that_exit_are_their_checks_findings_not_the_runs_end():
    """sys.exit on an empty step, and GeneratorExit from a gather, ended the suite and the run: neither is an
    Exception."""
    seed = random.randrange(2 ** 32)
    results = _run(seed, layouts={"bf16": get_layout("bf16")}, write=_write_exiting_on_an_empty_step)
    flagged = [(r.check, r.status, r.message) for r in results if r.status != "passed"]
    assert flagged == [("given write", "failed", "an empty write (0 tokens) raised SystemExit: 0")], flagged
    results = _run(seed, layouts={"bf16": get_layout("bf16")}, gather=_gather_raising_generator_exit)
    flagged = [(r.check, r.status, r.message.split("\n")[0]) for r in results if r.status != "passed"]
    assert flagged == [("given gather", "error", "GeneratorExit: closed")], flagged


def test_the_gather_check_reads_the_slots_its_seed_picks():
    """The random-bytes slots came from the global generator: a run with the same --seed gathered other slots."""
    seed, picked = random.randrange(2 ** 32), []

    def gather(cache, slots, dtype):
        picked.append(slots.tolist())
        return gather_cache_triton(cache, slots, dtype)
    for state in (1, 2):
        torch.manual_seed(state)
        assert check_gather(get_layout("bf16"), write_cache_triton, gather, DEVICE, seed)[0] == []
    assert len(picked) == 10 and picked[:5] == picked[5:], f"seed {seed}"


def test_a_bad_page_size_is_an_error_result_that_names_it_first():
    results = _run(random.randrange(2 ** 32), page_size=0, layouts={})
    assert [(r.check, r.status) for r in results] == [("conversions", "error")]
    assert results[0].message.startswith("ValueError: mix 'decode': page_size must be a positive int, got 0")


# ---- planted impls: the matrix has no crash cell and no wrong answer ----------------------------------------------
class CrashesOnFP8(TorchEager):
    name = "planted_crash"
    capabilities = Capabilities(modes=frozenset({Mode.DECODE}), layouts=frozenset({"bf16", "fp8_ds_mla"}),
                                dtypes=frozenset({"bfloat16"}))

    def run(self, plan):
        if plan.problem.workload.layout != "bf16":
            raise RuntimeError("illegal memory access")
        return super().run(plan)


class ReturnsZeros(TorchEager):
    name = "planted_zeros"

    def run(self, plan):
        out, lse = super().run(plan)
        return torch.zeros_like(out), lse


class RefusesWithoutSaying(TorchEager):
    name = "planted_mumble"
    capabilities = Capabilities(modes=frozenset(Mode), layouts=frozenset({"bf16"}), dtypes=frozenset({"bfloat16"}))

    def plan(self, problem):
        raise UnsupportedConfig("not supported")


class RefusesNamingItself(RefusesWithoutSaying):
    """Its name holds a mode ("decode"): a refusal that names only the impl seemed to name the combination."""

    name = "planted_decode_mumble"

    def plan(self, problem):
        raise UnsupportedConfig(f"{self.name}: workspace computation went negative")


def test_crashes_wrong_answers_and_unnamed_refusals_are_failures():
    entries = [ImplEntry(cls.name, f"tests:{cls.__name__}", "path", cls)
               for cls in (CrashesOnFP8, ReturnsZeros, RefusesWithoutSaying, RefusesNamingItself, TorchEager)]
    results = list(run_matrix(entries, ["bf16", "fp8_ds_mla"], DEVICE))
    status = {(r.impl, r.details["row"], r.details["column"]): r.status for r in results if r.check == "capability"}
    assert status[("planted_crash", "decode", "bf16")] == "passed"
    assert status[("planted_crash", "decode", "fp8_ds_mla")] == "error"
    assert status[("planted_crash", "dcp", "fp8_ds_mla")] == "unsupported"
    assert status[("planted_zeros", "decode", "bf16")] == "failed"
    assert status[("planted_mumble", "decode", "bf16")] == "failed"
    assert status[("planted_decode_mumble", "decode", "bf16")] == "failed"
    assert status[("torch_eager", "decode", "bf16")] == "passed"
    summary = results[-1]
    assert summary.check == "capability matrix" and summary.status == "failed"
    assert "planted_crash: decode / fp8_ds_mla: error" in summary.message
    assert "CRASH" in _render(capability_table(summary.details))


def test_an_impl_name_of_markup_is_printed_as_typed_in_the_matrix():
    """A name like ``[bold red]x[/bold red][/]`` raised rich's MarkupError after the run: no summary, no report."""
    name = "[bold red]x[/bold red][/]"
    details = {"columns": ["bf16"], "rows": [{"impl": name, "op": "decode [/]", "cells": {"bf16": "passed"}}]}
    rendered = _render(capability_table(details))
    assert name in rendered and "decode [/]" in rendered


def _render(table) -> str:
    out = io.StringIO()
    Console(file=out, width=250).print(table)
    return out.getvalue()


def test_an_impl_that_fails_to_load_is_a_crash_row_not_the_end_of_the_matrix():
    """A broken impl (its module lacks the class, or raises on import) stopped the whole matrix: every other impl's
    cells were lost with it."""
    broken = ImplEntry("planted_broken", "suites.capability:NoSuchImpl", "path")
    results = list(run_matrix([broken, ImplEntry("torch_eager", "tests:TorchEager", "path", TorchEager)], ["bf16"],
                              DEVICE))
    loaded = next(r for r in results if r.impl == "planted_broken")
    assert loaded.status == "error" and "has no attribute 'NoSuchImpl'" in loaded.message
    rows = {(row["impl"], row["op"]): row["cells"] for row in results[-1].details["rows"]}
    assert rows[("planted_broken", "all ops")] == {"bf16": "error", "no cache": "error"}
    assert rows[("torch_eager", "decode")] == {"bf16": "passed"}
    assert results[-1].status == "failed" and "planted_broken: could not load: error" in results[-1].message


@pytest.mark.parametrize("mode, message", [
    ("dcp", "DCP needs an interleave that divides the page size; got interleave=3, page_size=64"),
    ("sparse_decode", "no sparse decode without a Hopper GPU"),
    ("chunked_prefill", "planted: Chunked-Prefill needs the context gathered first"),
    ("decode", "BF16 only on this build"),
])
def test_a_refusal_naming_the_op_or_layout_in_other_case_or_spelling_names_it(mode, message):
    """check_dcp's own refusal (which triton_dcp passes on) says "DCP": matched case-sensitively, a refusal that named
    the op in capitals, or with a space for the underscore, was a failed cell."""
    workload = next(cell for cell in cells(["bf16"]) if cell.mode.value == mode).workload("deepseek-v3-tp8", 0)
    assert names_combination(f"planted: {message}", workload, "planted")
    assert not names_combination("planted: workspace too small", workload, "planted")
