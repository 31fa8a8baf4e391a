"""Model dimensions of MLA and the presets of the models the bench targets.

Names follow the vLLM MLA docstring: N heads, Lkv latent rank (512), R rope dims (64), P nope dims (128),
V value dims (128), Lq query latent rank (1536, or None where queries are not compressed).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Any


def yarn_mscale(factor: float, mscale_all_dim: float) -> float:
    """YaRN attention-scale correction: ``0.1 * mscale_all_dim * ln(factor) + 1`` for factor > 1, else 1."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale_all_dim * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLADims:
    """Shapes of one MLA layer; ``softmax_scale`` is the one both formulations use."""

    name: str
    num_heads: int
    hidden_size: int
    q_lora_rank: int | None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_factor: float = 1.0
    mscale_all_dim: float = 0.0
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for field in ("num_heads", "hidden_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                      "v_head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MLADims.{field} must be a positive int, got {value!r}")
        rank = self.q_lora_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0):
            raise ValueError(f"MLADims.q_lora_rank must be a positive int or None, got {rank!r}")
        for field, zero_ok in (("rope_factor", False), ("mscale_all_dim", True), ("rope_theta", False)):
            value = getattr(self, field)  # a NaN here made softmax_scale NaN
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (value == 0 and not zero_ok):
                raise ValueError(f"MLADims.{field} must be a finite number {'>= 0' if zero_ok else '> 0'}, "
                                 f"got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLADims.qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the compute-friendly (MHA) path: P + R = 192."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cache entry and of the absorbed query: Lkv + R = 576."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """DeepSeek's scale for both paths: ``(P + R) ** -0.5 * mscale ** 2``."""
        mscale = yarn_mscale(self.rope_factor, self.mscale_all_dim)
        return self.qk_head_dim ** -0.5 * mscale * mscale

    def with_heads(self, num_heads: int) -> "MLADims":
        """The same model with another head count (tensor parallelism, or padding tests)."""
        return replace(self, num_heads=num_heads)


PRESETS: dict[str, MLADims] = {
    "deepseek-v3": MLADims("deepseek-v3", num_heads=128, hidden_size=7168, q_lora_rank=1536,
                           rope_factor=40.0, mscale_all_dim=1.0),
    # DeepSeek V3 under tensor parallel 8: 16 heads per GPU.
    "deepseek-v3-tp8": MLADims("deepseek-v3-tp8", num_heads=16, hidden_size=7168, q_lora_rank=1536,
                               rope_factor=40.0, mscale_all_dim=1.0),
    "deepseek-v2-lite": MLADims("deepseek-v2-lite", num_heads=16, hidden_size=2048, q_lora_rank=None,
                                rope_factor=40.0, mscale_all_dim=0.707),
    # Kimi K2: ranks as DeepSeek V3 (not confirmed from its own config), 64 heads, yarn factor 32.
    "kimi-k2": MLADims("kimi-k2", num_heads=64, hidden_size=7168, q_lora_rank=1536,
                       rope_factor=32.0, mscale_all_dim=1.0),
    # The real 512/64/128 dims with few heads and a small hidden size: CPU and interpreter runs.
    "tiny": MLADims("tiny", num_heads=4, hidden_size=256, q_lora_rank=96,
                    rope_factor=40.0, mscale_all_dim=1.0),
}


MAX_SOFTMAX_SCALE = 3.4028234663852886e38 / math.log2(math.e)  # float32's largest value over log2(e)


def softmax_scale_problem(scale: Any) -> str | None:
    """What is wrong with ``scale`` unless it is a finite positive real number (not a bool, not a tensor), else None:
    for checks that name every problem of their inputs at once."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        return f"softmax scale must be a finite positive number, got {scale!r}"
    if float(scale) == 0:  # a Fraction(1, 10**400): positive, but 0 as the float every computation takes
        return f"softmax scale must be a finite positive number, got {scale!r}, which is 0 as a float"
    if scale > MAX_SOFTMAX_SCALE:  # the kernels' own scale, scale * log2(e) in float32, would be inf (NaN outputs)
        return (f"softmax scale must be at most {MAX_SOFTMAX_SCALE:.6g} (float32's largest value over log2(e): the "
                f"kernels scale scores by scale * log2(e) in float32), got {scale!r}")
    return None


def check_softmax_scale(scale: Any) -> None:
    """ValueError naming ``softmax_scale_problem``'s problem: the reference and the decode kernel's plan refuse any
    other scale by name instead of computing with it."""
    problem = softmax_scale_problem(scale)
    if problem is not None:
        raise ValueError(problem)


def get_preset(name: str) -> MLADims:
    """Look a preset up by name, with an error that lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
