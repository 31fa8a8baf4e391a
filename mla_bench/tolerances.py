"""How close is close enough: one table keyed by (compute dtype, cache layout, error kind).

``kernel`` bounds the error against the reference on the cache as stored (dequantized): what the kernel
itself adds. ``e2e`` bounds the error against the original values: kernel plus cache format. Bounds are set
from the rounding each dtype implies (bf16 inputs and outputs, probabilities rounded to the dtype for the
second matmul, fp32 accumulation), with headroom, and tight enough that the planted bugs in tests/ fail.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mla_bench.compare import ErrorMetrics
from mla_bench.layouts import LAYOUTS


@dataclass(frozen=True)
class Tolerance:
    rel_l2: float
    max_row_rel: float
    cos_diff: float
    lse_abs: float

    def violations(self, metrics: ErrorMetrics) -> list[str]:
        """Each bound the metrics break, as readable text; empty when they pass."""
        found = []
        if metrics.nonfinite_mismatch:
            found.append(f"{metrics.nonfinite_mismatch} NaN/Inf positions differ from the reference")
        for name, bound in (("rel_l2", self.rel_l2), ("max_row_rel", self.max_row_rel),
                            ("cos_diff", self.cos_diff), ("lse_max_abs", self.lse_abs)):
            value = getattr(metrics, name)
            if not value <= bound:  # NaN fails too
                found.append(f"{name} {value:.3g} > {bound:.3g}")
        return found

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


KERNEL_TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rel_l2=2e-3, max_row_rel=8e-3, cos_diff=2e-6, lse_abs=2e-3),
    "bfloat16": Tolerance(rel_l2=8e-3, max_row_rel=2e-2, cos_diff=2e-5, lse_abs=5e-3),
    "float16": Tolerance(rel_l2=2e-3, max_row_rel=6e-3, cos_diff=2e-6, lse_abs=5e-3),
}

# End-to-end bounds of lossy cache layouts, per layout (independent of the compute dtype). Set at about twice
# the worst format-only error measured on the bench's problems (reference on the dequantized cache against
# reference on the original values; decode, sparse top-k 2048 and chunked prefill, 4 and 16 heads, 6 seeds;
# few heads give the noisiest aggregates): they catch a kernel that misreads the format (ignored or misplaced
# scales), while the kernel bound catches subtler bugs. Layouts absent here are exact for their inputs, so their
# e2e bound is the kernel bound.
E2E_TOLERANCES: dict[str, Tolerance] = {
    "fp8_e4m3": Tolerance(rel_l2=0.2, max_row_rel=0.4, cos_diff=0.012, lse_abs=0.45),
    "fp8_ds_mla": Tolerance(rel_l2=0.15, max_row_rel=0.4, cos_diff=0.007, lse_abs=0.45),
    "fp8_ds_mla_pow2": Tolerance(rel_l2=0.15, max_row_rel=0.4, cos_diff=0.007, lse_abs=0.45),
    "fp4_mx16": Tolerance(rel_l2=0.65, max_row_rel=1.8, cos_diff=0.1, lse_abs=2.0),
    "mxfp4_nsa": Tolerance(rel_l2=0.65, max_row_rel=1.8, cos_diff=0.1, lse_abs=1.6),
    "nvfp4": Tolerance(rel_l2=0.6, max_row_rel=1.6, cos_diff=0.09, lse_abs=1.8),
}


# A bf16 cache is exact for bf16 values only: of float32 or float16 values it keeps the bf16 rounding, whose error
# against the original values (same problems as above) reached rel_l2 3.9e-3, max_row_rel 1.3e-2, cos_diff 7.8e-6,
# lse 1.9e-2; the bound is about twice that.
BF16_CACHE_OF_WIDER_VALUES = Tolerance(rel_l2=1e-2, max_row_rel=3e-2, cos_diff=2e-5, lse_abs=4e-2)


def lossless(dtype: str, layout: str) -> bool:
    """Whether a cache of ``layout`` holds values of ``dtype`` exactly (then its e2e error is its kernel error)."""
    return layout == "bf16" and dtype == "bfloat16"


def tolerance_for(dtype: str, layout: str, kind: str = "kernel") -> Tolerance:
    """The bound for an impl computing in ``dtype`` over a cache of ``layout`` (a name of ``LAYOUTS``)."""
    if kind not in ("kernel", "e2e"):
        raise ValueError(f"tolerance kind must be 'kernel' or 'e2e', got {kind!r}")
    try:
        kernel = KERNEL_TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {', '.join(KERNEL_TOLERANCES)}") from None
    if not isinstance(layout, str) or layout not in LAYOUTS:  # a typo got the kernel bound as its e2e bound
        raise ValueError(f"no tolerance for cache layout {layout!r}; known: {', '.join(LAYOUTS)}")
    if kind == "kernel" or lossless(dtype, layout):
        return kernel
    if layout == "bf16":
        return BF16_CACHE_OF_WIDER_VALUES
    return E2E_TOLERANCES.get(layout, kernel)
