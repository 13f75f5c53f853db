"""A Triton kernel for decode attention over a paged KV cache (GPU only).

One program per (sequence, KV head, split of the context): it loads the query rows of the
KV head's whole group of query heads at once (grouped-query attention reads each K/V tile
once for the group), walks its part of the context through the block table in tiles of
BLOCK_N tokens with an online softmax (FlashAttention, arXiv:2205.14135), and writes a
partial output with its log-sum-exp. Splitting the context (flash-decoding) keeps the GPU
busy when there are few sequences; the partials are merged by their log-sum-exps.
Nothing depends on the host: context lengths are read on the device, so a step can be
replayed from a CUDA graph whatever the lengths are.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds carry no Triton; the reference kernel runs there
    triton = None

# Tokens per tile: four 16-token blocks, a [group, 64] score tile per step.
BLOCK_N = 64
# Aim for about two programs per SM of an H100/H200 (132 SMs) before splitting contexts.
TARGET_PROGRAMS = 264
# A split shorter than this costs more in its merge than it saves.
MIN_SPLIT_TOKENS = 256


def available() -> bool:
    return triton is not None


# At most this many splits: the merge kernel holds every split's partial in one tile.
MAX_SPLITS = 16


def num_splits(batch: int, kv_heads: int, max_context: int) -> int:
    """How many parts each context is cut into: enough programs to fill the GPU, no part
    shorter than MIN_SPLIT_TOKENS. A function of the shapes only, so fixed per CUDA graph."""
    want = max(1, math.ceil(TARGET_PROGRAMS / (batch * kv_heads)))
    return max(1, min(want, max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))


if triton is not None:

    @triton.jit
    def _decode_kernel(Q, K, V, BT, CL, O, LSE, scale,
                       stride_qb, stride_qh, stride_kb, stride_kp, stride_kh, stride_bt,
                       stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK: tl.constexpr):
        # The number of splits is the grid's third dimension, not a compile-time constant:
        # steps of every batch size share one compiled kernel.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        splits = tl.num_programs(2)
        ctx = tl.load(CL + b)
        per_split = tl.cdiv(tl.cdiv(ctx, splits), BLOCK) * BLOCK
        start = split * per_split
        end = tl.minimum(start + per_split, ctx)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, D)
        heads = kvh * GROUP + offs_g
        gmask = offs_g < GROUP
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)

        m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        total = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK):
            offs_n = n0 + tl.arange(0, BLOCK)
            nmask = offs_n < end
            page = tl.load(BT + b * stride_bt + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
            kv = page * stride_kb + (offs_n % PAGE) * stride_kp + kvh * stride_kh
            k = tl.load(K + kv[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(V + kv[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new

        nonempty = total > 0
        out = tl.where(nonempty[:, None], acc / tl.where(nonempty, total, 1.0)[:, None], 0.0)
        lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, total, 1.0)), float("-inf"))
        tl.store(O + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :], out,
                 mask=gmask[:, None])
        tl.store(LSE + b * stride_lb + heads * stride_lh + split, lse, mask=gmask)

    @triton.jit
    def _merge_kernel(O, LSE, OUT, splits, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                      stride_xb, stride_xh, D: tl.constexpr, SPLITS_PAD: tl.constexpr):
        # One program per (sequence, head): the splits' partial outputs weighted by their
        # share of the whole softmax, exp(lse_i - logsumexp(lse)). Split 0 is never empty
        # (a context holds at least the new token), so the maximum is finite.
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, D)
        smask = offs_s < splits
        lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, 0))
        w = w / tl.sum(w, 0)
        part = tl.load(O + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
                       mask=smask[:, None], other=0.0)
        out = tl.sum(part * w[:, None], 0)
        tl.store(OUT + b * stride_xb + h * stride_xh + offs_d, out.to(OUT.dtype.element_ty))

    @triton.jit
    def _write_kv_kernel(K, V, KC, VC, SLOTS, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                         HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, D: tl.constexpr):
        # One program per new token: its keys and values into their slot of the cache.
        t = tl.program_id(0)
        slot = tl.load(SLOTS + t).to(tl.int64)
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, D)
        mask = (offs_h < HEADS)[:, None]
        dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
        k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        tl.store(KC + dst, k, mask=mask)
        v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        tl.store(VC + dst, v, mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, kv_heads, head_dim] (any strides, head_dim contiguous) into their slots of
    the layer's caches [blocks, block_size, kv_heads, head_dim], in one kernel."""
    kv_heads, head_dim = k_cache.shape[-2:]
    kc, vc = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    _write_kv_kernel[(k.shape[0],)](
        k, v, kc, vc, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(0), kc.stride(1),
        HEADS=kv_heads, HEADS_PAD=triton.next_power_of_2(kv_heads), D=head_dim)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, splits: int) -> torch.Tensor:
    """q [B, heads, head_dim] (one new token per sequence, already in the cache) ->
    [B, heads, head_dim]; k/v_cache [blocks, block_size, kv_heads, head_dim]."""
    batch, n_heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = n_heads // kv_heads
    out = torch.empty(batch, n_heads, splits, head_dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(batch, n_heads, splits, device=q.device, dtype=torch.float32)
    _decode_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, lse, 1.0 / math.sqrt(head_dim),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=head_dim, PAGE=page, BLOCK=BLOCK_N,
    )
    if splits == 1:
        return out[:, :, 0].to(q.dtype)
    merged = torch.empty(batch, n_heads, head_dim, device=q.device, dtype=q.dtype)
    _merge_kernel[(batch, n_heads)](
        out, lse, merged, splits, out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        merged.stride(0), merged.stride(1), D=head_dim, SPLITS_PAD=MAX_SPLITS)
    return merged
