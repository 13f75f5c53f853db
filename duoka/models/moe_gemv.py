"""Triton kernels for one token's MoE layer (batch-1 decode of a Qwen2-MoE; GPU only).

At one token the experts' work is k matrix-vector products per projection, bound by reading
the chosen experts' weights. The grouped GEMM that serves many tokens (torch's cutlass
kernel) tiles each expert's output 128 wide, so one token's k experts make too few programs
to keep an H100's 132 SMs reading: 1.2 TB/s of its 3.0 (bench/NOTES.md 41). Here each
program reads BLOCK_N rows of one chosen expert's weight, so a token's experts make hundreds
of programs, and the token needs no sort by expert, no group offsets and no permutation back.

The experts (`expert_gemv`), two kernels: gate and up together (the two weights' rows of one
expert read side by side, SwiGLU applied in fp32, the product rounded to the weights' dtype as
the grouped path rounds it), then down, each (token, expert) row scaled by its routing weight
in fp32; the caller sums the rows. (Summing them inside the down kernel, one program per output
tile looping over the k experts, read the weights at 60% of this layout's rate: NOTES 45.) A
shared expert (Qwen2-MoE's, behind a sigmoid gate) rides in the same two kernels as one more
row a token, in place of its own GEMMs and SwiGLU kernel.

The routing (`route_one_token`), two kernels: the router's E logits and the shared expert's
gate logit as one GEMV (each rounded to the compute dtype, as F.linear's output is), then one
program for the softmax in fp32, the top-k and its renormalisation. At one token torch's
routing took ~8 kernels a layer (two cuBLAS GEMVs, a reduction, the softmax, a radix top-k and
a bitonic sort), ~17% of the A2.7B's step in kernels and as much again in gaps between them
(bench/NOTES.md 44). Everything is read on the device: a CUDA graph replays it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

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


class SharedExpert(NamedTuple):
    """A MoE layer's shared expert for expert_gemv: gate and up [hidden, dim] and down [dim, hidden],
    each with unit stride along its reduction (rows of nn.Linear weights, views of a packed one
    allowed), and its gate logit [T, 1] (the output scaled by its sigmoid)."""
    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    gate_logit: torch.Tensor


# The interpreter's tiles (CPU tests) and the first of the GPU's candidates: one token's 4-8
# experts x (1,408-2,560 / 16) programs for gate/up and x (2,048-3,584 / 16) for down; 16 rows x
# 256 values of bf16 is 8 KB a load. At these tiles the A2.7B's experts read at 1.8-1.95 TB/s of
# an H100's 3.0 (bench/NOTES.md 43), so on a GPU Triton's autotuner picks among CANDIDATES once
# per shape, in the warm-up forward that every CUDA graph capture runs first (runner.capture_graph).
DEFAULT_TILES = GemvTiles(16, 256)
CANDIDATES = (DEFAULT_TILES, GemvTiles(8, 256), GemvTiles(8, 512), GemvTiles(4, 512), GemvTiles(16, 128),
              GemvTiles(16, 512, 8), GemvTiles(32, 256, 8), GemvTiles(32, 128), GemvTiles(4, 256))

# The router GEMV's (rows, reduction block) tiles: E + 1 = 61-65 rows of 2,048-3,584 (Qwen2-MoE).
# Its 250-460 KB take under a microsecond to read, so the kernel is bound by each program's chain
# of loads: at 4 rows x 256 (8 dependent loads a row) it took 4.5 us (NOTES 45); a block of the
# whole row reads in one or two. The first is the interpreter's.
ROUTER_CANDIDATES = ((4, 256), (1, 2048), (2, 2048), (1, 4096), (2, 1024), (4, 1024), (4, 512))


# Triton's interpreter runs the kernels on CPU tensors (the tests): set before Triton is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _gate_up_rows(X, W1, W3, H, x_row, h_row, hidden, dim, w_base, stride_wn, tile,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """BLOCK_N of one expert's silu(w1 x) * w3 x, rounded to H's dtype."""
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_N], dtype=tl.float32)
        base = w_base + n[:, None] * stride_wn
        for k0 in range(0, dim, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < dim
            x = tl.load(X + x_row * dim + k, mask=k_ok, other=0.0).to(tl.float32)
            mask = n_ok[:, None] & k_ok[None, :]
            w1 = tl.load(W1 + base + k[None, :], mask=mask, other=0.0).to(tl.float32)
            w3 = tl.load(W3 + base + k[None, :], mask=mask, other=0.0).to(tl.float32)
            gate += tl.sum(w1 * x[None, :], axis=1)
            up += tl.sum(w3 * x[None, :], axis=1)
        h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
        tl.store(H + h_row * hidden + n, h.to(H.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _gate_up_kernel(X, W1, W3, EXPERTS, H, S1, S3, HS, tokens, hidden, dim, stride_we, stride_wn,
                        shared_hidden, stride_sn, TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Programs over (token, slot) rows x tiles of `hidden`, then over tokens x tiles of the
        # shared expert's `shared_hidden` (none when it is 0).
        pid = tl.program_id(0)
        routed_tiles = tl.cdiv(hidden, BLOCK_N)
        routed_programs = tokens * TOPK * routed_tiles
        if pid < routed_programs:
            row = pid // routed_tiles
            expert = tl.load(EXPERTS + row).to(tl.int64)
            _gate_up_rows(X, W1, W3, H, row // TOPK, row, hidden, dim, expert * stride_we, stride_wn,
                          pid % routed_tiles, BLOCK_N, BLOCK_K)
        else:
            shared_tiles = tl.cdiv(shared_hidden, BLOCK_N)
            token = (pid - routed_programs) // shared_tiles
            _gate_up_rows(X, S1, S3, HS, token, token, shared_hidden, dim, (token * 0).to(tl.int64), stride_sn,
                          (pid - routed_programs) % shared_tiles, BLOCK_N, BLOCK_K)

    @triton.jit
    def _down_rows(H, W2, Y, h_row, y_row, hidden, dim, w_base, stride_wn, weight, tile,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """BLOCK_N of weight x w2 h for one expert, in fp32."""
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < dim
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        base = w_base + n[:, None] * stride_wn
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            h = tl.load(H + h_row * hidden + k, mask=k_ok, other=0.0).to(tl.float32)
            w2 = tl.load(W2 + base + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w2 * h[None, :], axis=1)
        tl.store(Y + y_row * dim + n, acc * weight, mask=n_ok)

    @triton.jit
    def _down_kernel(H, W2, EXPERTS, WEIGHTS, Y, HS, S2, GATE, tokens, hidden, dim, stride_we, stride_wn,
                     shared_hidden, stride_sn, TOPK: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        # Rows: (token, slot) for the routed experts, then one a token for the shared expert,
        # scaled by sigmoid of its gate logit; Y [tokens, SLOTS, dim] (SLOTS = TOPK, + 1 if shared).
        pid = tl.program_id(0)
        tiles = tl.cdiv(dim, BLOCK_N)
        row = pid // tiles
        if row < tokens * TOPK:
            expert = tl.load(EXPERTS + row).to(tl.int64)
            weight = tl.load(WEIGHTS + row).to(tl.float32)
            _down_rows(H, W2, Y, row, (row // TOPK) * SLOTS + row % TOPK, hidden, dim, expert * stride_we,
                       stride_wn, weight, pid % tiles, BLOCK_N, BLOCK_K)
        else:
            token = row - tokens * TOPK
            gate = tl.load(GATE + token).to(tl.float32)
            _down_rows(HS, S2, Y, token, token * SLOTS + TOPK, shared_hidden, dim, (token * 0).to(tl.int64),
                       stride_sn, 1.0 / (1.0 + tl.exp(-gate)), pid % tiles, BLOCK_N, BLOCK_K)

    @triton.jit
    def _router_logits_kernel(X, WR, WG, LOGITS, GATE, n_experts, dim, stride_wr, BLOCK_E: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        # Rows 0..E-1 the router's, row E the shared expert's gate: one GEMV over both.
        r = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        is_router = r < n_experts
        is_gate = r == n_experts
        acc = tl.zeros([BLOCK_E], dtype=tl.float32)
        for k0 in range(0, dim, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < dim
            x = tl.load(X + k, mask=k_ok, other=0.0).to(tl.float32)
            wr = tl.load(WR + r[:, None] * stride_wr + k[None, :], mask=is_router[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(WG + r[:, None] * 0 + k[None, :], mask=is_gate[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum((wr.to(tl.float32) + wg.to(tl.float32)) * x[None, :], axis=1)  # one of the two is 0
        tl.store(LOGITS + r, acc.to(LOGITS.dtype.element_ty), mask=is_router)
        tl.store(GATE + r * 0, acc.to(GATE.dtype.element_ty), mask=is_gate)

    @triton.jit
    def _router_topk_kernel(LOGITS, WEIGHTS, EXPERTS, n_experts, TOPK: tl.constexpr, SLOTS: tl.constexpr,
                            NORM: tl.constexpr, BLOCK_E: tl.constexpr):
        e = tl.arange(0, BLOCK_E)
        ok = e < n_experts
        logits = tl.load(LOGITS + e, mask=ok, other=float("-inf")).to(tl.float32)
        p = tl.exp(logits - tl.max(logits, axis=0))
        left = tl.where(ok, p / tl.sum(p, axis=0), -1.0)  # the softmax; -1 marks taken or absent experts
        slots = tl.arange(0, SLOTS)
        chosen = tl.zeros([SLOTS], dtype=tl.int64)
        probs = tl.zeros([SLOTS], dtype=tl.float32)
        for slot in tl.static_range(TOPK):  # most probable first; of equals, the lowest index
            best = tl.max(left, axis=0)
            pick = tl.min(tl.where(left == best, e, BLOCK_E), axis=0)
            chosen = tl.where(slots == slot, pick.to(tl.int64), chosen)
            probs = tl.where(slots == slot, best, probs)
            left = tl.where(e == pick, -1.0, left)
        if NORM:
            probs = probs / tl.sum(probs, axis=0)
        tl.store(EXPERTS + slots, chosen, mask=slots < TOPK)
        tl.store(WEIGHTS + slots, probs.to(WEIGHTS.dtype.element_ty), mask=slots < TOPK)

    def _tuned(kernel):
        configs = [triton.Config({"BLOCK_N": t.block_n, "BLOCK_K": t.block_k}, num_warps=t.num_warps)
                   for t in CANDIDATES]
        return triton.autotune(configs, key=["hidden", "dim", "tokens", "shared_hidden"])(kernel)

    _gate_up_tuned, _down_tuned = _tuned(_gate_up_kernel), _tuned(_down_kernel)
    _router_tuned = triton.autotune([triton.Config({"BLOCK_E": e, "BLOCK_K": k}) for e, k in ROUTER_CANDIDATES],
                                    key=["n_experts", "dim"])(_router_logits_kernel)


def chosen_tiles() -> dict[str, GemvTiles | None]:
    """The autotuner's pick for each expert kernel's last shape (None before a GPU call): for the bench."""
    if triton is None:
        return {"gate_up": None, "down": None}
    picks = {}
    for name, tuned in (("gate_up", _gate_up_tuned), ("down", _down_tuned)):
        best = getattr(tuned, "best_config", None)
        picks[name] = None if best is None else GemvTiles(best.kwargs["BLOCK_N"], best.kwargs["BLOCK_K"],
                                                          best.num_warps)
    return picks


def expert_gemv(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, shared: SharedExpert | None = None, tiles: GemvTiles | None = None) -> torch.Tensor:
    """x [T, dim] (a few tokens), experts [T, k] int64 and weights [T, k] (the routing's top-k)
    -> [T, k, dim] fp32 ([T, k + 1, dim] with `shared`): for each token's k experts, weight x w2
    (silu(w1 x) * w3 x), then the shared expert's output x sigmoid(its gate logit). The caller
    sums over the rows and rounds (outside a custom op, so that the compiler fuses that sum into
    the layer's next kernel: inside, it took two kernels of its own). w1, w3 [E, hidden, dim]; w2
    [E, dim, hidden]; each expert's rows contiguous. tiles: these instead of the autotuner's (on
    the interpreter: DEFAULT_TILES unless given)."""
    tokens, top_k = experts.shape
    _, hidden, dim = w1.shape
    if not all(w.is_contiguous() for w in (w1, w3, w2)):  # w1 and w3 share their strides in the kernel
        raise ValueError("expert_gemv reads contiguous expert weights (a copy each step would cost more than it saves)")
    x = x.contiguous()
    flat_experts, flat_weights = experts.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    h = torch.empty(tokens * top_k, hidden, device=x.device, dtype=w1.dtype)
    slots = top_k + (shared is not None)
    y = torch.empty(tokens, slots, dim, device=x.device, dtype=torch.float32)
    if shared is None:  # the kernels' shared-expert arguments unused: no program reaches them
        s1, s3, s2, gate, hs, shared_hidden = w1, w3, w2, flat_weights, h, 0
    else:
        s1, s3, s2, gate = shared.w1, shared.w3, shared.w2, shared.gate_logit.reshape(-1).contiguous()
        shared_hidden = s1.shape[0]
        if not (shared_hidden and s1.shape == s3.shape == (shared_hidden, dim) and s2.shape == (dim, shared_hidden)
                and s1.stride() == s3.stride() and s1.stride(1) == s2.stride(1) == 1):
            raise ValueError("expert_gemv's shared expert: gate and up [hidden, dim] with one layout, down "
                             "[dim, hidden], each row contiguous, hidden > 0 (none at all: shared=None)")
        hs = torch.empty(tokens, shared_hidden, device=x.device, dtype=s1.dtype)
    gate_up_args = (x, w1, w3, flat_experts, h, s1, s3, hs, tokens, hidden, dim, w1.stride(0), w1.stride(1),
                    shared_hidden, s1.stride(0))
    down_args = (h, w2, flat_experts, flat_weights, y, hs, s2, gate, tokens, hidden, dim, w2.stride(0),
                 w2.stride(1), shared_hidden, s2.stride(0))

    def gate_up_grid(block_n: int) -> tuple[int]:
        return (tokens * top_k * triton.cdiv(hidden, block_n) + tokens * triton.cdiv(shared_hidden, block_n),)

    def down_grid(block_n: int) -> tuple[int]:
        return (tokens * slots * triton.cdiv(dim, block_n),)

    if tiles is None and INTERPRETED:
        tiles = DEFAULT_TILES
    if tiles is None:
        _gate_up_tuned[lambda meta: gate_up_grid(meta["BLOCK_N"])](*gate_up_args, TOPK=top_k)
        _down_tuned[lambda meta: down_grid(meta["BLOCK_N"])](*down_args, TOPK=top_k, SLOTS=slots)
    else:
        meta = {"BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "num_warps": tiles.num_warps}
        _gate_up_kernel[gate_up_grid(tiles.block_n)](*gate_up_args, TOPK=top_k, **meta)
        _down_kernel[down_grid(tiles.block_n)](*down_args, TOPK=top_k, SLOTS=slots, **meta)
    return y


def route_one_token(x: torch.Tensor, router_weight: torch.Tensor, gate_weight: torch.Tensor, top_k: int,
                    norm_topk_prob: bool, tile: tuple[int, int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's routing, as moe.route computes it, and its shared-expert gate logit.

    x [1, dim]; router_weight [E, dim]; gate_weight [1, dim] -> (weights [1, k] in x's dtype,
    experts [1, k] int64 most probable first, gate logit [1, 1] in x's dtype). tile: the GEMV's
    (rows, reduction block) instead of the autotuner's (on the interpreter: the first candidate)."""
    if x.shape[0] != 1 or not (router_weight.dtype == gate_weight.dtype == x.dtype):
        raise ValueError(f"route_one_token routes one token in its weights' dtype, not {tuple(x.shape)} {x.dtype}")
    n_experts, dim = router_weight.shape
    if router_weight.stride(1) != 1 or not gate_weight.is_contiguous():
        raise ValueError("route_one_token reads the router's rows contiguous")
    x = x.contiguous()
    logits = torch.empty(n_experts, device=x.device, dtype=x.dtype)
    gate_logit = torch.empty(1, 1, device=x.device, dtype=x.dtype)
    weights = torch.empty(1, top_k, device=x.device, dtype=x.dtype)
    experts = torch.empty(1, top_k, device=x.device, dtype=torch.int64)
    args = (x, router_weight, gate_weight, logits, gate_logit, n_experts, dim, router_weight.stride(0))
    if tile is None and INTERPRETED:
        tile = ROUTER_CANDIDATES[0]
    if tile is None:
        _router_tuned[lambda meta: (triton.cdiv(n_experts + 1, meta["BLOCK_E"]),)](*args)
    else:
        _router_logits_kernel[(triton.cdiv(n_experts + 1, tile[0]),)](*args, BLOCK_E=tile[0], BLOCK_K=tile[1])
    _router_topk_kernel[(1,)](logits, weights, experts, n_experts, TOPK=top_k, SLOTS=triton.next_power_of_2(top_k),
                              NORM=norm_topk_prob, BLOCK_E=triton.next_power_of_2(n_experts))
    return weights, experts, gate_logit
