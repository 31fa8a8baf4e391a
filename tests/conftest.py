"""Test-session setup. Without a GPU the Triton kernels run in Triton's interpreter, which must be switched on
before any module that defines a kernel is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
