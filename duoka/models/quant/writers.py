"""Round-to-nearest GPTQ and AWQ tensors of a float weight, packed exactly as the checkpoints
store them (gptq.py and awq.py document the layouts): for tests and benchmarks that need
quantized Qwen2 checkpoints without a calibration run. Not GPTQ's error-compensating solver:
the values are what plain rounding gives, the layout is the real one.
"""

from __future__ import annotations

import torch

from duoka.models.quant.awq import AWQ_ORDER


def quantize_to_gptq(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
                     desc_act: bool = False, seed: int = 0,
                     checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """{"qweight", "qzeros", "scales", "g_idx"} of weight [out, in] (a module's tensors without
    its prefix). desc_act: the columns are grouped in a random order drawn from `seed`, as
    act-order leaves them. Zero points as GPTQ's quantizer picks them (min and max with 0 in the
    range; the midpoint when sym); v1 ("gptq") stores zero - 1. Computed on weight's device,
    and returned there."""
    if bits not in (4, 8) or checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"bits {bits}, checkpoint_format {checkpoint_format}")
    out_features, in_features = weight.shape
    device = weight.device
    size = in_features if group_size == -1 else group_size
    order = torch.arange(in_features)
    if desc_act:
        order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    order = order.to(device)
    g_idx = torch.empty(in_features, dtype=torch.int32, device=device)
    g_idx[order] = (torch.arange(in_features, device=device) // size).int()  # column order[k]: group k // size
    grouped = weight.float()[:, order].reshape(out_features, -1, size)  # [out, groups, size]
    maxq = (1 << bits) - 1
    lo = grouped.amin(2).clamp(max=0)
    hi = grouped.amax(2).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = torch.where(lo < 0, -hi, lo)
    flat = (lo == 0) & (hi == 0)  # an all-zero group: GPTQ's quantizer widens it to [-1, 1]
    lo, hi = torch.where(flat, -1.0, lo), torch.where(flat, 1.0, hi)
    scales = ((hi - lo) / maxq).half()  # the fp16 scale the checkpoint keeps is the one rounded with
    if sym:
        zeros = torch.full_like(lo, (maxq + 1) // 2)
    else:
        zeros = torch.round(-lo / scales.float()).clamp(0, maxq)
        if checkpoint_format == "gptq":
            # v1 cannot hold z = 0: its z - 1 = -1 overflows the field in GPTQModel's v1->v2
            # conversion and vLLM's kernels, so keep z >= 1 (a group without negative weights loses
            # its top step).
            zeros = zeros.clamp(min=1)
    q = torch.round(grouped / scales.float().unsqueeze(2) + zeros.unsqueeze(2)).clamp(0, maxq)
    q_cols = torch.empty(out_features, in_features, dtype=torch.int64, device=device)
    q_cols[:, order] = q.reshape(out_features, in_features).long()
    stored = zeros.long() - (1 if checkpoint_format == "gptq" else 0)
    return {"qweight": _pack(q_cols.t(), bits, dim=0),
            "qzeros": _pack(stored.t() & maxq, bits, dim=1),
            "scales": scales.t().contiguous(),
            "g_idx": g_idx}


def quantize_to_awq(weight: torch.Tensor, group_size: int = 128) -> dict[str, torch.Tensor]:
    """{"qweight", "qzeros", "scales"} of weight [out, in] in AutoAWQ's GEMM layout, rounded as
    its pseudo_quantize_tensor does (asymmetric, the range min..max of each group), on weight's
    device."""
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 else group_size
    grouped = weight.float().reshape(out_features, -1, size)
    lo, hi = grouped.amin(2), grouped.amax(2)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = (-torch.round(lo / scales.float())).clamp(0, 15)
    q = torch.round(grouped / scales.float().unsqueeze(2) + zeros.unsqueeze(2)).clamp(0, 15)
    q = q.reshape(out_features, in_features).long()
    return {"qweight": _pack(_awq_interleave(q.t()), 4, dim=1),
            "qzeros": _pack(_awq_interleave(zeros.t().long()), 4, dim=1),
            "scales": scales.t().contiguous()}


def _awq_interleave(values: torch.Tensor) -> torch.Tensor:
    """[R, out] -> [R, out] with each run of 8 columns in the order AWQ packs them: slot k of
    a run holds column AWQ_ORDER[k]."""
    runs = values.reshape(values.shape[0], -1, 8)
    return runs[:, :, list(AWQ_ORDER)].reshape(values.shape)


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int values in [0, 2**bits) -> int32, 32/bits consecutive values along `dim` per int32,
    the first in the lowest bits."""
    pack = 32 // bits
    v = values.long() if dim == 0 else values.long().t()
    if v.shape[0] % pack:
        raise ValueError(f"{v.shape[0]} values along dim {dim} do not pack {pack} to an int32")
    v = v.reshape(-1, pack, v.shape[1])
    shifts = torch.arange(0, 32, bits, device=values.device).view(1, -1, 1)
    word = (v << shifts).sum(1)  # disjoint bit fields: the sum is their OR
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)  # two's complement
    return (word if dim == 0 else word.t()).contiguous()
