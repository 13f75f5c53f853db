"""A Triton kernel for a whole serving step's attention over the paged KV cache: prefill
chunks and decodes alike, with nothing read on the host (GPU only).

What it is for: a step that holds a prefill chunk otherwise runs its attention as flash
attention over contexts gathered per step, whose sizes the host must know; such a step cannot
be replayed from a CUDA graph, and run eagerly it is bound by the host (~1.3 ms a layer of a
7B, bench/NOTES.md 31 and 36). This kernel takes the sizes from device tensors only, so the
runner captures whole mixed steps of a few bucketed token counts (serve.runner).

One program per (tile of up to BLOCK_Q query rows of one sequence, KV head): it loads those
rows for the KV head's whole group of query heads ([BLOCK_Q x group, head_dim], so GQA reads
each K/V tile once for the group), and walks the sequence's context through its block table
in tiles of BLOCK_N keys with an online softmax (FlashAttention, arXiv:2205.14135), causal:
query row i of a sequence with q_len new tokens and context ctx sits at position
ctx - q_len + i. The grid has T // BLOCK_Q + B tiles for T token rows and B sequences;
sequence s owns tiles QS[s] // BLOCK_Q + s up to QS[s + 1] // BLOCK_Q + s (at least as many as
its rows need), found by a binary search over QS; tiles past a sequence's rows exit at once.
Rows of no sequence (a CUDA graph's padding) are left zero.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds carry no Triton
    triton = None

# Keys per tile: four 16-token blocks, as the decode kernel.
BLOCK_N = 64
# Query rows x group heads per program: 64 or more (a [M, BLOCK_N] score tile; tl.dot needs
# M >= 16), at least 16 query rows.
ROWS_X_GROUP = 64
MIN_BLOCK_Q = 16


def available() -> bool:
    return triton is not None


def block_q(group: int) -> int:
    """Query rows per tile for a GQA group of `group` query heads per KV head."""
    return max(MIN_BLOCK_Q, ROWS_X_GROUP // triton.next_power_of_2(group))


if triton is not None:

    @triton.jit
    def _sequence_of(QS, tile, num_seqs, BLOCK_Q: tl.constexpr):
        # The last s with QS[s] // BLOCK_Q + s <= tile (that start is non-decreasing in s).
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            start = tl.load(QS + mid) // BLOCK_Q + mid
            if start <= tile:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _mixed_kernel(Q, K, V, BT, CL, QS, OUT, scale, num_seqs,
                      stride_qt, stride_qh, stride_kb, stride_kp, stride_kh, stride_bt, stride_ot, stride_oh,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                      BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr):
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        s = _sequence_of(QS, tile, num_seqs, BLOCK_Q)
        q_begin = tl.load(QS + s)
        q_end = tl.load(QS + s + 1)
        row0 = q_begin + (tile - (q_begin // BLOCK_Q + s)) * BLOCK_Q
        if row0 < q_end:
            ctx = tl.load(CL + s)
            rows = row0 + tl.arange(0, BLOCK_Q)
            row_ok = rows < q_end
            offs_g = tl.arange(0, GROUP_PAD)
            g_ok = offs_g < GROUP
            heads = kvh * GROUP + offs_g
            offs_d = tl.arange(0, D)
            io_mask = row_ok[:, None, None] & g_ok[None, :, None]
            q = tl.load(Q + rows[:, None, None] * stride_qt + heads[None, :, None] * stride_qh + offs_d[None, None, :],
                        mask=io_mask, other=0.0)
            q = tl.reshape(q, (BLOCK_Q * GROUP_PAD, D))
            # Each row's context position, repeated for its group's heads.
            pos = tl.reshape(tl.broadcast_to((ctx - q_end + rows)[:, None], (BLOCK_Q, GROUP_PAD)),
                             (BLOCK_Q * GROUP_PAD,))
            # Keys up to the tile's last row's position. Key 0 is in the first tile and every row
            # sees it, so the running maximum is finite from the first tile on.
            last = tl.minimum(ctx, ctx - q_end + row0 + BLOCK_Q)
            m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
            total = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
            acc = tl.zeros([BLOCK_Q * GROUP_PAD, D], dtype=tl.float32)
            for n0 in range(0, last, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                nmask = offs_n < last
                page = tl.load(BT + s * stride_bt + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
                kv = page * stride_kb + (offs_n % PAGE) * stride_kp + kvh * stride_kh
                k = tl.load(K + kv[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
                scores = tl.dot(q, tl.trans(k)) * scale
                scores = tl.where(nmask[None, :] & (offs_n[None, :] <= pos[:, None]), scores, float("-inf"))
                m_new = tl.maximum(m, tl.max(scores, 1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(scores - m_new[:, None])
                total = total * alpha + tl.sum(p, 1)
                v = tl.load(V + kv[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m = m_new
            out = tl.reshape(acc / total[:, None], (BLOCK_Q, GROUP_PAD, D))
            tl.store(OUT + rows[:, None, None] * stride_ot + heads[None, :, None] * stride_oh + offs_d[None, None, :],
                     out.to(OUT.dtype.element_ty), mask=io_mask)


def _warps(tile_elements: int) -> int:
    """Warps per program: a [128, 128] fp32 accumulator beside its query tile and scores would
    exceed a thread's 255 registers at Triton's default of 4 (spilled to local memory)."""
    return 8 if tile_elements >= 8192 else 4


def mixed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, query_start: torch.Tensor) -> torch.Tensor:
    """q [T, heads, head_dim] (the step's rows, their K/V already in the cache) -> [T, heads,
    head_dim]; sequence b's rows are query_start[b]:query_start[b + 1], the last of its
    context_lens[b] tokens. Rows of no sequence come out zero. Launch shapes depend on T and B
    only: the call is the same for every step of a CUDA graph's bucket."""
    n_rows, n_heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = n_heads // kv_heads
    rows_per_tile = block_q(group)
    num_seqs = len(context_lens)
    out = torch.zeros_like(q)
    grid = (n_rows // rows_per_tile + num_seqs, kv_heads)
    _mixed_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, query_start, out, 1.0 / math.sqrt(head_dim), num_seqs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), D=head_dim, PAGE=page, BLOCK_Q=rows_per_tile,
        BLOCK_N=BLOCK_N, num_warps=_warps(rows_per_tile * triton.next_power_of_2(group) * head_dim),
    )
    return out
