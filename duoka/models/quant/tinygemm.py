"""The CUDA path for 4-bit group-wise weights where gemlite is not installed: PyTorch's own
tinygemm kernels (aten._convert_weight_to_int4pack, aten._weight_int4pack_mm), what torchao's
int4 weight-only layout and gpt-fast use (group_kernels.py chooses).

tinygemm's convention (torchao's ZeroPointDomain.FLOAT, PyTorch's int4mm tests): per group
and output row a float scale s and a float zero f, with

    W[o, i] = (q[o, i] - 8) * s + f

GPTQ/AWQ store an integer zero z with W = (q - z) * s, so f = (8 - z) * s, computed at load.
The kernel takes groups of consecutive input columns; act-order's shuffled groups are made
consecutive by permuting the weight's columns by perm = argsort(g_idx) at load and gathering
x[..., perm] in forward (the same product, summed in another order).
"""

from __future__ import annotations

import torch

from duoka.models.quant.base import QuantizedLinear
from duoka.models.quant.groupwise import GroupInts, uniform_groups, unpermuted_columns

TINYGEMM_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm accepts as qGroupSize
_INNER_K_TILES = (8, 4, 2)  # the kernel's k tiling; in_features must be a multiple of 16 * tiles


def tinygemm_problem(ints: GroupInts, bits: int, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why tinygemm cannot serve this weight (None: it can)."""
    if bits != 4:
        return f"{bits}-bit weights (tinygemm is 4-bit only; PyTorch has no group-wise int8 kernel)"
    if device.type != "cuda":
        return f"device {device.type} (tinygemm is CUDA-only)"
    if dtype != torch.bfloat16:
        return f"compute dtype {str(dtype).removeprefix('torch.')} (tinygemm takes bf16 activations)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "a GPU older than sm80 (tinygemm needs bf16 tensor cores)"
    if ints.group_size not in TINYGEMM_GROUP_SIZES:
        return f"group size {ints.group_size} (tinygemm takes {', '.join(map(str, TINYGEMM_GROUP_SIZES))})"
    if ints.out_features % 8 or _inner_k_tiles(ints.in_features) is None:
        return (f"shape {ints.out_features}x{ints.in_features} (tinygemm needs out a multiple of 8, in of 32)")
    if not uniform_groups(ints):
        return "groups of unequal size (an act-order weight's input-column shard)"
    return None


def _inner_k_tiles(in_features: int) -> int | None:
    return next((t for t in _INNER_K_TILES if in_features % (16 * t) == 0), None)


def tinygemm_layout(ints: GroupInts) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(perm, q_perm, scales_and_zeros) for tinygemm, in plain torch (testable on CPU):
    perm [in] int64, None when the groups are already consecutive; q_perm uint8 [out, in],
    column k the input column perm[k]; scales_and_zeros bf16 [groups, out, 2] (s, f)."""
    perm = None if ints.contiguous else torch.argsort(ints.g_idx, stable=True)
    q = ints.q if perm is None else ints.q.index_select(1, perm)
    scales = ints.scales.float()
    # f = (8 - z) * s in float32, rounded once to bf16 (the kernel's dtype for both).
    zero_float = (8.0 - ints.zeros.float()) * scales
    return perm, q.contiguous(), torch.stack([scales, zero_float], dim=2).to(torch.bfloat16).contiguous()


def tinygemm_dequantize(q_perm: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """What tinygemm's formula makes of a layout, float32 [out, in] in the permuted column
    order: the CPU check that the conversion reproduces the checkpoint's weight."""
    sz = scales_and_zeros.float().repeat_interleave(group_size, dim=0)  # [in, out, 2]
    return (q_perm.float() - 8.0) * sz[..., 0].t() + sz[..., 1].t()


def cuda_int4_bytes(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] as _convert_weight_to_int4pack takes it on CUDA (PyTorch >= 2.5):
    column 2j in the high nibble, 2j+1 in the low one (torchao's TensorCoreTiledLayout)."""
    return ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8)


class TinyGemmInt4Linear(QuantizedLinear):
    """4-bit weights in tinygemm's tiled layout on a CUDA device, bf16 activations."""

    def __init__(self, ints: GroupInts):
        super().__init__()
        self.in_features, self.out_features = ints.in_features, ints.out_features
        self.bits, self.group_size, self.dtype = 4, ints.group_size, torch.bfloat16
        self.kernel, self.reason = "tinygemm", None
        self.inner_k_tiles = _inner_k_tiles(self.in_features)
        perm, q_perm, scales_and_zeros = tinygemm_layout(ints)
        packed = torch.ops.aten._convert_weight_to_int4pack(cuda_int4_bytes(q_perm), self.inner_k_tiles)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("perm", perm)
        self.register_buffer("bias", None if ints.bias is None else ints.bias.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device != self.packed.device or x.dtype != torch.bfloat16:  # built for bf16 on its GPU: a bug
            raise RuntimeError(f"tinygemm layer on {self.packed.device} got {x.dtype} on {x.device}; it takes bf16")
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        out = torch.ops.aten._weight_int4pack_mm(rows.contiguous(), self.packed, self.group_size,
                                                 self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        # The kernel applied to the identity gives W_perm.T (torchao dequantizes so too).
        eye = torch.eye(self.in_features, device=self.packed.device, dtype=torch.bfloat16)
        w_perm = torch.ops.aten._weight_int4pack_mm(eye, self.packed, self.group_size, self.scales_and_zeros).t()
        return unpermuted_columns(w_perm, self.perm)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits=4, "
                f"group_size={self.group_size}, kernel=tinygemm, act_order={self.perm is not None}")
