"""Serving a quantized model: which scheme a model folder (or `--quantization`) asks for, and
the loaded model whose four projections per layer (packed q/k/v, o, packed gate/up, down)
are the format's QuantizedLinear layers (duoka/models/quant/), whole or as this
tensor-parallel rank's shard; everything else (embedding, norms, head) loads as in bf16.

Projections are read one at a time, so loading never holds more than one projection
unquantized: a bf16 72B checkpoint quantized to FP8 at load fits where its bf16 weights
would not.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from duoka.errors import DuokaError
from duoka.models.quant.awq import read_awq
from duoka.models.quant.base import Part, QuantizedLinear, QuantScheme, Reader, TensorSource
from duoka.models.quant.fp8 import parse_compressed_tensors, quantize_fp8, read_compressed_fp8
from duoka.models.quant.gptq import read_gptq
from duoka.models.qwen2.args import ModelArgs, ModelOptions
from duoka.models.qwen2.hf_adapter import CONFIG_FILE, open_safetensors, refuse_nonfinite, weight_files
from duoka.models.qwen2.model import Qwen2, build_model, materialize
from duoka.serve.dummy_weights import fill_random_, random_source
from duoka.serve.tp_shard import all_reduce_outputs, load_shard, shard_args, shard_range

QUANTIZATIONS = ("fp8",)  # what --quantization quantizes a bf16 checkpoint to at load

# The serving model's projections: (its module under a block, the checkpoint modules it
# packs in row order with duoka's name of each one's weight (for its tp shard), bias).
PROJECTIONS = (
    ("attention.wqkv", (("self_attn.q_proj", "attention.wq.weight"), ("self_attn.k_proj", "attention.wk.weight"),
                        ("self_attn.v_proj", "attention.wv.weight")), True),
    ("attention.wo", (("self_attn.o_proj", "attention.wo.weight"),), False),
    ("feed_forward.w13", (("mlp.gate_proj", "feed_forward.w1.weight"), ("mlp.up_proj", "feed_forward.w3.weight")),
     False),
    ("feed_forward.w2", (("mlp.down_proj", "feed_forward.w2.weight"),), False),
)


def read_scheme(folder: Path, quantization: str | None) -> QuantScheme | None:
    """The folder's quantization (config.json's quantization_config), or --quantization's for a
    bf16 folder; None: not quantized. A quantized folder needs no flag; a flag that disagrees
    with the folder is refused."""
    config = json.loads((folder / CONFIG_FILE).read_text())
    qc = config.get("quantization_config")
    if qc is None:
        if quantization is None:
            return None
        if quantization not in QUANTIZATIONS:
            raise DuokaError(f"--quantization {quantization} is not one duoka applies at load",
                             f"use one of {', '.join(QUANTIZATIONS)}, or serve a GPTQ/AWQ/FP8 checkpoint (no flag)")
        return QuantScheme("fp8")
    scheme = _folder_scheme(folder, qc)
    if quantization is not None and not (quantization == "fp8" and scheme.method == "compressed-tensors"):
        raise DuokaError(f"{folder} is already quantized ({scheme.method}, {scheme.bits} bits); --quantization "
                         f"{quantization} would quantize it again", "leave --quantization out for this folder")
    return scheme


def _folder_scheme(folder: Path, qc: dict) -> QuantScheme:
    method = str(qc.get("quant_method", "")).lower()
    where = f"{folder / CONFIG_FILE} quantization_config"
    if method == "gptq":
        bits, group = qc.get("bits"), qc.get("group_size", -1)
        if bits not in (4, 8):
            raise DuokaError(f"{where}: GPTQ with {bits} bits is not supported", "use a 4- or 8-bit GPTQ checkpoint")
        return QuantScheme("gptq", bits=bits, group_size=group, desc_act=bool(qc.get("desc_act", False)),
                           sym=bool(qc.get("sym", True)), checkpoint_format=str(qc.get("checkpoint_format", "gptq")))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or qc.get("bits", qc.get("w_bit", 4)) != 4 or not qc.get("zero_point", True):
            raise DuokaError(f"{where}: AWQ {version}, {qc.get('bits', qc.get('w_bit'))} bits is not supported",
                             "use a 4-bit AWQ checkpoint in the GEMM layout (what Qwen publishes)")
        return QuantScheme("awq", bits=4, group_size=qc.get("group_size", qc.get("q_group_size", 128)), sym=False)
    if method == "compressed-tensors":
        return parse_compressed_tensors(qc)
    raise DuokaError(f"{where}: quant_method {method or '(none)'} is not supported",
                     "duoka serves GPTQ (4/8 bit), AWQ (4 bit GEMM) and FP8 compressed-tensors checkpoints, or a bf16 "
                     "checkpoint with --quantization fp8")


def check_quantizable(args: ModelArgs, scheme: QuantScheme | None, folder: Path) -> None:
    """Refuse a quantized mixture-of-experts model before anything loads: the quantized loader
    replaces a dense layer's four projections, and a MoE layer has none of them (its experts
    are stacked tensors, its MLP no gate_proj), so it would fail on a missing tensor."""
    if scheme is not None and args.num_experts:
        raise DuokaError(f"{folder} is a mixture-of-experts model (qwen2_moe); quantized serving ({scheme.method}) "
                         "covers dense Qwen2 projections only, not MoE experts",
                         "serve its unquantized (bf16) checkpoint without --quantization, over several GPUs "
                         "(--tp N) if it does not fit one")


def reader_for(scheme: QuantScheme) -> Reader:
    return {"gptq": read_gptq, "awq": read_awq, "fp8": quantize_fp8}.get(scheme.method, read_compressed_fp8)


def _source(folder: Path) -> TensorSource:
    files = weight_files(folder)
    handles = {path: open_safetensors(path) for path in set(files.values())}

    def get(name: str) -> torch.Tensor:
        if name not in files:
            raise KeyError(name)
        return handles[files[name]].get_tensor(name)

    return get


def _without_projections(model: Qwen2) -> Qwen2:
    """The model with its projections removed (set to None), so that materializing and loading
    the rest leaves them out; they are put back quantized."""
    named = (("attention", ("wqkv", "wq", "wk", "wv", "wo")), ("feed_forward", ("w13", "w1", "w3", "w2")))
    for block in model.layers.values():
        for owner, attrs in named:
            for attr in attrs:  # packed (serving) or unpacked (the reference checked against the headers)
                if getattr(getattr(block, owner), attr, None) is not None:
                    setattr(getattr(block, owner), attr, None)
    return model


def load_quantized_model(folder: Path, args: ModelArgs, scheme: QuantScheme, device: torch.device,
                         dtype: torch.dtype, options: ModelOptions, check_weights: bool = True,
                         group=None, dummy: bool = False) -> Qwen2:
    """The serving model of `folder` with `scheme`'s projections, in eval mode; under tensor
    parallelism (group) this rank's shard, all-reducing over the group. dummy: random weights
    (dummy_weights.py) instead of the folder's files, quantized as a checkpoint's would be."""
    check_quantizable(args, scheme, folder)
    tp, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    model = materialize(_without_projections(build_model(shard_args(args, tp), options)), device, dtype)
    if dummy:
        if scheme.method != "fp8":
            raise DuokaError(f"--load-format dummy makes bf16 weights; {folder} is a {scheme.method} checkpoint",
                             "use a bf16 model's config.json, with --quantization fp8 to measure FP8")
        fill_random_(model)
        source = random_source(args, device, dtype)
    else:
        load_shard(model, folder, args, tp, rank, reference=_without_projections(build_model(args)),
                   allow_unused=True)
        if check_weights:
            refuse_nonfinite(folder, model.state_dict())
        source = _source(folder)
    read = reader_for(scheme)
    for i, block in model.layers.items():
        for path, pieces, bias in PROJECTIONS:
            parts = [Part(f"model.layers.{i}.{hf}",
                          shard_range(f"layers.{i}.{name}", args, tp, rank) if tp > 1 else None)
                     for hf, name in pieces]
            try:
                module = read(source, parts, scheme, bias, device, dtype)
            except KeyError as e:
                raise DuokaError(f"{folder}: tensor {e.args[0]} is missing for layer {i}'s {path} ({scheme.method})",
                                 "the checkpoint is incomplete or not in the format its config.json names") from None
            owner, attr = path.split(".")
            setattr(getattr(block, owner), attr, module)
    if tp > 1:
        all_reduce_outputs(model, group)
    return model.eval().requires_grad_(False)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights on its device: quantized projections as stored, the rest
    as its parameters."""
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    inside = {id(t) for m in quantized for t in [*m.parameters(), *m.buffers()]}
    plain = sum(t.numel() * t.element_size() for t in {id(p): p for p in model.parameters()}.values()
                if id(t) not in inside)
    return plain + sum(m.weight_bytes() for m in quantized)


def _bytes_per_weight(scheme: QuantScheme | None) -> float:
    """Bytes per projection weight as the scheme stores it: bf16 2; FP8 1 (its scale per row is
    negligible); GPTQ/AWQ bits/8 + an fp16 scale and a zero per group of 128."""
    if scheme is None:
        return 2.0
    if scheme.method in ("fp8", "compressed-tensors"):
        return 1.0
    return scheme.bits / 8 + 4 / 128


def estimated_weight_bytes(args: ModelArgs, scheme: QuantScheme | None, tp: int = 1) -> int:
    """One rank's weights under `scheme`: its share of the projections (a MoE model's: every
    expert's, its router and gates with them), the embedding, the head and the norms whole (as
    tp_shard lays them out), in bf16 but for the projections."""
    hd = args.resolved_head_dim
    attention = args.dim * (args.n_heads + 2 * args.n_kv_heads) * hd + args.n_heads * hd * args.dim
    width = _bytes_per_weight(scheme)
    rest = args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2) + args.n_layers * 2 * args.dim
    return int((args.n_layers * attention + args.mlp_params()) / tp * width + rest * 2)


def check_fits(args: ModelArgs, scheme: QuantScheme | None, tp: int, device: torch.device,
               gpu_memory_utilization: float) -> None:
    """Refuse, before loading, a model whose weights alone exceed the share of the GPU it may
    use, naming the quantization or tp that would fit."""
    if device.type != "cuda":
        return
    budget = torch.cuda.get_device_properties(device).total_memory * gpu_memory_utilization
    need = estimated_weight_bytes(args, scheme, tp)
    if need < budget:
        return
    options = []
    smaller = (("--quantization fp8", QuantScheme("fp8")), ("a 4-bit GPTQ/AWQ checkpoint", QuantScheme("gptq", 4)))
    for name, other in smaller:
        if estimated_weight_bytes(args, other, tp) < budget * 0.8:
            options.append(f"{name} ({estimated_weight_bytes(args, other, tp) / 2**30:.0f} GiB)")
    more_tp = next((t for t in (2, 4, 8) if t > tp and estimated_weight_bytes(args, scheme, t) < budget * 0.8), None)
    if more_tp is not None:
        options.append(f"--tp {more_tp}")
    label = "bf16" if scheme is None else f"{scheme.method} {scheme.bits}-bit"
    raise DuokaError(f"the weights alone need {need / 2**30:.1f} GiB per GPU ({label}, tp {tp}), more than "
                     f"{gpu_memory_utilization:g} of this GPU's {budget / gpu_memory_utilization / 2**30:.0f} GiB",
                     "use " + (" or ".join(options) if options else "more GPUs (--tp) or a smaller model"))
