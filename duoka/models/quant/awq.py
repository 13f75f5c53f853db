"""AWQ checkpoints in AutoAWQ's GEMM layout (Qwen's -AWQ releases) as quantized linear layers.

A module's tensors, 4 bits, 8 values per int32, lowest bits first:
    qweight int32 [in, out / 8]      packed along the OUTPUT dim
    qzeros  int32 [groups, out / 8]  packed the same way
    scales  float [groups, out]      (fp16 as written)
    bias    float [out]              when the module has one
with W[o, i] = (q[i, o] - z[i // group_size, o]) * scales[i // group_size, o]. The 8 values in
one int32 are interleaved: the value in bits 4k..4k+3 of packed column c is output column
c * 8 + AWQ_ORDER[k] (AutoAWQ's WQLinear_GEMM.from_linear order_map); reading back takes
AWQ_REVERSE_ORDER, its inverse (AutoAWQ's packing_utils, vLLM's awq_triton).
"""

from __future__ import annotations

import torch

from duoka.errors import DuokaError
from duoka.models.quant.base import Part, QuantizedLinear, QuantScheme, TensorSource
from duoka.models.quant.group_kernels import build_group_linear
from duoka.models.quant.groupwise import FLOAT_DTYPES, GroupInts, checked, concat_parts, group_count, unpack_cols

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def read_awq(source: TensorSource, parts: list[Part], scheme: QuantScheme, bias: bool, device: torch.device,
             dtype: torch.dtype) -> QuantizedLinear:
    """The projection made of `parts` (concatenated along the output rows, each its shard) from an
    AWQ GEMM checkpoint, on `device`: the kernel group_kernels.py picks."""
    if scheme.bits != 4:
        raise DuokaError(f"AWQ with {scheme.bits} bits is not supported", "use a 4-bit AWQ checkpoint (GEMM layout)")
    pieces = [read_awq_part(source, part.prefix, scheme, bias, device).shard(part.shard, part.prefix)
              for part in parts]
    return build_group_linear(concat_parts(pieces, [p.prefix for p in parts]), 4, device, dtype)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] in AWQ's interleaved order -> uint8 [R, 8 C] in output-column order."""
    values = unpack_cols(packed, 4).view(packed.shape[0], -1, 8)  # [R, C, nibble]
    reverse = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    return values.index_select(2, reverse).reshape(packed.shape[0], -1)


def read_awq_part(source: TensorSource, prefix: str, scheme: QuantScheme, bias: bool,
                  device: torch.device) -> GroupInts:
    """One checkpoint module, whole, unpacked on `device`."""
    fix = (f"the checkpoint does not match its config.json quantization_config (awq, 4 bits, GEMM, group_size "
           f"{scheme.group_size}); re-export it with AutoAWQ (version gemm) or correct config.json")
    qweight = checked(source, f"{prefix}.qweight", (torch.int32,), None, fix)
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    groups = group_count(prefix, in_features, scheme.group_size)
    scales = checked(source, f"{prefix}.scales", FLOAT_DTYPES, (groups, out_features), fix)
    try:
        qzeros = checked(source, f"{prefix}.qzeros", (torch.int32,), (groups, out_features // 8), fix)
    except KeyError:
        raise DuokaError(f"checkpoint tensor {prefix}.qzeros is missing: AWQ's GEMM layout always stores zero "
                         f"points (zero_point: true)", fix) from None
    b = checked(source, f"{prefix}.bias", FLOAT_DTYPES, (out_features,), fix) if bias else None
    q = unpack_awq(qweight.to(device)).t().contiguous()
    zeros = unpack_awq(qzeros.to(device))
    group_size = in_features if scheme.group_size == -1 else scheme.group_size
    g_idx = torch.arange(in_features, device=device) // group_size
    return GroupInts(q, zeros, scales.to(device), g_idx, group_size, None if b is None else b.to(device))
