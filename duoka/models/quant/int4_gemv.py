"""A Triton GEMV for one token row against a 4-bit group-wise weight in gemlite's packing
(GPTQ/AWQ at batch-1 decode; GPU only, and the interpreter in the tests).

Why a kernel of ours: at one row an int4 matmul is a read of the packed weight, but gemlite's
GEMV and PyTorch's tinygemm read it at ~1.5-1.6 TB/s of an H100's 3.0 (a 7B layer 74-87 us where
the weight read allows ~40; bench/NOTES.md 25-26): widening each 4-bit value to a float costs
them an integer-to-float conversion, an instruction that issues at an eighth of the FMA rate,
and gemlite's reverse split-K adds one fp32 atomic per output per 16 columns. Marlin-class
kernels, which do better, install as no wheel here. This kernel widens a value with a shift,
one bitwise op and a float subtraction (the nibble OR-ed into the mantissa of 2**23, the
exact float 2**23 + q, minus 2**23), and each program owns its output rows over the whole
reduction: no atomics, one kernel per projection.

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
# N = 3,584-37,888 outputs: 16-32 rows a program make 112-2,368 programs for 132 SMs, and 16-64
# words (128-512 columns) of 16-32 rows are 1-8 KB a load, several in flight (num_stages). A
# tile holds at least 4 words a thread (words x rows >= 128 x num_warps): fewer would leave
# threads computing copies of others' values.
DEFAULT_TILES = Int4Tiles(32, 16)
CANDIDATES = (DEFAULT_TILES, Int4Tiles(16, 16, 2), Int4Tiles(16, 32), Int4Tiles(16, 64), Int4Tiles(32, 32),
              Int4Tiles(8, 64), Int4Tiles(64, 16, 8), Int4Tiles(16, 32, 4, 4), Int4Tiles(32, 16, 4, 4),
              Int4Tiles(8, 32, 2))


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _int4_gemv_kernel(X, W, S, Z, Y, N, WORDS, GROUP_WORDS, BLOCK_N: tl.constexpr, BLOCK_WORDS: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        acc = tl.zeros([BLOCK_WORDS, BLOCK_N], dtype=tl.float32)
        for w0 in range(0, WORDS, BLOCK_WORDS):
            w = w0 + tl.arange(0, BLOCK_WORDS)
            w_ok = w < WORDS
            mask = w_ok[:, None] & n_ok[None, :]
            packed = tl.load(W + w[:, None] * N + n[None, :], mask=mask, other=0)
            group = w // GROUP_WORDS
            scale = tl.load(S + group[:, None] * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
            shift = tl.load(Z + group[:, None] * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
            part = tl.zeros([BLOCK_WORDS, BLOCK_N], dtype=tl.float32)
            x_sum = tl.zeros([BLOCK_WORDS], dtype=tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(X + w * 8 + j, mask=w_ok, other=0.0).to(tl.float32)
                # 0x4B000000 is the float 2**23; OR-ed into its mantissa, q makes 2**23 + q exactly.
                q = ((packed >> (4 * j)) & 0xF) | 0x4B000000
                part += (q.to(tl.float32, bitcast=True) - 8388608.0) * xj[:, None]
                x_sum += xj
            acc += part * scale + shift * x_sum[:, None]
        tl.store(Y + n, tl.sum(acc, axis=0).to(Y.dtype.element_ty), mask=n_ok)

    _int4_gemv_tuned = triton.autotune(
        [triton.Config({"BLOCK_N": t.block_n, "BLOCK_WORDS": t.block_words}, num_warps=t.num_warps,
                       num_stages=t.num_stages) for t in CANDIDATES],
        key=["N", "WORDS", "GROUP_WORDS"])(_int4_gemv_kernel)


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
    """x [1, K] -> [1, N] = x @ W.T in x's dtype, W the layout above (layout_problem(...) None).
    tiles: these instead of the autotuner's (on the interpreter: DEFAULT_TILES unless given)."""
    words, n = w_q.shape
    if x.shape != (1, words * 8):
        raise ValueError(f"int4_gemv takes one row of {words * 8} values, not {tuple(x.shape)}")
    x = x.contiguous()
    y = torch.empty(1, n, device=x.device, dtype=x.dtype)
    args = (x, w_q, scales, shifts, y, n, words, group_size // 8)
    if tiles is None and INTERPRETED:
        tiles = DEFAULT_TILES
    if tiles is None:
        _int4_gemv_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args)
    else:
        _int4_gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
            *args, BLOCK_N=tiles.block_n, BLOCK_WORDS=tiles.block_words, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages)
    return y


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (values < 16) -> int32 [K/8, N] in the layout above, as gemlite packs a
    4-bit weight over 32-bit words (gemlite.bitpack.pack_weights_over_cols, transposed): for the
    tests and for a check of gemlite's own packing."""
    n, k = q.shape
    words = q.to(torch.int64).view(n, k // 8, 8) << (4 * torch.arange(8, device=q.device))
    packed = words.sum(dim=-1)  # the eight nibbles occupy disjoint bits: their sum is their OR
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).t().contiguous()
