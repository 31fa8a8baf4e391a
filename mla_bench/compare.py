"""Error metrics of an impl's ``(out, lse)`` against the float64 reference.

The impl's lse is first brought to the bench's convention (natural log, -inf for a row with no key) from
the convention its capabilities declare. Metrics, all in float64:

- ``rel_l2``: ||out - ref|| / ||ref|| over the whole output;
- ``max_row_rel``: the worst (token, head) row's relative error, so a bug confined to one request shows;
- ``max_abs``: the largest absolute difference;
- ``cos_diff``: ``1 - 2 sum(xy) / sum(x^2 + y^2)`` (FlashMLA's measure; 0 when equal);
- ``lse_max_abs``: the largest lse difference over rows that see keys;
- ``nonfinite_mismatch``: positions where exactly one of out/ref (or lse on non-empty rows) is NaN/Inf,
  plus empty rows whose lse is not -inf. It must be 0.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

LN2 = math.log(2.0)
LSE_BASES = ("e", "2")  # the lse conventions an impl may declare (``Capabilities``): its log's base,
EMPTY_LSE = ("-inf", "+inf")  # and what it returns for a row that sees no key


def check_real(name: str, tensor: torch.Tensor, who: str = "compare") -> None:
    """ValueError, prefixed ``who``, unless ``tensor`` is a tensor of real floating point: a complex one lost its
    imaginary part in the float64 cast (with a warning, and perfect metrics), bools and ints compared as numbers."""
    if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{who}: {name} must be a real floating-point tensor, got {got}")


@dataclass
class ErrorMetrics:
    rel_l2: float
    max_row_rel: float
    max_abs: float
    cos_diff: float
    lse_max_abs: float
    nonfinite_mismatch: int

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def normalize_lse(lse: torch.Tensor, base: str = "e", empty: str = "-inf") -> torch.Tensor:
    """An impl's lse in the bench's convention: natural log, -inf for empty rows. ``base`` and ``empty`` are the
    conventions ``Capabilities`` declares (``LSE_BASES``, ``EMPTY_LSE``): any other (``2``, ``"+Inf"``) was taken
    as the bench's own, leaving the lse unconverted. Under ``"+inf"`` a -inf is no row's answer, so it becomes NaN
    (a mismatch): an impl that declared FlashMLA's +inf and returned -inf passed."""
    if base not in LSE_BASES:
        raise ValueError(f"normalize_lse: base must be one of {LSE_BASES}, got {base!r}")
    if empty not in EMPTY_LSE:
        raise ValueError(f"normalize_lse: empty must be one of {EMPTY_LSE}, got {empty!r}")
    check_real("lse", lse, "normalize_lse")
    lse = lse.double()
    if empty == "+inf":
        lse = torch.where(torch.isposinf(lse), float("-inf"), torch.where(torch.isneginf(lse), float("nan"), lse))
    if base == "2":
        lse = lse * LN2
    return lse


def compare(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> ErrorMetrics:
    """Metrics of ``(out, lse)`` (lse already normalized) against the reference."""
    for name, tensor in (("out", out), ("lse", lse), ("reference out", ref_out), ("reference lse", ref_lse)):
        check_real(name, tensor)
    if out.shape != ref_out.shape:
        raise ValueError(f"output shape {list(out.shape)} differs from the reference's {list(ref_out.shape)}")
    if lse.shape != ref_lse.shape:
        raise ValueError(f"lse shape {list(lse.shape)} differs from the reference's {list(ref_lse.shape)}")
    out, ref_out = out.double().to(ref_out.device), ref_out.double()
    lse, ref_lse = lse.double().to(ref_lse.device), ref_lse.double()

    finite_out, finite_ref = torch.isfinite(out), torch.isfinite(ref_out)
    empty_rows = torch.isneginf(ref_lse)
    live_rows = torch.isfinite(ref_lse)
    mismatch = int((finite_out != finite_ref).sum())
    mismatch += int((live_rows & ~torch.isfinite(lse)).sum())
    mismatch += int((empty_rows & ~torch.isneginf(lse)).sum())

    both = finite_out & finite_ref
    diff = torch.where(both, out - ref_out, 0.0)
    x, y = torch.where(both, out, 0.0), torch.where(both, ref_out, 0.0)
    ref_norm = float(torch.linalg.vector_norm(y))
    rel_l2 = float(torch.linalg.vector_norm(diff)) / ref_norm if ref_norm else float(torch.linalg.vector_norm(diff))
    row_err = torch.linalg.vector_norm(diff, dim=-1)
    row_ref = torch.linalg.vector_norm(y, dim=-1)
    # Rows whose reference is 0 (empty rows) are judged absolutely: any nonzero output is an error.
    row_rel = torch.where(row_ref > 0, row_err / torch.where(row_ref > 0, row_ref, 1.0), row_err)
    denom = float((x * x + y * y).sum())
    cos_diff = 1.0 - 2.0 * float((x * y).sum()) / denom if denom else 0.0
    lse_diff = torch.where(live_rows & torch.isfinite(lse), (lse - ref_lse).abs(), 0.0)
    return ErrorMetrics(
        rel_l2=rel_l2,
        max_row_rel=float(row_rel.max()) if row_rel.numel() else 0.0,
        max_abs=float(diff.abs().max()) if diff.numel() else 0.0,
        cos_diff=cos_diff,
        lse_max_abs=float(lse_diff.max()) if lse_diff.numel() else 0.0,
        nonfinite_mismatch=mismatch,
    )
