"""What every quantized format implements, and what the loader (quant/load.py) gives them.

A format reads one projection of the served model from a checkpoint: possibly several of the
checkpoint's modules concatenated along the output rows (the serving model packs q/k/v into
one projection and gate/up into another), each possibly a tensor-parallel shard of its
weight [out, in], and returns a QuantizedLinear on the device, which replaces the model's
nn.Linear: forward(x) computes x @ W.T + bias for W the weight the format stores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

# A checkpoint tensor by its full name (e.g. "model.layers.0.self_attn.q_proj.qweight");
# raises KeyError for a name the checkpoint lacks.
TensorSource = Callable[[str], torch.Tensor]

# A tensor-parallel shard of a module's logical weight [out, in]: (dim, start, stop), dim 0
# keeping output rows start:stop, dim 1 input columns start:stop; None: the whole weight.
Shard = tuple[int, int, int] | None


@dataclass(frozen=True)
class Part:
    """One checkpoint module that makes (part of) a served projection."""
    prefix: str
    """The module's name in the checkpoint, e.g. "model.layers.0.self_attn.q_proj"."""
    shard: Shard = None


@dataclass(frozen=True)
class QuantScheme:
    """How a model's projections are quantized. Read from a folder's config.json
    `quantization_config`, or made from `--quantization fp8` for a bf16 checkpoint."""
    method: str
    """"fp8" (a bf16 checkpoint quantized at load), "compressed-tensors" (FP8 as llm-compressor
    writes it), "gptq" or "awq"."""
    bits: int = 8
    group_size: int = -1
    """Input columns sharing a scale (and zero); -1: one per output row (per channel)."""
    desc_act: bool = False
    """GPTQ's act-order: input columns grouped in the order of g_idx, not contiguously."""
    sym: bool = True
    """GPTQ: symmetric (no zero points stored other than the constant midpoint)."""
    checkpoint_format: str = "gptq"
    """GPTQ's zero-point convention: "gptq" (stored zeros are the real zeros minus one, as
    AutoGPTQ writes) or "gptq_v2"."""
    weight_per_tensor: bool = False
    """compressed-tensors FP8: one weight scale per tensor instead of per output row."""


class QuantizedLinear(nn.Module):
    """A projection whose weight is stored quantized. Subclasses set in_features,
    out_features and bias (None or a tensor [out] in the compute dtype) and implement
    forward, dequantize and weight_bytes."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] the stored values stand for, in the compute dtype (tests and
        reference paths)."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes the stored weight takes on its device (scales, zeros and indices included)."""
        raise NotImplementedError


# A format's reader: (source, the parts concatenated along the output rows, scheme, whether
# the projection has a bias, device, compute dtype) -> the projection on the device.
Reader = Callable[[TensorSource, list[Part], QuantScheme, bool, torch.device, torch.dtype], QuantizedLinear]
