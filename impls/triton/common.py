"""Small pieces every Triton kernel module here shares.

Triton 3.9's interpreter multiplies bfloat16 tiles as their raw uint16 bits (``np.matmul`` on the storage),
so under ``TRITON_INTERPRET=1`` the kernels feed ``tl.dot`` float32 copies of their bf16/fp16 tiles. The
products of two bf16 (or fp16) values are exact in float32, so this changes nothing but speed; on a GPU the
tiles go to the tensor cores as they are.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` with float32 accumulation (operands upcast when ``UPCAST``: the interpreter)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)
