"""Our Triton kernels: paged MLA decode, prefill, sparse, cache ops.

Without a CUDA device the kernels can only run in Triton's interpreter, which is chosen when a ``@triton.jit``
function is defined: so on such a machine this package turns ``TRITON_INTERPRET`` on before any kernel module
is imported (an explicit setting of the variable is left alone).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreting() -> bool:
    """True when the kernels of this package run in Triton's interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
