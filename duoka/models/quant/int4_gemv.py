"""A Triton GEMV for one to four token rows against a 4-bit group-wise weight in gemlite's
packing (GPTQ/AWQ decoding at batch 1-4; GPU only, and the interpreter in the tests).

Why a kernel of ours: at one row an int4 matmul is a read of the packed weight, but gemlite's
GEMV and PyTorch's tinygemm read it at ~1.5-1.6 TB/s of an H100's 3.0 (a 7B layer 74-87 us where
the weight read allows ~40; bench/NOTES.md 25-26): widening each 4-bit value to a float costs
them an integer-to-float conversion, an instruction that issues at an eighth of the FMA rate,
and gemlite's reverse split-K adds one fp32 atomic per output per 16 columns. Marlin-class
kernels, which do better, install as no wheel here. This kernel widens a value with one bitwise
op and a float subtraction: the nibble, masked in place, OR-ed into the float 2**23 makes
2**23 + q * 16**i exactly (one shift a word brings the upper four nibbles down), and x / 16**i
takes the power of sixteen back. Each program owns its output rows over the whole reduction: no
atomics, one kernel per projection. Compiled offline for sm_90 (bench/kernel_sass.py) its main
loop issues ~5.0 instructions a weight, against 7.3 for the first form of it (a shift, a mask
and an OR a value, a load of x a weight) and gemlite's 8.3-9.1. Up to four token rows (decoding
at batch 2-4, where gemlite's kernels took 1.85-3.4x their one-row time on an H200) share each
widened weight: 6.9, 8.7 and 10.7 instructions a weight for 2, 3 and 4 rows.

The layout is gemlite's A16Wn (4-bit, `fma_mode`), read in place so that a layer keeps one copy
of its weight: W_q int32 [K/8, N], contiguous, word w of output n holding q[n, 8w + j] in bits
4j..4j+3; scales and shifts [K/group_size, N] in the activations' dtype, with
W[n, k] = q[n, k] * scales[g, n] + shifts[g, n] for g = k // group_size (shifts = -z * s).
Per word row the program sums x * q over the word's 8 columns in fp32, then adds
s * that + shift * (the 8 x values' sum): each group's scale applied once per word.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds carry no Triton
    triton = None

# Triton's interpreter runs the kernel on CPU tensors (the tests): set before Triton is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAGIC_BITS = 0x4B000000  # the float 2**23, whose mantissa's low 23 bits count units
MAX_ROWS = 4  # token rows one launch takes: each shares the widened weights, each adds an FFMA a weight


@dataclass(frozen=True)
class Int4Tiles:
    """One program's tile: block_n output rows, the reduction block_words packed words (8 columns
    each) at a time."""
    block_n: int
    block_words: int
    num_warps: int = 4
    num_stages: int = 3


# The interpreter's tile (CPU tests) and the GPU's candidates, which Triton's autotuner tries once
# per (N, K) in the warm-up forward that every CUDA graph capture runs first. A 7B projection has
# N = 3,584-37,888 outputs: 8-64 rows a program make 56-4,736 programs for 132 SMs. Each tile gives
# a thread 8 or 16 words (block_n x block_words / (32 x num_warps)): at 4 the loop's fixed work
# (the x loads, the scales) costs 5.75 instructions a weight, at 8 5.05, at 16 4.99 (sm_90,
# bench/kernel_sass.py).
DEFAULT_TILES = Int4Tiles(32, 32)
CANDIDATES = (DEFAULT_TILES, Int4Tiles(16, 64), Int4Tiles(64, 16), Int4Tiles(8, 64, 2), Int4Tiles(16, 32, 2),
              Int4Tiles(32, 64), Int4Tiles(64, 32), Int4Tiles(16, 64, 2), Int4Tiles(64, 32, 8),
              Int4Tiles(32, 32, 4, 4))


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _row_part(X, row, K, w, w_ok, j: tl.constexpr, q, part, x_sum, EVEN: tl.constexpr):
        """One x row's share of nibble j of each word: part += q * x, x_sum += x."""
        if EVEN:
            xj = tl.load(X + row * K + w * 8 + j).to(tl.float32)
        else:
            xj = tl.load(X + row * K + w * 8 + j, mask=w_ok, other=0.0).to(tl.float32)
        i: tl.constexpr = j % 4
        # q holds the nibble times 16**i (read in place): x / 16**i is exact, a power of two.
        x_scaled = xj if i == 0 else xj * (0.0625 if i == 1 else (0.00390625 if i == 2 else 0.000244140625))
        return part + q * x_scaled[:, None], x_sum + xj

    @triton.jit
    def _int4_gemv_kernel(X, W, S, Z, Y, N, WORDS, MAGIC_BITS, GROUP_WORDS: tl.constexpr, ROWS: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_WORDS: tl.constexpr, EVEN: tl.constexpr):
        # ROWS (1-4) x rows share each widened weight; their sums are kept apart (separate tensors:
        # a [ROWS, words, n] one made Triton move every tile through shared memory, 2x the
        # instructions). EVEN: the tile divides N and WORDS (every 7B shape): no load needs a mask.
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        K = WORDS * 8
        acc0 = tl.zeros([BLOCK_WORDS, BLOCK_N], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_WORDS, BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_WORDS, BLOCK_N], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_WORDS, BLOCK_N], dtype=tl.float32)
        for w0 in range(0, WORDS, BLOCK_WORDS):
            w = w0 + tl.arange(0, BLOCK_WORDS)
            w_ok = w < WORDS
            at = w[:, None] * N + n[None, :]
            meta = (w // GROUP_WORDS)[:, None] * N + n[None, :]
            if EVEN:
                packed = tl.load(W + at)
                scale = tl.load(S + meta).to(tl.float32)
                shift = tl.load(Z + meta).to(tl.float32)
            else:
                mask = w_ok[:, None] & n_ok[None, :]
                packed = tl.load(W + at, mask=mask, other=0)
                scale = tl.load(S + meta, mask=mask, other=0.0).to(tl.float32)
                shift = tl.load(Z + meta, mask=mask, other=0.0).to(tl.float32)
            high = packed >> 16  # nibbles 4-7 where 0-3 are, read by the same masks
            p0 = tl.zeros([BLOCK_WORDS, BLOCK_N], dtype=tl.float32)
            p1 = tl.zeros([BLOCK_WORDS, BLOCK_N], dtype=tl.float32)
            p2 = tl.zeros([BLOCK_WORDS, BLOCK_N], dtype=tl.float32)
            p3 = tl.zeros([BLOCK_WORDS, BLOCK_N], dtype=tl.float32)
            s0 = tl.zeros([BLOCK_WORDS], dtype=tl.float32)
            s1 = tl.zeros([BLOCK_WORDS], dtype=tl.float32)
            s2 = tl.zeros([BLOCK_WORDS], dtype=tl.float32)
            s3 = tl.zeros([BLOCK_WORDS], dtype=tl.float32)
            for j in tl.static_range(8):
                # Nibble j % 4 in place OR-ed into the float 2**23 (MAGIC_BITS, an argument so that
                # the mask is the instruction's one immediate) is 2**23 + q * 16**(j % 4) exactly.
                bits = ((packed if j < 4 else high) & (0xF << (4 * (j % 4)))) | MAGIC_BITS
                q = bits.to(tl.float32, bitcast=True) - 8388608.0
                p0, s0 = _row_part(X, 0, K, w, w_ok, j, q, p0, s0, EVEN)
                if ROWS > 1:
                    p1, s1 = _row_part(X, 1, K, w, w_ok, j, q, p1, s1, EVEN)
                if ROWS > 2:
                    p2, s2 = _row_part(X, 2, K, w, w_ok, j, q, p2, s2, EVEN)
                if ROWS > 3:
                    p3, s3 = _row_part(X, 3, K, w, w_ok, j, q, p3, s3, EVEN)
            acc0 += p0 * scale + shift * s0[:, None]
            if ROWS > 1:
                acc1 += p1 * scale + shift * s1[:, None]
            if ROWS > 2:
                acc2 += p2 * scale + shift * s2[:, None]
            if ROWS > 3:
                acc3 += p3 * scale + shift * s3[:, None]
        tl.store(Y + n, tl.sum(acc0, axis=0).to(Y.dtype.element_ty), mask=n_ok)
        if ROWS > 1:
            tl.store(Y + N + n, tl.sum(acc1, axis=0).to(Y.dtype.element_ty), mask=n_ok)
        if ROWS > 2:
            tl.store(Y + 2 * N + n, tl.sum(acc2, axis=0).to(Y.dtype.element_ty), mask=n_ok)
        if ROWS > 3:
            tl.store(Y + 3 * N + n, tl.sum(acc3, axis=0).to(Y.dtype.element_ty), mask=n_ok)

    _int4_gemv_tuned = triton.autotune(
        [triton.Config({"BLOCK_N": t.block_n, "BLOCK_WORDS": t.block_words}, num_warps=t.num_warps,
                       num_stages=t.num_stages) for t in CANDIDATES],
        key=["N", "WORDS", "GROUP_WORDS", "ROWS"])(triton.heuristics(
            {"EVEN": lambda a: a["N"] % a["BLOCK_N"] == 0 and a["WORDS"] % a["BLOCK_WORDS"] == 0})(_int4_gemv_kernel))


def chosen_tiles() -> Int4Tiles | None:
    """The autotuner's pick for the last shape it tuned (None before a GPU call): for the bench."""
    best = getattr(_int4_gemv_tuned, "best_config", None) if triton is not None else None
    if best is None:
        return None
    return Int4Tiles(best.kwargs["BLOCK_N"], best.kwargs["BLOCK_WORDS"], best.num_warps, best.num_stages)


def layout_problem(w_q: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor, group_size: int) -> str | None:
    """Why int4_gemv cannot read these tensors as the layout above (None: it can)."""
    if w_q.dtype != torch.int32 or w_q.dim() != 2 or not w_q.is_contiguous():
        return f"packed weight {w_q.dtype} {tuple(w_q.shape)} (wants contiguous int32 [K/8, N])"
    words, n = w_q.shape
    if group_size % 8 or (words * 8) % group_size:
        return f"group size {group_size} (wants a multiple of 8 that divides K = {words * 8})"
    want = ((words * 8) // group_size, n)
    if tuple(scales.shape) != want or tuple(shifts.shape) != want or not (scales.is_contiguous()
                                                                             and shifts.is_contiguous()):
        return f"scales {tuple(scales.shape)} and shifts {tuple(shifts.shape)} (want contiguous {want})"
    return None


def int4_gemv(x: torch.Tensor, w_q: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor, group_size: int,
              tiles: Int4Tiles | None = None) -> torch.Tensor:
    """x [R, K], 1 <= R <= MAX_ROWS -> [R, N] = x @ W.T in x's dtype, W the layout above
    (layout_problem(...) None). tiles: these instead of the autotuner's (on the interpreter:
    DEFAULT_TILES unless given)."""
    words, n = w_q.shape
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != words * 8:
        raise ValueError(f"int4_gemv takes 1 to {MAX_ROWS} rows of {words * 8} values, not {tuple(x.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    args = (x, w_q, scales, shifts, y, n, words, MAGIC_BITS)
    meta = {"GROUP_WORDS": group_size // 8, "ROWS": x.shape[0]}
    if tiles is None and INTERPRETED:
        tiles = DEFAULT_TILES
    if tiles is None:
        _int4_gemv_tuned[lambda m: (triton.cdiv(n, m["BLOCK_N"]),)](*args, **meta)
    else:
        even = n % tiles.block_n == 0 and words % tiles.block_words == 0
        _int4_gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
            *args, **meta, BLOCK_N=tiles.block_n, BLOCK_WORDS=tiles.block_words, EVEN=even,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return y


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (values < 16) -> int32 [K/8, N] in the layout above, as gemlite packs a
    4-bit weight over 32-bit words (gemlite.bitpack.pack_weights_over_cols, transposed): for the
    tests and for a check of gemlite's own packing."""
    n, k = q.shape
    words = q.to(torch.int64).view(n, k // 8, 8) << (4 * torch.arange(8, device=q.device))
    packed = words.sum(dim=-1)  # the eight nibbles occupy disjoint bits: their sum is their OR
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).t().contiguous()
