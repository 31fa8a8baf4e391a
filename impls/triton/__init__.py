"""Our Triton kernels: paged MLA decode, prefill, sparse, cache ops.

Without a CUDA device the kernels run in Triton's interpreter. ``TRITON_INTERPRET`` must be set before any
module defining ``@triton.jit`` kernels is imported, so this package sets it (unless the user chose) when no
GPU is visible: every kernel module lives below it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
