"""The torch baseline: the MLA attention a user writes first, request by request, on CPU or GPU."""

from impls.torch_eager.impl import TorchEager

__all__ = ["TorchEager"]
