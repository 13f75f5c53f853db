"""Triton kernels for the routed experts of one token (batch-1 decode of a Qwen2-MoE; GPU only).

At one token the experts' work is k matrix-vector products per projection, bound by reading
the chosen experts' weights. The grouped GEMM that serves many tokens (torch's cutlass
kernel) tiles each expert's output 128 wide, so one token's k experts make too few programs
to keep an H100's 132 SMs reading: 1.2 TB/s of its 3.0 (bench/NOTES.md 41). Here each
program reads BLOCK_N rows of one chosen expert's weight, so a token's experts make hundreds
of programs, and the token needs no sort by expert, no group offsets and no permutation back.

Two kernels: gate and up together (the two weights' rows of one expert read side by side,
SwiGLU applied in fp32, the product rounded to the weights' dtype as the grouped path rounds
it), then down, each (token, expert) row scaled by its routing weight in fp32; the k rows
are summed by the caller. Everything is read on the device: a CUDA graph replays it.
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


@dataclass(frozen=True)
class GemvTiles:
    """One program's tile: block_n output rows of one expert, the reduction block_k at a time."""
    block_n: int
    block_k: int
    num_warps: int = 4


# The interpreter's tiles (CPU tests) and the first of the GPU's candidates: one token's 4-8
# experts x (1,408-2,560 / 16) programs for gate/up and x (2,048-3,584 / 16) for down; 16 rows x
# 256 values of bf16 is 8 KB a load. At these tiles the A2.7B's experts read at 1.8-1.95 TB/s of
# an H100's 3.0 (bench/NOTES.md 43), so on a GPU Triton's autotuner picks among CANDIDATES once
# per shape, in the warm-up forward that every CUDA graph capture runs first (runner.capture_graph).
DEFAULT_TILES = GemvTiles(16, 256)
CANDIDATES = (DEFAULT_TILES, GemvTiles(8, 256), GemvTiles(8, 512), GemvTiles(4, 512), GemvTiles(16, 128),
              GemvTiles(16, 512, 8), GemvTiles(32, 256, 8), GemvTiles(32, 128))


# Triton's interpreter runs the kernels on CPU tensors (the tests): set before Triton is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _gate_up_kernel(X, W1, W3, EXPERTS, H, rows, hidden, dim, stride_we, stride_wn, TOPK: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)  # (token, slot): token row // TOPK
        tile = tl.program_id(1)
        expert = tl.load(EXPERTS + row).to(tl.int64)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_N], dtype=tl.float32)
        base = expert * stride_we + n[:, None] * stride_wn
        for k0 in range(0, dim, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < dim
            x = tl.load(X + (row // TOPK) * dim + k, mask=k_ok, other=0.0).to(tl.float32)
            mask = n_ok[:, None] & k_ok[None, :]
            w1 = tl.load(W1 + base + k[None, :], mask=mask, other=0.0).to(tl.float32)
            w3 = tl.load(W3 + base + k[None, :], mask=mask, other=0.0).to(tl.float32)
            gate += tl.sum(w1 * x[None, :], axis=1)
            up += tl.sum(w3 * x[None, :], axis=1)
        h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
        tl.store(H + row * hidden + n, h.to(H.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _down_kernel(H, W2, EXPERTS, WEIGHTS, Y, rows, hidden, dim, stride_we, stride_wn,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)
        tile = tl.program_id(1)
        expert = tl.load(EXPERTS + row).to(tl.int64)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < dim
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        base = expert * stride_we + n[:, None] * stride_wn
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            h = tl.load(H + row * hidden + k, mask=k_ok, other=0.0).to(tl.float32)
            w2 = tl.load(W2 + base + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w2 * h[None, :], axis=1)
        weight = tl.load(WEIGHTS + row).to(tl.float32)
        tl.store(Y + row * dim + n, acc * weight, mask=n_ok)

    def _tuned(kernel):
        configs = [triton.Config({"BLOCK_N": t.block_n, "BLOCK_K": t.block_k}, num_warps=t.num_warps)
                   for t in CANDIDATES]
        return triton.autotune(configs, key=["hidden", "dim", "rows"])(kernel)

    _gate_up_tuned, _down_tuned = _tuned(_gate_up_kernel), _tuned(_down_kernel)


def chosen_tiles() -> dict[str, GemvTiles | None]:
    """The autotuner's pick for each kernel's last shape (None before a GPU call): for the bench."""
    if triton is None:
        return {"gate_up": None, "down": None}
    picks = {}
    for name, tuned in (("gate_up", _gate_up_tuned), ("down", _down_tuned)):
        best = getattr(tuned, "best_config", None)
        picks[name] = None if best is None else GemvTiles(best.kwargs["BLOCK_N"], best.kwargs["BLOCK_K"],
                                                          best.num_warps)
    return picks


def expert_gemv(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, tiles: GemvTiles | None = None) -> torch.Tensor:
    """x [T, dim] (a few tokens), experts [T, k] int64 and weights [T, k] (the routing's top-k)
    -> [T, dim] in x's dtype: sum over each token's k experts of weight x w2 (silu(w1 x) * w3 x).
    w1, w3 [E, hidden, dim]; w2 [E, dim, hidden]; each expert's rows contiguous. tiles: these
    instead of the autotuner's (on the interpreter: DEFAULT_TILES unless given)."""
    tokens, top_k = experts.shape
    _, hidden, dim = w1.shape
    rows = tokens * top_k
    if not all(w.is_contiguous() for w in (w1, w3, w2)):  # w1 and w3 share their strides in the kernel
        raise ValueError("expert_gemv reads contiguous expert weights (a copy each step would cost more than it saves)")
    x = x.contiguous()
    flat_experts, flat_weights = experts.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    h = torch.empty(rows, hidden, device=x.device, dtype=w1.dtype)
    y = torch.empty(rows, dim, device=x.device, dtype=torch.float32)
    gate_up_args = (x, w1, w3, flat_experts, h, rows, hidden, dim, w1.stride(0), w1.stride(1))
    down_args = (h, w2, flat_experts, flat_weights, y, rows, hidden, dim, w2.stride(0), w2.stride(1))
    if tiles is None and INTERPRETED:
        tiles = DEFAULT_TILES
    if tiles is None:
        _gate_up_tuned[lambda meta: (rows, triton.cdiv(hidden, meta["BLOCK_N"]))](*gate_up_args, TOPK=top_k)
        _down_tuned[lambda meta: (rows, triton.cdiv(dim, meta["BLOCK_N"]))](*down_args)
    else:
        _gate_up_kernel[(rows, triton.cdiv(hidden, tiles.block_n))](
            *gate_up_args, TOPK=top_k, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps)
        _down_kernel[(rows, triton.cdiv(dim, tiles.block_n))](
            *down_args, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps)
    return y.view(tokens, top_k, dim).sum(dim=1).to(x.dtype)
