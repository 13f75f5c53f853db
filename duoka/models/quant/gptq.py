"""GPTQ checkpoints (AutoGPTQ, GPTQModel; Qwen's GPTQ-Int4/Int8 releases) as quantized linear
layers.

A module's tensors, for bits b in {4, 8} and pack = 32 / b values per int32, lowest bits first:
    qweight int32 [in / pack, out]     packed along the input dim
    qzeros  int32 [groups, out / pack] packed along the output dim
    scales  float [groups, out]        (fp16 as written)
    g_idx   int32 [in]                 group of each input column (act-order shuffles them)
    bias    float [out]                when the module has one
and W[o, i] = (q[i, o] - z[g_idx[i], o]) * scales[g_idx[i], o]. checkpoint_format "gptq" (v1,
AutoGPTQ's) stores z - 1 (its packer's `zeros -= 1`; its readers add 1 back); "gptq_v2"
(GPTQModel's) stores z. Symmetric checkpoints store the midpoint z = 2**(b-1) like any zero.
"""

from __future__ import annotations

import torch

from duoka.errors import DuokaError
from duoka.models.quant.base import Part, QuantizedLinear, QuantScheme, TensorSource
from duoka.models.quant.group_kernels import build_group_linear
from duoka.models.quant.groupwise import (
    FLOAT_DTYPES,
    GroupInts,
    checked,
    concat_parts,
    group_count,
    unpack_cols,
    unpack_rows,
)

FORMATS = ("gptq", "gptq_v2")


def read_gptq(source: TensorSource, parts: list[Part], scheme: QuantScheme, bias: bool, device: torch.device,
              dtype: torch.dtype) -> QuantizedLinear:
    """The projection made of `parts` (concatenated along the output rows, each its shard) from a
    GPTQ checkpoint, on `device`: the kernel group_kernels.py picks."""
    check_gptq_scheme(scheme)
    pieces = [read_gptq_part(source, part.prefix, scheme, bias, device).shard(part.shard, part.prefix)
              for part in parts]
    return build_group_linear(concat_parts(pieces, [p.prefix for p in parts]), scheme.bits, device, dtype)


def check_gptq_scheme(scheme: QuantScheme) -> None:
    if scheme.bits not in (4, 8):
        raise DuokaError(f"GPTQ with {scheme.bits} bits is not supported", "use a 4- or 8-bit GPTQ checkpoint")
    if scheme.checkpoint_format not in FORMATS:
        raise DuokaError(f"GPTQ checkpoint_format {scheme.checkpoint_format!r} is not supported (its qweight is "
                         f"not in GPTQ's layout)", "use a checkpoint saved in the gptq or gptq_v2 format "
                         "(GPTQModel converts with its save options)")


def read_gptq_part(source: TensorSource, prefix: str, scheme: QuantScheme, bias: bool,
                   device: torch.device) -> GroupInts:
    """One checkpoint module, whole, unpacked on `device`."""
    bits, pack = scheme.bits, 32 // scheme.bits
    fix = (f"the checkpoint does not match its config.json quantization_config (gptq, {bits} bits, group_size "
           f"{scheme.group_size}); re-export it with GPTQModel/AutoGPTQ or correct config.json")
    qweight = checked(source, f"{prefix}.qweight", (torch.int32,), None, fix)
    in_features, out_features = qweight.shape[0] * pack, qweight.shape[1]
    groups = group_count(prefix, in_features, scheme.group_size)
    if out_features % pack:
        raise DuokaError(f"checkpoint tensor {prefix}.qweight has {out_features} output columns, not a multiple of "
                         f"{pack}, so its qzeros cannot be packed {pack} to an int32", fix)
    scales = checked(source, f"{prefix}.scales", FLOAT_DTYPES, (groups, out_features), fix)
    try:
        qzeros = checked(source, f"{prefix}.qzeros", (torch.int32,), (groups, out_features // pack), fix)
    except KeyError:
        raise DuokaError(f"checkpoint tensor {prefix}.qzeros is missing: GPTQ stores zero points for every "
                         f"module, the midpoint for symmetric ones", fix) from None
    g_idx = _g_idx(source, prefix, in_features, groups, scheme, fix)
    b = checked(source, f"{prefix}.bias", FLOAT_DTYPES, (out_features,), fix) if bias else None
    q = unpack_rows(qweight.to(device), bits).t()
    zeros = unpack_cols(qzeros.to(device), bits)
    if scheme.checkpoint_format == "gptq":
        # v1 stores z - 1 in b bits; z = 0 was stored as 2**b - 1, so the sum wraps (AutoGPTQ's
        # reference masks it the same way).
        zeros = ((zeros.int() + 1) & ((1 << bits) - 1)).to(torch.uint8)
    group_size = in_features if scheme.group_size == -1 else scheme.group_size
    return GroupInts(q.contiguous(), zeros, scales.to(device), g_idx.to(device), group_size,
                     None if b is None else b.to(device))


def _g_idx(source: TensorSource, prefix: str, in_features: int, groups: int, scheme: QuantScheme,
           fix: str) -> torch.Tensor:
    """The group of each input column: the checkpoint's g_idx, which is what its weights mean
    (AutoGPTQ packs and dequantizes by it), or contiguous groups when it has none."""
    name = f"{prefix}.g_idx"
    try:
        g_idx = checked(source, name, (torch.int32, torch.int64), (in_features,), fix, ndim=1)
    except KeyError:
        if scheme.desc_act:
            raise DuokaError(f"checkpoint tensor {name} is missing, and act-order (desc_act) needs it to know "
                             f"which columns share a group", fix) from None
        size = in_features // groups
        return torch.arange(in_features) // size
    g_idx = g_idx.long()
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise DuokaError(f"checkpoint tensor {name} names groups outside 0..{groups - 1} (its scales have "
                         f"{groups} groups)", fix)
    return g_idx
