"""Registry of cache layouts: ``get_layout(name)`` and ``LAYOUTS`` (name -> layout)."""

from __future__ import annotations

from mla_bench.layouts.base import LATENT_DIM, NOPE_DIM, POISON_BYTE, ROPE_DIM, CacheLayout, PagedCache
from mla_bench.layouts.bf16 import BF16Layout
from mla_bench.layouts.fp4 import FP4MX16Layout, MXFP4NSALayout, NVFP4Layout
from mla_bench.layouts.fp8 import FP8DSMLALayout, FP8PerTensorLayout

LAYOUTS: dict[str, CacheLayout] = {
    layout.name: layout
    for layout in (BF16Layout(), FP8PerTensorLayout(), FP8DSMLALayout(pow2=False), FP8DSMLALayout(pow2=True),
                   FP4MX16Layout(), MXFP4NSALayout(), NVFP4Layout())
}


def get_layout(name: str) -> CacheLayout:
    """Look a layout up by name, with an error that lists the known ones (a name that is not a string, such as
    ``["bf16"]``, too: not a dict look-up's TypeError)."""
    if not isinstance(name, str):
        raise ValueError(f"unknown cache layout {name!r}: a layout is named by a string; known layouts: "
                         f"{', '.join(LAYOUTS)}")
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown cache layout {name!r}; known layouts: {', '.join(LAYOUTS)}") from None


__all__ = ["LAYOUTS", "LATENT_DIM", "NOPE_DIM", "POISON_BYTE", "ROPE_DIM", "CacheLayout", "PagedCache",
           "get_layout"]
