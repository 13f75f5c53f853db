"""`--load-format dummy`: a model folder's architecture with random weights made on the device,
no weight files read (vLLM's `--load-format dummy`). For measuring a shape that is not on
this machine's disk (Qwen2-72B's 145 GB), never for answers: the server says so at start.

Weights are normal(0, 0.02) matrices (the spread of Qwen2's init), norms 1, biases 0, each
drawn from a generator seeded by the tensor's name, so a run is repeatable. Quantized at
load (--quantization fp8), each projection is drawn whole in the compute dtype, quantized
and dropped before the next: the bf16 model never exists at once, as with a real checkpoint.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from duoka.models.quant.base import TensorSource
from duoka.models.qwen2.args import ModelArgs

INIT_STD = 0.02  # Qwen2's initializer_range


def _generator(name: str, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))


def _hf_shape(name: str, args: ModelArgs) -> tuple[int, ...]:
    """The shape of a decoder projection's tensor in the HF layout (q/k/v/o, gate/up/down)."""
    hd = args.resolved_head_dim
    rows = {"q_proj": args.n_heads * hd, "k_proj": args.n_kv_heads * hd, "v_proj": args.n_kv_heads * hd,
            "o_proj": args.dim, "gate_proj": args.intermediate_size, "up_proj": args.intermediate_size,
            "down_proj": args.dim}
    cols = {"o_proj": args.n_heads * hd, "down_proj": args.intermediate_size}
    module, _, kind = name.rpartition(".")
    proj = module.rpartition(".")[2]
    if proj not in rows or kind not in ("weight", "bias"):
        raise KeyError(name)
    return (rows[proj],) if kind == "bias" else (rows[proj], cols.get(proj, args.dim))


def random_source(args: ModelArgs, device: torch.device, dtype: torch.dtype) -> TensorSource:
    """A TensorSource of random decoder projections (what the quantized loader reads); biases
    exist where Qwen2 has them (q/k/v)."""
    def get(name: str) -> torch.Tensor:
        shape = _hf_shape(name, args)
        if len(shape) == 1:
            if not any(p in name for p in ("q_proj", "k_proj", "v_proj")):
                raise KeyError(name)
            return torch.zeros(shape, device=device, dtype=dtype)
        out = torch.empty(shape, device=device, dtype=dtype)
        return out.normal_(0.0, INIT_STD, generator=_generator(name, device))

    return get


@torch.no_grad()
def fill_random_(model: nn.Module) -> None:
    """Random weights into an allocated (uninitialised) model, in place: matrices normal(0,
    0.02), vectors named like norms 1, other vectors (biases) 0. Tied weights are filled once."""
    for name, p in {id(p): (n, p) for n, p in model.named_parameters()}.values():
        if p.dim() >= 2:
            p.normal_(0.0, INIT_STD, generator=_generator(name, p.device))
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.zero_()
