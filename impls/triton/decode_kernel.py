"""Triton kernels of paged MLA decode: split-KV partial attention, then an LSE merge of the splits.

The absorbed decode is multi-query attention: every query row (one head of one new token, 576 wide:
512 latent + 64 rope) attends the same key/value head, the latent cache (keys 576 wide, values the first
512 of them). A program of ``_decode_split_kernel`` takes one work item: one request, a block of
``BLOCK_M`` query rows of it (rows are (token, head) pairs, head fastest), and a range of its keys. It walks
the range ``BLOCK_N`` keys at a time, like the flash-attention tutorial:

    S = Q_nope K_nope^T + Q_rope K_rope^T      [BLOCK_M, BLOCK_N], mask, online softmax (base 2)
    O = O * alpha + P K_nope                   [BLOCK_M, 512], the key tile doubles as the value tile

Keys come from the paged cache through the block table, one row per token, decoded in registers from the
cache layout's bytes (never a dequantized copy in memory). An item that covers its rows' whole range writes
the final ``out`` / ``lse``; otherwise it writes a normalized partial and its log2-sum-exp to a workspace
slot, and ``_merge_splits_kernel`` combines a group's slots by their LSE.

``DOT_DTYPE`` is the operand type of the matrix products: the query dtype on the GPU, float32 in Triton's
interpreter (whose ``tl.dot`` multiplies bfloat16 bit patterns, triton-lang/triton#11584); operands are
rounded exactly as on the GPU first, so the interpreter checks the same arithmetic.

Row ``r`` of a request sees its first ``visible[r]`` keys (the causal frontier; a DCP shard's local
prefix). Rows that see nothing give out 0 and lse -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # host side: the softmax scale is passed premultiplied by log2(e)
LN2 = tl.constexpr(0.6931471805599453)
NOPE = tl.constexpr(512)  # latent (value) width of a cache entry
ROPE = tl.constexpr(64)   # rope width


@triton.jit
def _load_keys(cache, slot, n_ok, LAYOUT: tl.constexpr, BYTES_PER_TOKEN: tl.constexpr):
    """Keys of the tokens at cache ``slot`` ``[BLOCK_N]`` as bf16: ``(k_nope [BLOCK_N, 512], k_rope [BLOCK_N, 64])``.

    Rows where ``n_ok`` is False read nothing and come back as zeros (never the poisoned bytes).
    """
    row = cache + slot[:, None] * BYTES_PER_TOKEN  # byte address of each token
    if LAYOUT == "bf16":
        words = row.to(tl.pointer_type(tl.bfloat16))
        k_nope = tl.load(words + tl.arange(0, NOPE)[None, :], mask=n_ok[:, None], other=0.0)
        k_rope = tl.load(words + NOPE + tl.arange(0, ROPE)[None, :], mask=n_ok[:, None], other=0.0)
    else:
        tl.static_assert(False, "unknown cache layout")
    return k_nope, k_rope


@triton.jit
def _scores(q_nope, q_rope, k_nope, k_rope, HEADS_AS_N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """``Q K^T`` ``[BLOCK_M, BLOCK_N]`` in float32. ``HEADS_AS_N`` computes it as ``(K Q^T)^T``: the keys take the
    tensor cores' 64-row side, so a block of 16 or 32 query rows uses Hopper's wgmma without padding."""
    if HEADS_AS_N:
        s = tl.dot(k_nope.to(DOT_DTYPE), tl.trans(q_nope.to(DOT_DTYPE)))
        s = tl.trans(tl.dot(k_rope.to(DOT_DTYPE), tl.trans(q_rope.to(DOT_DTYPE)), s))
    else:
        s = tl.dot(q_nope.to(DOT_DTYPE), tl.trans(k_nope.to(DOT_DTYPE)))
        s = tl.dot(q_rope.to(DOT_DTYPE), tl.trans(k_rope.to(DOT_DTYPE)), s)
    return s


@triton.jit
def _accumulate(acc, alpha, p, k_nope, HEADS_AS_N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """``acc * alpha + P V`` with V = ``k_nope`` (the key tile is the value tile); ``acc`` is ``O^T`` ``[512, BLOCK_M]``
    when ``HEADS_AS_N``, else ``O`` ``[BLOCK_M, 512]``."""
    if HEADS_AS_N:
        acc = tl.dot(tl.trans(k_nope.to(DOT_DTYPE)), tl.trans(p.to(DOT_DTYPE)), acc * alpha[None, :])
    else:
        acc = tl.dot(p.to(DOT_DTYPE), k_nope.to(DOT_DTYPE), acc * alpha[:, None])
    return acc


@triton.jit
def _decode_split_kernel(
    q, stride_qt, stride_qh,            # [T, H, 576] queries
    cache,                              # uint8 base of the paged cache, BYTES_PER_TOKEN bytes per slot
    block_table, stride_bt,             # [B, max_blocks] int32
    query_start,                        # [B+1] int32
    visible,                            # [T] int32: keys of its request each query token may see
    work,                               # [num_items, 5] int32: request, row block, kv start, kv end, slot
    out, stride_ot, stride_oh,          # [T, H, 512] final output
    lse, stride_lt,                     # [T, H] float32 natural-log lse
    part_out, part_lse,                 # [num_slots, BLOCK_M, 512] / [num_slots, BLOCK_M] float32
    qk_scale,                           # softmax scale * log2(e) * the layout's global scale
    out_scale,                          # the layout's global value scale (1 where there is none)
    num_heads,
    LAYOUT: tl.constexpr, BYTES_PER_TOKEN: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_AS_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    item = tl.program_id(0)
    request = tl.load(work + item * 5)
    row_block = tl.load(work + item * 5 + 1)
    kv_start = tl.load(work + item * 5 + 2)
    kv_end = tl.load(work + item * 5 + 3)
    slot_out = tl.load(work + item * 5 + 4)

    # Query rows of this item: (token, head) pairs of the request, head fastest.
    q_first = tl.load(query_start + request)
    q_len = tl.load(query_start + request + 1) - q_first
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * num_heads
    token = q_first + rows // num_heads
    head = rows % num_heads
    # Each row sees keys [kv_start, limit): its causal frontier, clipped to this item's range.
    limit = tl.minimum(tl.load(visible + token, mask=row_ok, other=0), kv_end)

    q_row = q + token.to(tl.int64) * stride_qt + head * stride_qh
    q_nope = tl.load(q_row[:, None] + tl.arange(0, NOPE)[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_row[:, None] + NOPE + tl.arange(0, ROPE)[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the log2-scaled scores
    l_i = tl.zeros([BLOCK_M], tl.float32)                # running sum of exp2(score - m_i)
    if HEADS_AS_N:
        acc = tl.zeros([NOPE, BLOCK_M], tl.float32)      # transposed: O^T
    else:
        acc = tl.zeros([BLOCK_M, NOPE], tl.float32)
    pages = block_table + request.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        page = tl.load(pages + offs_n // PAGE_SIZE, mask=n_ok, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        k_nope, k_rope = _load_keys(cache, slot, n_ok, LAYOUT, BYTES_PER_TOKEN)

        s = _scores(q_nope, q_rope, k_nope, k_rope, HEADS_AS_N, DOT_DTYPE)
        s = tl.where(offs_n[None, :] < limit[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at 0
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _accumulate(acc, alpha, p.to(q.dtype.element_ty), k_nope, HEADS_AS_N, DOT_DTYPE)
        m_i = m_new

    if HEADS_AS_N:
        acc = tl.trans(acc)
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    cols = tl.arange(0, NOPE)
    if slot_out < 0:  # the item covers its rows' whole range: final result
        o = o * out_scale
        out_row = out + token.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_row[:, None] + cols[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse + token.to(tl.int64) * stride_lt + head, lse2 * LN2, mask=row_ok)
    else:
        part = slot_out.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(part_out + part[:, None] * NOPE + cols[None, :], o)
        tl.store(part_lse + part, lse2)


@triton.jit
def _merge_splits_kernel(
    groups,                             # [num_groups, 4] int32: request, row block, first slot, slots
    query_start,
    part_out, part_lse,                 # as written by _decode_split_kernel
    out, stride_ot, stride_oh,
    lse, stride_lt,
    out_scale, num_heads,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):
    """Merge the partial results of one group's splits for ``ROWS`` rows and ``COLS`` output columns."""
    group = tl.program_id(0)
    request = tl.load(groups + group * 4)
    row_block = tl.load(groups + group * 4 + 1)
    first = tl.load(groups + group * 4 + 2)
    count = tl.load(groups + group * 4 + 3)

    local = tl.program_id(1) * ROWS + tl.arange(0, ROWS)      # rows within the row block
    cols = tl.program_id(2) * COLS + tl.arange(0, COLS)
    q_first = tl.load(query_start + request)
    q_len = tl.load(query_start + request + 1) - q_first
    rows = row_block * BLOCK_M + local
    row_ok = rows < q_len * num_heads

    m = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, COLS], tl.float32)
    for i in range(count):
        part = (first + i).to(tl.int64) * BLOCK_M + local
        lse_i = tl.load(part_lse + part)
        o_i = tl.load(part_out + part[:, None] * NOPE + cols[None, :])
        m_new = tl.maximum(m, lse_i)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_use)
        w = tl.math.exp2(lse_i - m_use)
        total = total * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o_i
        m = m_new

    seen = total > 0.0
    o = acc / tl.where(seen, total, 1.0)[:, None] * out_scale
    token = q_first + rows // num_heads
    head = rows % num_heads
    out_row = out + token.to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_row[:, None] + cols[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])
    if tl.program_id(2) == 0:
        lse_row = tl.where(seen, m + tl.math.log2(tl.where(seen, total, 1.0)), float("-inf"))
        tl.store(lse + token.to(tl.int64) * stride_lt + head, lse_row * LN2, mask=row_ok)
