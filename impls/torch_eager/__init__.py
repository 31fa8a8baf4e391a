"""The torch baseline: the MLA attention a user writes first, request by request, on CPU or GPU; and the same
with the cache in host memory (attention on the CPU)."""

from impls.torch_eager.host_cache import TorchEagerHostCache
from impls.torch_eager.impl import TorchEager

__all__ = ["TorchEager", "TorchEagerHostCache"]
