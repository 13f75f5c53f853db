"""FP8 (e4m3) linear layers for serving: a bf16 checkpoint quantized at load (`--quantization
fp8`, as vLLM's: weights per output row, activations per token at run time) and llm-compressor's
compressed-tensors FP8 checkpoints (weights per row or per tensor, activations per token or
with a stored static scale).

Arithmetic (both paths): a weight row w is stored as q = e4m3(w / s), s = amax|w| / 448 (1 for
a row of zeros); each token's activations x likewise with s_x = max(amax|x| / 448, floor), or
the checkpoint's static scale; y = (q_x s_x) . (q s) + bias, accumulated in fp32, cast once.

The matmul is torch._scaled_mm with rowwise scales (CUDA, compute capability >= 8.9, bf16/fp16
activations), not torchao's float8 inference: no extra dependency in the serving path (torchao
is only the training extra), no tensor subclass (plain buffers under CUDA graphs, tensor
parallel shards and state dicts), weights loaded already quantized from compressed-tensors
without torchao's private constructors, and Inductor lowers aten._scaled_mm (tuned_scaled_mm),
so the layer traces under torch.compile (tested with fullgraph). Anywhere else (CPU, older
GPUs) forward_reference computes the same function by dequantizing: the two differ only in
accumulation order.

Steps of at most SMALL_BATCH_ROWS token rows (decode at small batch) take a weight-only
kernel instead (small_batch.py): bf16 activations against the widened e4m3 weight and its
row scales, no activation rounding, so within one activation rounding of the above and never
further from the bf16 model.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.nn.functional as F

from duoka.errors import DuokaError
from duoka.models.quant.base import Part, QuantizedLinear, QuantScheme, TensorSource
from duoka.models.quant.small_batch import SMALL_BATCH_ROWS, build_small_batch_fp8

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(float8_e4m3fn).max; e4m3fn has no infinity (its top code is NaN)
# Per-token scales never go below this (vLLM's min_scaling_factor), so a row of zeros gets a
# finite scale and quantizes to zeros.
ACT_SCALE_FLOOR = 1.0 / (E4M3_MAX * 512.0)
# _scaled_mm needs K (the input width) and N (the output width) multiples of 16 (the token
# count is free: torch checks mat1.size(1) and both sizes of mat2 only).
_ALIGN = 16


# ---- quantization arithmetic (shared by the load-time quantizer, both forward paths and tests)

def row_scales(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scale per row from each row's amax: amax / 448, 1 where that is 0 (a row of zeros
    stays zeros instead of 0/0 = NaN)."""
    scale = amax.float() / E4M3_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def to_e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w [rows, cols] / scale [rows] in e4m3, saturating: w / scale can round just past 448, and
    clamping first keeps the result independent of how a cast treats overflow (NaN or 448)."""
    return (w.float() / scale.float()[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_activations(x: torch.Tensor, static_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] as (e4m3 [T, K], fp32 scale [T, 1] contiguous, as _scaled_mm's rowwise scale_a
    needs): per token amax / 448 floored at ACT_SCALE_FLOOR, or the static scale on every row.
    Eager fp32 elementwise ops round alike on CPU and CUDA, so both paths get the same codes (a
    compiled kernel may round the division differently in its last bit, flipping a rare code)."""
    if static_scale is None:
        scale = (x.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp_(min=ACT_SCALE_FLOOR)
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class ScaledMMArgs(NamedTuple):
    """torch._scaled_mm's arguments: a [T, K'] e4m3 row-major, b [K', N'] e4m3 column-major
    (the stored [N', K'] weight's .t()), scale_a [T, 1] and scale_b [1, N'] fp32 contiguous
    (rowwise), bias [N'] in out_dtype (bf16/fp16; torch requires the two equal); K', N' are K, N
    padded to multiples of 16."""
    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    bias: torch.Tensor | None
    out_dtype: torch.dtype


def scaled_mm_args(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                   input_scale: torch.Tensor | None = None) -> ScaledMMArgs:
    """The _scaled_mm arguments for activations x [T, K] against a stored weight [N', K'] (padded,
    contiguous) with its scale [N']. Columns K..K' of x are padded with zeros (exact: they meet
    the weight's zero columns), the bias with zeros to N'; the token count T is not padded."""
    k_pad = weight.shape[1]
    if x.shape[1] != k_pad:
        x = F.pad(x, (0, k_pad - x.shape[1]))
    a, scale_a = quantize_activations(x, input_scale)
    if bias is not None:
        bias = bias.to(x.dtype)
        if bias.shape[0] != weight.shape[0]:
            bias = F.pad(bias, (0, weight.shape[0] - bias.shape[0]))
    return ScaledMMArgs(a, weight.t(), scale_a, weight_scale.reshape(1, -1), bias, x.dtype)


def run_scaled_mm(args: ScaledMMArgs) -> torch.Tensor:
    # use_fast_accum off: Hopper's fast FP8 accumulation skips the periodic fp32 promotion, and
    # the reference path could no longer bound its difference by accumulation order alone.
    return torch._scaled_mm(args.a, args.b, scale_a=args.scale_a, scale_b=args.scale_b, bias=args.bias,
                            out_dtype=args.out_dtype, use_fast_accum=False)


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether _scaled_mm's rowwise FP8 kernels run on `device`: NVIDIA CUDA with compute
    capability 8.9 (Ada) or above (torch refuses below; ROCm's e4m3 variant is fnuz, not fn)."""
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


# ---- the layer

class Fp8Linear(QuantizedLinear):
    """y = x @ W.T + bias with W stored as e4m3 [out, in] and one fp32 scale per output row.

    weight: e4m3 [out, in]; weight_scale: fp32 [out], or one value for the whole tensor (made a
    row each: exact); bias: [out] or None, kept in `dtype`; input_scale: a static activation
    scale (compressed-tensors' input_scale), None for per-token scales computed at run time.
    The weight is stored padded with zeros to multiples of 16 (padded rows scale 1) and
    contiguous, so that weight.t() is the column-major operand _scaled_mm wants, made once here.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, input_scale: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != E4M3 or weight.dim() != 2:
            raise ValueError(f"Fp8Linear needs an e4m3 [out, in] weight, got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = dtype
        scale = weight_scale.float().reshape(-1).to(weight.device)
        if scale.numel() == 1:
            scale = scale.expand(self.out_features)
        if scale.numel() != self.out_features:
            raise ValueError(f"weight_scale has {scale.numel()} values for {self.out_features} rows")
        n_pad, k_pad = _round_up(self.out_features), _round_up(self.in_features)
        # Padded through its bytes (code 0x00 is +0.0), which every backend's pad kernel takes.
        pad = (0, k_pad - self.in_features, 0, n_pad - self.out_features)
        padded = F.pad(weight.view(torch.uint8), pad).view(E4M3) if any(pad) else weight.contiguous()
        self.register_buffer("weight", padded, persistent=False)
        self.register_buffer("weight_scale", F.pad(scale, (0, n_pad - self.out_features), value=1.0).contiguous(),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.to(device=weight.device, dtype=dtype),
                             persistent=False)
        self.register_buffer("input_scale", None if input_scale is None
                             else input_scale.float().reshape(()).to(weight.device), persistent=False)
        # Decided once where the layer is built (readers build it on its device): forward has
        # no device query, which torch.compile and CUDA graph capture would have to trace.
        self.uses_scaled_mm = scaled_mm_supported(weight.device)
        self.small_batch = (build_small_batch_fp8(self.weight, self.weight_scale, dtype)
                            if self.uses_scaled_mm and dtype in (torch.bfloat16, torch.float16) else None)

    def extra_repr(self) -> str:
        static = ", static input scale" if self.input_scale is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{static}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_scaled_mm and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            if self.small_batch is not None and x.dtype == self.compute_dtype \
                    and x.numel() <= SMALL_BATCH_ROWS * self.in_features:
                return self.forward_small_batch(x)
            return self.forward_scaled_mm(x)
        return self.forward_reference(x)

    def forward_small_batch(self, x: torch.Tensor) -> torch.Tensor:
        """The weight-only kernel for a few token rows (small_batch.py)."""
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[1] != self.weight.shape[1]:
            rows = F.pad(rows, (0, self.weight.shape[1] - rows.shape[1]))
        out = self.small_batch(rows)
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """The FP8 matmul (torch._scaled_mm; its CPU kernel runs it too, which the tests use)."""
        lead = x.shape[:-1]
        out = run_scaled_mm(scaled_mm_args(x.reshape(-1, self.in_features), self.weight, self.weight_scale,
                                           self.bias, self.input_scale))
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out.reshape(*lead, self.out_features)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same function without FP8 matmuls: activations quantized as on the GPU and
        dequantized, the weight dequantized, the matmul in fp32, one cast at the end."""
        lead = x.shape[:-1]
        q, scale = quantize_activations(x.reshape(-1, self.in_features), self.input_scale)
        w = self.weight[: self.out_features, : self.in_features].float() * self.weight_scale[: self.out_features, None]
        out = (q.float() * scale) @ w.t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        w = self.weight[: self.out_features, : self.in_features].float()
        return (w * self.weight_scale[: self.out_features, None]).to(self.compute_dtype)

    def weight_bytes(self) -> int:
        extra = 0 if self.input_scale is None else 4
        return self.weight.numel() * self.weight.element_size() + self.weight_scale.numel() * 4 + extra


# ---- readers

def _shard_rows_or_columns(t: torch.Tensor, shard) -> torch.Tensor:
    if shard is None:
        return t
    dim, start, stop = shard
    if not 0 <= start <= stop <= t.shape[dim]:
        raise ValueError(f"shard {shard} is outside a tensor of shape {tuple(t.shape)}")
    return t[start:stop] if dim == 0 else t[:, start:stop]


def _read_bias(source: TensorSource, part: Part, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # A dim-1 (input column) shard keeps the whole bias: the caller adds it once per all-reduce
    # (Qwen2's column-split projections, o and down, have none).
    bias = source(part.prefix + ".bias")
    if part.shard is not None and part.shard[0] == 0:
        bias = _shard_rows_or_columns(bias, part.shard)
    return bias.to(device=device, dtype=dtype)


def quantize_fp8(source: TensorSource, parts: list[Part], scheme: QuantScheme, bias: bool, device: torch.device,
                 dtype: torch.dtype) -> Fp8Linear:
    """A bf16/fp16/fp32 checkpoint's projection quantized at load on `device`, per output row.
    Each row's scale comes from the whole row before a column shard is cut, so every tensor
    parallel rank holds exactly its slice of the unsharded layer (results do not depend on tp)."""
    weights, scales, biases = [], [], []
    for part in parts:
        name = part.prefix + ".weight"
        w = source(name)
        if not w.is_floating_point() or w.element_size() < 2 or w.dim() != 2:
            raise DuokaError(f"{name} is {w.dtype} {tuple(w.shape)}, not a bf16/fp16/fp32 matrix to quantize",
                             "--quantization fp8 quantizes a bf16 checkpoint; serve a quantized one without the flag")
        if part.shard is not None and part.shard[0] == 0:
            w = _shard_rows_or_columns(w, part.shard)  # rows are independent: cut before the copy
        w = w.to(device)
        scale = row_scales(w.abs().amax(dim=1))
        if not bool(torch.isfinite(scale).all()):
            raise DuokaError(f"{name} holds inf or NaN", "the checkpoint is damaged: download or export it again")
        if part.shard is not None and part.shard[0] == 1:
            w = _shard_rows_or_columns(w, part.shard)
        weights.append(to_e4m3(w, scale))
        scales.append(scale)
        if bias:
            biases.append(_read_bias(source, part, device, dtype))
    return Fp8Linear(torch.cat(weights), torch.cat(scales), torch.cat(biases) if bias else None, dtype)


def _read_compressed_part(source: TensorSource, part: Part, scheme: QuantScheme, device: torch.device
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One module's (e4m3 weight, fp32 scale per row, input_scale or None), sharded, on device."""
    name = part.prefix + ".weight"
    w = source(name)
    if w.dtype != E4M3 or w.dim() != 2:
        raise DuokaError(f"{name} is {w.dtype} {tuple(w.shape)}, not the float8_e4m3fn matrix a compressed-tensors "
                         "FP8 checkpoint stores", "the checkpoint does not match its config.json: export it again "
                         "with llm-compressor (format float-quantized)")
    scale = source(part.prefix + ".weight_scale").float()
    rows = w.shape[0]
    if scale.numel() == 1:
        scale = scale.reshape(1).expand(rows)  # per tensor -> per row: each row keeps its module's scale
    elif scheme.weight_per_tensor or tuple(scale.shape) not in ((rows, 1), (rows,)):
        raise DuokaError(f"{part.prefix}.weight_scale has shape {tuple(scale.shape)} for a weight of {rows} rows "
                         f"(expected {'[1]' if scheme.weight_per_tensor else f'[{rows}, 1] or [1]'})",
                         "the checkpoint does not match its config.json: export it again")
    scale = scale.reshape(rows)
    if part.shard is not None:
        w = _shard_rows_or_columns(w, part.shard)
        if part.shard[0] == 0:
            scale = _shard_rows_or_columns(scale, part.shard)  # a column shard keeps every row's scale
    try:
        input_scale = source(part.prefix + ".input_scale").float().to(device)
    except KeyError:
        input_scale = None
    w, scale = w.to(device), scale.to(device)
    # e4m3fn's only NaN codes are 0x7F and 0xFF.
    if not bool(torch.isfinite(scale).all()) or bool(((w.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise DuokaError(f"{part.prefix} holds NaN or inf", "the checkpoint is damaged: download or export it again")
    return w, scale, input_scale


def read_compressed_fp8(source: TensorSource, parts: list[Part], scheme: QuantScheme, bias: bool,
                        device: torch.device, dtype: torch.dtype) -> Fp8Linear:
    """A projection of llm-compressor's compressed-tensors FP8 checkpoint (weight, weight_scale,
    optional input_scale per module). Packed modules with static input scales share the largest
    (as vLLM: the packed projection reads one input, and the largest scale saturates none)."""
    weights, scales, input_scales, biases = [], [], [], []
    for part in parts:
        w, scale, input_scale = _read_compressed_part(source, part, scheme, device)
        weights.append(w)
        scales.append(scale)
        input_scales.append(input_scale)
        if bias:
            biases.append(_read_bias(source, part, device, dtype))
    static = [s is not None for s in input_scales]
    if any(static) and not all(static):
        names = ", ".join(p.prefix for p, s in zip(parts, static) if not s)
        raise DuokaError(f"{names} lack the input_scale the other modules packed with them have",
                         "the checkpoint mixes static and dynamic activation scales in one projection: export it "
                         "again with one scheme for all Linear layers")
    input_scale = torch.stack([s.reshape(()) for s in input_scales]).max() if all(static) else None
    return Fp8Linear(torch.cat(weights), torch.cat(scales), torch.cat(biases) if bias else None, dtype, input_scale)


# ---- compressed-tensors' quantization_config

_FORMATS = ("float-quantized", "naive-quantized")  # both store e4m3 weights with weight_scale
# compressed-tensors' preset names a config group may give instead of a scheme.
_PRESETS = {
    "FP8": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                                  "dynamic": False}},
    "FP8_DYNAMIC": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                          "dynamic": True}},
}
_REQUANTIZE = ("quantize the bf16 model with llm-compressor's FP8_DYNAMIC scheme (targets Linear, ignore lm_head), "
               "or serve the bf16 model with --quantization fp8")
_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")
_LAYERS_CHECKED = 128  # more than any Qwen2 has (80): a regex naming some layers is caught


def _bad(where: str, field: str, value, fix: str = _REQUANTIZE) -> DuokaError:
    return DuokaError(f"compressed-tensors quantization_config: {where}{field} = {value!r} is not supported "
                      "(duoka serves FP8 e4m3: weights per channel or per tensor, activations per token or static)",
                      fix)


def _check_weights(w: dict | None, where: str) -> bool:
    """Validates a group's `weights`; True when its scale is per tensor."""
    if w is None:
        raise _bad(where, "weights", None)
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _bad(where, "weights", f"{w.get('type')} {w.get('num_bits')} bits",
                   "duoka serves FP8 compressed-tensors checkpoints and GPTQ/AWQ for integers: " + _REQUANTIZE)
    if w.get("strategy") not in ("channel", "tensor"):
        raise _bad(where, "weights.strategy", w.get("strategy"))
    for key, wanted in (("symmetric", True), ("dynamic", False), ("actorder", None), ("block_structure", None)):
        if w.get(key, wanted) != wanted:
            raise _bad(where, f"weights.{key}", w.get(key))
    if w.get("group_size") not in (None, -1):
        raise _bad(where, "weights.group_size", w.get("group_size"))
    return w["strategy"] == "tensor"


def _check_inputs(a: dict | None, where: str) -> None:
    if a is None:
        raise _bad(where, "input_activations", None, "weight-only FP8 (W8A16) is not served: " + _REQUANTIZE)
    if a.get("type") != "float" or a.get("num_bits") != 8 or a.get("symmetric", True) is not True:
        raise _bad(where, "input_activations", f"{a.get('type')} {a.get('num_bits')} bits, symmetric "
                   f"{a.get('symmetric', True)}")
    dynamic, strategy = a.get("dynamic", False), a.get("strategy")
    # Dynamic scales are computed per token (as vLLM does whatever the strategy); a static one
    # is the module's stored input_scale, one per tensor.
    if not ((dynamic is True and strategy in ("token", "tensor")) or (dynamic is False and strategy == "tensor")):
        raise _bad(where, "input_activations", f"dynamic {dynamic}, strategy {strategy}")


def _matches(name: str, entry: str) -> bool:
    """compressed-tensors' matching of a module name (a target or an ignore entry): "re:" a
    regex from the start of the name (re.match), a class name ("Linear": every projection and
    lm_head), otherwise the exact name."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry == "Linear" or entry == name


def _check_coverage(targets: list[str], ignore: list[str]) -> None:
    """Every decoder projection quantized, lm_head not (duoka's head stays in the compute dtype)."""
    names = [f"model.layers.{i}.{p}" for i in range(_LAYERS_CHECKED) for p in _PROJECTIONS]
    for entry in ignore:
        hit = next((n for n in names if _matches(n, entry)), None)
        if hit is not None:
            raise DuokaError(f"compressed-tensors quantization_config: ignore entry {entry!r} leaves {hit} "
                             "unquantized; duoka quantizes every decoder projection alike",
                             "quantize with ignore=['lm_head'] only (llm-compressor's FP8_DYNAMIC recipe)")
    for name in names[: 2 * len(_PROJECTIONS)]:
        if not any(_matches(name, t) for t in targets):
            raise DuokaError(f"compressed-tensors quantization_config: no config group targets {name}",
                             "quantize with targets=['Linear'] and ignore=['lm_head']")
    if any(_matches("lm_head", t) for t in targets) and not any(_matches("lm_head", i) for i in ignore):
        raise DuokaError("compressed-tensors quantization_config: lm_head is quantized (it matches the targets and "
                         "is not in ignore); duoka serves the head in bf16",
                         "quantize with ignore=['lm_head'] (llm-compressor's FP8_DYNAMIC recipe does)")


def parse_compressed_tensors(quantization_config: dict) -> QuantScheme:
    """The scheme of a config.json `quantization_config` written by llm-compressor /
    compressed-tensors; DuokaError naming the field and value for anything but FP8 e4m3 W8A8
    (weights per channel or per tensor, activations dynamic or static per tensor), with every
    decoder projection quantized and lm_head ignored. A kv_cache_scheme is ignored (the KV
    cache stays in the compute dtype; its scales are not read)."""
    qc = quantization_config
    if qc.get("quant_method") != "compressed-tensors":
        raise _bad("", "quant_method", qc.get("quant_method"))
    if qc.get("format") not in _FORMATS:
        raise _bad("", "format", qc.get("format"), "export with llm-compressor's save_pretrained (it compresses to "
                   "float-quantized); a dense or fake-quantized folder can be served with --quantization fp8 "
                   "after removing its quantization_config")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise _bad("", "sparsity_config.format", sparsity.get("format"))
    if qc.get("transform_config"):
        raise _bad("", "transform_config", "(rotations)", "quantize without transforms (QuIP/SpinQuant rotations)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _bad("", "config_groups", groups)
    per_tensor, targets = [], []
    for name, group in groups.items():
        where = f"config_groups.{name}."
        if isinstance(group, list):  # a preset's name with its targets
            if name not in _PRESETS:
                raise _bad(where, "(preset)", name)
            group = {**_PRESETS[name], "targets": group}
        if group.get("format") not in (None, *_FORMATS):
            raise _bad(where, "format", group.get("format"))
        if group.get("output_activations") is not None:
            raise _bad(where, "output_activations", group["output_activations"])
        per_tensor.append(_check_weights(group.get("weights"), where))
        _check_inputs(group.get("input_activations"), where)
        targets += list(group.get("targets") or [])
    _check_coverage(targets, list(qc.get("ignore") or []))
    return QuantScheme("compressed-tensors", bits=8, weight_per_tensor=all(per_tensor))
