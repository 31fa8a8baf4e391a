"""A Gluon kernel whose wgmmas ptxas serializes, planted for ``impls.triton.compile_check``'s test.

Three products from register operands (wgmma's RS form), issued back to back and waited for together: ptxas cannot
keep their operands in flight and makes each product wait for the one before (its info C7512), which the check
must report as a failure of this launch."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper

ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))
OPERAND = gl.constexpr(gl.DotOperandLayout(0, ACC, 2))
SHARED = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
LOAD = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def _tile(ptr, ROWS: gl.constexpr, COLS: gl.constexpr):
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LOAD))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, LOAD))
    return gl.load(ptr + rows[:, None] * COLS + cols[None, :])


@gluon.jit
def serialized_products(a, b, out):
    """``out = A0 B0 + A1 B1 + A2 B2`` of fp16 ``[64, 64]`` A tiles and ``[64, 128]`` B tiles stored one after
    another; float32 ``[64, 128]`` out."""
    b0 = gl.allocate_shared_memory(gl.float16, [64, 128], SHARED, _tile(b, 64, 128))
    b1 = gl.allocate_shared_memory(gl.float16, [64, 128], SHARED, _tile(b + 8192, 64, 128))
    b2 = gl.allocate_shared_memory(gl.float16, [64, 128], SHARED, _tile(b + 16384, 64, 128))
    hopper.fence_async_shared()
    a0 = gl.convert_layout(_tile(a, 64, 64), OPERAND)
    a1 = gl.convert_layout(_tile(a + 4096, 64, 64), OPERAND)
    a2 = gl.convert_layout(_tile(a + 8192, 64, 64), OPERAND)
    zero = gl.zeros([64, 128], gl.float32, ACC)
    x0 = hopper.warpgroup_mma(a0, b0, zero, is_async=True)
    x1 = hopper.warpgroup_mma(a1, b1, zero, is_async=True)
    x2 = hopper.warpgroup_mma(a2, b2, zero, is_async=True)
    x0, x1, x2, a0, a1, a2 = hopper.warpgroup_mma_wait(0, deps=[x0, x1, x2, a0, a1, a2])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, ACC))
    gl.store(out + rows[:, None] * 128 + cols[None, :], x0 + x1 + x2)
