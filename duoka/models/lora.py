"""LoRA: low-rank adapters on the linear layers of a frozen base (Hu et al. 2021,
arXiv:2106.09685), configured when the model is built.

A targeted layer computes y = x Wᵀ + b + (alpha / rank) · B(A(dropout(x))), with W and b
the frozen base weights, A [rank, in] and B [out, rank] the adapter. A starts
Kaiming-uniform and B at zero, as PEFT initialises them, so a fresh adapter leaves the
base's function unchanged. The base weights keep their names (`attention.wq.weight`), so
the base loads from a Hugging Face folder as it is; the adapter's are `.lora_a.weight` and
`.lora_b.weight` under the layer (duoka.models.qwen2.peft maps them to PEFT's names).

Targets and the modules trained whole (`modules_to_save`) are given by their Hugging Face
names, as in PEFT's LoraConfig.

QLoRA (Dettmers et al. 2023, arXiv:2305.14314; LoRAArgs.quantize = "nf4"): the frozen
linear weights of the decoder blocks held in 4-bit NormalFloat with double-quantised scales
(torchao's NF4Tensor, which also runs on CPU). The model is built with its usual layers;
`Qwen2.quantize_base_` replaces their weights once the base is filled (loaded or
initialised), because NF4's scales are taken over the whole tensor: quantized whole, every
layout, a resume and `export --merge` rebuild the same values from the base alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from duoka.errors import QUANT_INSTALL, DuokaError

# The Hugging Face names of a Qwen2 decoder layer's linear layers: LoRA's possible targets.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head
# Modules trained whole beside the adapter (PEFT's modules_to_save): the Hugging Face names.
SAVABLE = ("embed_tokens", "lm_head")
ADAPTER_SUFFIXES = (".lora_a.weight", ".lora_b.weight")
QUANTIZE = ("none", "nf4")  # lora.quantize: the frozen base's decoder linear weights as they are, or NF4
# QLoRA's NF4: one absmax scale per 64 weights, the scales quantised again to 8 bits in blocks
# of 256 (double quantisation); torchao's defaults. Every published Qwen2 shape divides into
# them; a tensor too small for one block of 256 scales takes the largest divisor of its count
# of scales instead (nf4_scaler_block), a function of its shape alone.
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
# The base is quantized from its bf16 values (Qwen2's published dtype) whatever the compute
# dtype: fp32 runs (CPU tests) and bf16 runs hold the same NF4 base, and export --merge
# rebuilds it from the base folder alone.
NF4_SOURCE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class LoRAArgs:
    """What the adapter computes: part of the model's definition (its parameters and names),
    unlike ModelOptions, which only choose kernels."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = LINEAR_NAMES
    """Hugging Face names of the adapted linear layers (every decoder layer's)."""
    modules_to_save: tuple[str, ...] = ()
    """Hugging Face names of modules trained whole: embed_tokens, lm_head."""
    quantize: str = "none"
    """The frozen decoder linear weights: "none" (the compute dtype) or "nf4" (QLoRA)."""

    def __post_init__(self):
        if self.rank < 1:
            raise DuokaError(f"lora.rank={self.rank}: an adapter needs a rank of 1 or more",
                             "set lora.rank > 0 (8-64 are usual), or 0 to train every weight")
        if not 0.0 <= self.dropout < 1.0:
            raise DuokaError(f"lora.dropout={self.dropout} is outside [0, 1)", "use e.g. 0.05, or 0 for none")
        if self.quantize not in QUANTIZE:
            raise DuokaError(f"lora.quantize={self.quantize!r} is not a known format",
                             f"use one of {', '.join(QUANTIZE)}")
        if not self.targets:
            raise DuokaError("lora.target_modules names no layer", f'use "{ALL_LINEAR}" or some of {", ".join(LINEAR_NAMES)}')
        for what, names, allowed in (("target_modules", self.targets, LINEAR_NAMES),
                                     ("modules_to_save", self.modules_to_save, SAVABLE)):
            unknown = [n for n in names if n not in allowed]
            if unknown:
                hint = (" (the output head is trained whole: modules_to_save = \"lm_head\")"
                        if "lm_head" in unknown and what == "target_modules" else "")
                raise DuokaError(f"lora.{what} names {', '.join(map(repr, unknown))}, which Qwen2 does not have "
                                 f"there{hint}", f"choose from {', '.join(allowed)}" +
                                 (f', or "{ALL_LINEAR}"' if what == "target_modules" else ""))

    def __str__(self) -> str:
        return (f"rank {self.rank}, alpha {self.alpha:g}, targets {','.join(self.targets)}, modules_to_save "
                f"{','.join(self.modules_to_save) or 'none'}"
                + (f", base in {self.quantize}" if self.quantized else ""))

    @property
    def quantized(self) -> bool:
        return self.quantize != "none"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def parse(cls, rank: int, alpha: float, dropout: float, target_modules: str,
              modules_to_save: str, quantize: str = "none") -> "LoRAArgs | None":
        """From the [lora] section's values (comma-separated names); None when rank is 0.
        alpha 0 means twice the rank (LLaMA-Factory's default)."""
        if rank == 0:
            if quantize != "none":
                raise DuokaError(f"lora.quantize={quantize} quantizes the frozen base of a LoRA run, and lora.rank "
                                 "is 0 (LoRA off: every weight trains)",
                                 "set lora.rank > 0 (QLoRA), or lora.quantize=none")
            return None
        targets = LINEAR_NAMES if target_modules.strip() == ALL_LINEAR else _names(target_modules)
        return cls(rank=rank, alpha=alpha or 2.0 * rank, dropout=dropout,
                   targets=tuple(n for n in LINEAR_NAMES if n in targets) + tuple(n for n in targets
                                                                                  if n not in LINEAR_NAMES),
                   modules_to_save=tuple(dict.fromkeys(_names(modules_to_save))), quantize=quantize)


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


class FrozenLinear(nn.Linear):
    """A frozen linear layer, whose weight QLoRA holds in NF4. Eager, torchao's linear keeps
    the NF4 weight for backward and dequantizes it again there. Compiled, the partitioner
    would keep each layer's dequantized bf16 weight for backward instead: the whole base in
    bf16 again (Qwen2-7B QLoRA peaked at 55.6 GiB on an H200, LoRA at 53.3). Checkpointing
    the product inside the compiled graph makes backward recompute the dequantization from
    the NF4 parts (the product itself is not needed there, so it is not recomputed); the
    input it saves is, in an adapted layer, the one the adapter's gradient keeps anyway. Unquantized (LoRA's
    base, through LoRALinear), a plain product."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quantized: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.quantized = quantized

    def base(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized and torch.compiler.is_compiling():
            return checkpoint(F.linear, x, self.weight, self.bias, use_reentrant=False)
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x)


class LoRALinear(FrozenLinear):
    """nn.Linear (its `weight` and `bias` frozen by the model) plus the adapter A, B.

    A subclass so that everything that reads a linear layer's weight (checkpoint loading,
    fused q/k/v projections, the tensor-parallel styles) finds it where it always is, under
    the name it always has; `delta` is the adapter's share, which a fused projection adds to
    its part of the one matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool, lora: LoRAArgs):
        super().__init__(in_features, out_features, bias, lora.quantized)
        self.lora_a = nn.Linear(in_features, lora.rank, bias=False)
        self.lora_b = nn.Linear(lora.rank, out_features, bias=False)
        # nn.Dropout(0) would still launch a kernel per call in training mode.
        self.dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
        self.scaling = lora.scaling

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's share of the output. The scale multiplies the rank-wide middle
        (rank columns) rather than the output (out columns): the same product, fewer operations."""
        return self.lora_b(self.lora_a(self.dropout(x)) * self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.delta(x)


def linear(in_features: int, out_features: int, bias: bool, lora: LoRAArgs | None, hf_name: str) -> nn.Linear:
    """The layer Hugging Face calls `hf_name`: with an adapter when LoRA targets it. Under
    QLoRA its shape is checked here, at construction, against NF4's blocks."""
    if lora is not None and lora.quantized and (in_features * out_features) % (2 * NF4_BLOCK):
        raise DuokaError(f"lora.quantize={lora.quantize}: {hf_name} is {out_features} x {in_features}, not a whole "
                         f"number of NF4 blocks of {NF4_BLOCK} weights", "use lora.quantize=none for this model")
    if lora is not None and hf_name in lora.targets:
        return LoRALinear(in_features, out_features, bias, lora)
    if lora is not None and lora.quantized:
        return FrozenLinear(in_features, out_features, bias, quantized=True)
    return nn.Linear(in_features, out_features, bias=bias)


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (absent from the base checkpoint)."""
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_init(name: str, shape: torch.Size, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """A's and B's initial values, as PEFT's: A Kaiming-uniform with a = sqrt(5) (what
    nn.Linear uses: uniform within ±1/sqrt(in_features)), B zero, so B·A starts at zero."""
    full = torch.zeros(shape, device=device, dtype=torch.float32)
    if name.endswith(".lora_a.weight"):
        nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
    return full


def freeze_base(model: nn.Module, saved_modules: dict[str, nn.Module | None]) -> None:
    """Leave only the adapters and the modules to save trainable. A tied embedding and head
    are one parameter: saving either trains both."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    for module in saved_modules.values():
        if module is not None:
            module.requires_grad_(True)


def cast_frozen_(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep the frozen parameters in `dtype` (the compute dtype) and the trainable ones as
    they are (fp32 masters): a frozen weight gets no update, so it needs no fp32 copy.
    Called on the meta device, before any storage exists; a parameter shared by two
    modules (a tied embedding and head) stays shared."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad or param.dtype == dtype or not param.is_floating_point():
                continue
            if id(param) not in cast:
                cast[id(param)] = nn.Parameter(param.to(dtype), requires_grad=False)
            setattr(module, name, cast[id(param)])


def nf4_scaler_block(numel: int) -> int:
    """Scales per double-quantisation block for a tensor of `numel` weights: NF4_SCALER_BLOCK,
    or for a tensor with fewer or an indivisible count of scales the largest divisor of
    that count below it (tiny test shapes only)."""
    scales = numel // NF4_BLOCK
    return max(d for d in range(1, min(NF4_SCALER_BLOCK, scales) + 1) if scales % d == 0)


def nf4_shardable(out_features: int, in_features: int, shards: int) -> bool:
    """Whether FSDP2 can split an NF4 weight of this shape over `shards` ranks: by whole rows
    and whole blocks of scales (torchao splits the packed values, the scales and the scales'
    scales alike, without padding)."""
    numel = out_features * in_features
    return out_features % shards == 0 and (numel // NF4_BLOCK // nf4_scaler_block(numel)) % shards == 0


def _torchao_nf4():
    """torchao's NF4 (an optional dependency, imported here only, on first use by QLoRA)."""
    try:
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError:
        raise DuokaError("lora.quantize=nf4 needs torchao, which is not installed",
                         f"{QUANT_INSTALL}, or lora.quantize=none") from None
    return NF4Tensor, to_nf4


def nf4(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (whole, on its device) as torchao's NF4Tensor, quantised from its bf16 values
    (NF4_SOURCE_DTYPE): a tensor whose matmuls dequantise block by block (F.linear runs
    torchao's linear_nf4, which keeps the 4-bit form for its backward)."""
    _, to_nf4 = _torchao_nf4()
    return to_nf4(weight.detach().to(NF4_SOURCE_DTYPE).contiguous(), NF4_BLOCK, nf4_scaler_block(weight.numel()))


@torch.no_grad()
def quantize_weight_(layer: nn.Linear) -> None:
    """Replace a frozen linear layer's weight by its NF4 form. The old Parameter is dropped
    here, so its storage is released as soon as nothing else holds it: a caller quantizing
    layer after layer never holds the whole base in both forms."""
    NF4Tensor, _ = _torchao_nf4()
    if layer.weight.requires_grad or isinstance(layer.weight, NF4Tensor):
        raise ValueError("quantize_weight_ takes a frozen linear layer, once")
    layer.weight = nn.Parameter(nf4(layer.weight), requires_grad=False)


def nf4_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """What an NF4 base computes with in place of `weight`: its NF4 form dequantised, in
    `weight`'s dtype (export --merge of a QLoRA run merges into this)."""
    return nf4(weight).get_original_weight().to(weight.dtype)


def trainable_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
