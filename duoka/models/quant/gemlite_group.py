"""The CUDA path for 4- and 8-bit group-wise weights (GPTQ, AWQ) at every batch size:
gemlite's Triton kernels (A16Wn), one packed copy of the weight, the kernel picked by the
step's token rows (a GEMV for decode, split-K GEMM for a few dozen rows, a tiled GEMM for
prefill).

Why not tinygemm alone (tinygemm.py, the path where gemlite is not installed): its int4 mm
is a GEMV at heart and scales linearly with rows (one H100, a 7B layer: 74 us at one row,
1,042 us at 64, where bf16 takes 161), so a 2,048-token prefill ran ~20x slower than bf16
and a batch of 64 decodes 6x slower (bench/results/quant/kernels_7b.run1.txt). gemlite is
within 10% of tinygemm at one row and 4x faster from 16 rows up.

Weights use the canonical form of groupwise.py: W = (q - z) * s per group of consecutive input
columns; act-order checkpoints are made consecutive by permuting the columns at load and
gathering x's columns in forward, as tinygemm.py does.
"""

from __future__ import annotations

import torch

from duoka.models.quant.base import QuantizedLinear
from duoka.models.quant.groupwise import GroupInts, uniform_groups, unpermuted_columns
from duoka.models.quant.small_batch import load_gemlite

GEMLITE_BITS = (4, 8)
GEMLITE_DTYPES = (torch.bfloat16, torch.float16)
MIN_GROUP_SIZE = 16  # gemlite's kernels tile a group by at least 16 columns
IN_FEATURES_MULTIPLE = 32  # gemlite's packing (8 nibbles per int32) and its smallest K tile

# Token rows for which gemlite's split-K GEMM replaces its default, a GEMV that loops over
# the rows up to 4 (so 3-4 rows cost 3-4x one). One H200, a 7B layer (q/k/v, o, gate/up, down
# summed; bench/results/quant/kernels_int4_h200.txt): 3 rows 225 us split-K vs 255 default,
# 4 rows 225 vs 295; at 2 rows the default wins (161 vs 204).
SPLIT_K_ROWS = (3, 4)


def gemlite_problem(ints: GroupInts, bits: int, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why gemlite cannot serve this weight (None: it can), gemlite's installation aside."""
    if bits not in GEMLITE_BITS:
        return f"{bits}-bit weights (gemlite's group-wise kernels take 4 or 8 bits here)"
    if device.type != "cuda":
        return f"device {device.type} (gemlite's kernels are CUDA Triton kernels)"
    if dtype not in GEMLITE_DTYPES:
        return f"compute dtype {str(dtype).removeprefix('torch.')} (gemlite takes bf16 or fp16 activations)"
    if ints.group_size < MIN_GROUP_SIZE or ints.in_features % ints.group_size:
        return f"group size {ints.group_size} (gemlite needs groups of at least {MIN_GROUP_SIZE} that divide the width)"
    if ints.in_features % IN_FEATURES_MULTIPLE:
        return f"input width {ints.in_features} (gemlite needs a multiple of {IN_FEATURES_MULTIPLE})"
    if not uniform_groups(ints):
        return "groups of unequal size (an act-order weight's input-column shard)"
    return None


class GemliteGroupLinear(QuantizedLinear):
    """4- or 8-bit group-wise weights packed for gemlite on a CUDA device."""

    def __init__(self, ints: GroupInts, bits: int, dtype: torch.dtype):
        super().__init__()
        if load_gemlite() is None:  # build_group_linear checks first: reaching here is a bug
            raise RuntimeError("GemliteGroupLinear built without gemlite installed")
        from gemlite.core import GEMLITE_MATMUL_TYPES_MAPPING
        from gemlite.helper import A16Wn

        self.in_features, self.out_features = ints.in_features, ints.out_features
        self.bits, self.group_size, self.dtype = bits, ints.group_size, dtype
        self.kernel, self.reason = "gemlite", None
        perm = None if ints.contiguous else torch.argsort(ints.g_idx, stable=True)
        q = ints.q if perm is None else ints.q.index_select(1, perm)
        # gemlite's convention is ours: W = (q - z) * s, scales and zeros [out, groups] in the
        # activations' dtype (integer zeros exact; scales rounded once, as tinygemm does).
        layer = A16Wn(device=q.device, dtype=dtype).from_weights(
            q.contiguous(), ints.scales.t().contiguous(), ints.zeros.t().contiguous(), bits, self.group_size)
        tensor_args = [t.detach() for t in layer.get_tensor_args()]
        self.arg_names = tuple(f"gemlite_arg{i}" for i in range(len(tensor_args)))
        for name, t in zip(self.arg_names, tensor_args):  # buffers: moved and counted with the module
            self.register_buffer(name, t, persistent=False)
        self.meta_args = list(layer.get_meta_args())
        self.register_buffer("perm", perm)
        self.register_buffer("bias", None if ints.bias is None else ints.bias.to(dtype))
        self.split_k = GEMLITE_MATMUL_TYPES_MAPPING["GEMM_SPLITK"]

    def tensor_args(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.arg_names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or not x.is_cuda:  # built for one dtype on its GPU: a bug upstream
            raise RuntimeError(f"gemlite layer for {self.dtype} got {x.dtype} on {x.device}")
        rows = x.reshape(-1, self.in_features)
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        # A guard on the row count under torch.compile; captured graphs have static rows anyway.
        kernel = self.split_k if rows.shape[0] in SPLIT_K_ROWS else -1
        out = torch.ops.gemlite.forward_functional(rows.contiguous(), None, self.tensor_args(), self.meta_args,
                                                   kernel)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        # The layer applied to the identity gives W_perm.T.
        eye = torch.eye(self.in_features, device=self.gemlite_arg0.device, dtype=self.dtype)
        w_perm = torch.ops.gemlite.forward_functional(eye, None, self.tensor_args(), self.meta_args, -1).t()
        return unpermuted_columns(w_perm, self.perm)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, kernel=gemlite, act_order={self.perm is not None}")
