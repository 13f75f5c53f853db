"""LoRA adapters in Hugging Face PEFT's format, in and out, and merged into a base.

An adapter folder holds `adapter_config.json` (a LoraConfig) and `adapter_model.safetensors`
with PEFT's tensor names: `base_model.model.<transformers name of the layer>.lora_A.weight`
(and `lora_B`), and the modules trained whole under `base_model.model.<their name>.weight`.
`peft.PeftModel.from_pretrained(Qwen2ForCausalLM, folder)` loads what is written here, and
what PEFT saved for a Qwen2 loads here (tests/unit/test_lora.py checks both ways).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from duoka.errors import DuokaError
from duoka.models.lora import LoRAArgs, is_adapter, nf4_round_trip
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.hf_adapter import (
    checkpoint_sources,
    duoka_to_hf,
    hf_to_duoka,
    open_safetensors,
    readable_by_all,
)
from duoka.models.qwen2.model import Qwen2

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
_PEFT_PART = {".lora_a.weight": ".lora_A.weight", ".lora_b.weight": ".lora_B.weight"}


def peft_name(name: str) -> str:
    """duoka name (an adapter's or a whole module's) -> PEFT's tensor name."""
    for ours, theirs in _PEFT_PART.items():
        if name.endswith(ours):
            layer = duoka_to_hf(name.removesuffix(ours) + ".weight").removesuffix(".weight")
            return PEFT_PREFIX + layer + theirs
    return PEFT_PREFIX + duoka_to_hf(name)


def duoka_name(name: str) -> str | None:
    """PEFT's tensor name -> duoka's, or None for a tensor duoka has no place for."""
    if not name.startswith(PEFT_PREFIX):
        return None
    rest = name.removeprefix(PEFT_PREFIX)
    for ours, theirs in _PEFT_PART.items():
        if rest.endswith(theirs):
            base = hf_to_duoka(rest.removesuffix(theirs) + ".weight")
            return None if base is None else base.removesuffix(".weight") + ours
    return hf_to_duoka(rest)


def saved_names(lora: LoRAArgs, args: ModelArgs) -> tuple[str, ...]:
    """PEFT module names of the modules trained whole. A tied embedding and head are one
    matrix here; PEFT keeps a copy per module, so both are written, with the same values."""
    if args.tie_word_embeddings and lora.modules_to_save:  # either name is the one matrix
        return ("embed_tokens", "lm_head")
    return tuple(sorted(lora.modules_to_save))


def adapter_config(lora: LoRAArgs, args: ModelArgs, base: str | None) -> dict:
    """The LoraConfig that PEFT reads back as this adapter (PEFT fills the fields left out
    with its defaults, which are these adapters' too: no DoRA, no rsLoRA, no bias)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "modules_to_save": list(saved_names(lora, args)) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_adapter(state: dict[str, torch.Tensor], lora: LoRAArgs, args: ModelArgs, out: Path, base: str | None,
                 extra_files: Iterable[Path] = ()) -> Path:
    """Write the trained tensors (duoka names: the adapters and the modules to save) as a
    PEFT adapter folder; staged beside `out` and moved into place once complete."""
    tensors = {}
    for name, tensor in state.items():
        if name == "output.weight" and args.tie_word_embeddings:
            continue  # written under both names below
        tensors[peft_name(name)] = tensor.detach().to("cpu").contiguous()
    if args.tie_word_embeddings and "tok_embeddings.weight" in state:
        for module in saved_names(lora, args):  # the one shared matrix under each PEFT copy's name
            # A copy each: safetensors refuses two names on one storage.
            tensors[peft_name("output.weight" if module == "lm_head" else "tok_embeddings.weight")] = \
                state["tok_embeddings.weight"].detach().to("cpu", copy=True).contiguous()
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        save_file(tensors, str(stage / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = adapter_config(lora, args, base)
        (stage / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for extra in extra_files:
            if Path(extra).is_file():
                shutil.copy2(extra, stage / Path(extra).name)
        readable_by_all(stage)
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter as read: duoka-named tensors and the product's scale."""
    folder: Path
    scaling: float
    tensors: dict[str, torch.Tensor]  # layers.N....lora_a.weight / lora_b.weight, whole modules' weight
    base: str | None  # base_model_name_or_path


def is_adapter_folder(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file()


def read_adapter(folder: str | Path) -> Adapter:
    """Read and check an adapter folder. What duoka cannot apply exactly is refused, naming
    the field (a silent approximation would load, and be another model)."""
    folder = Path(folder)
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise DuokaError(f"{folder} has no {ADAPTER_CONFIG}", "point at a PEFT LoRA adapter folder (a LoRA run's "
                                                              "hf/step-N, or what PeftModel.save_pretrained wrote)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DuokaError(f"{path} is not valid JSON ({e})", "restore the file from the adapter's origin") from None

    def refuse(field: str, why: str) -> DuokaError:
        return DuokaError(f"{path}: {field} {why}", "use a plain LoRA adapter (no DoRA, patterns or layer "
                                                    "subsets), or merge it with PEFT's merge_and_unload()")

    if cfg.get("peft_type") != "LORA":
        raise refuse("peft_type", f"is {cfg.get('peft_type')!r}; duoka applies LoRA adapters only")
    for field, plain in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"), ("rank_pattern", {}),
                         ("alpha_pattern", {}), ("layers_to_transform", None), ("lora_bias", False)):
        if cfg.get(field, plain) not in (plain, None):
            raise refuse(field, f"is {cfg[field]!r}, which duoka does not apply")
    try:
        rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise refuse("r / lora_alpha", "are missing or not numbers") from None
    # rsLoRA (Kalajdzievski 2023, arXiv:2312.03732) scales by alpha / sqrt(r).
    scaling = alpha / rank ** 0.5 if cfg.get("use_rslora") else alpha / rank

    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise DuokaError(f"{folder} has no {ADAPTER_WEIGHTS}", "the adapter's weights are missing (duoka never "
                                                               "unpickles adapter_model.bin: convert it with PEFT)")
    handle = open_safetensors(weights)
    tensors, unknown = {}, []
    for name in handle.keys():
        ours = duoka_name(name)
        if ours is None:
            unknown.append(name)
        else:
            tensors[ours] = handle.get_tensor(name)
    if unknown:
        raise DuokaError(f"{weights} holds tensors duoka has no place for: {', '.join(unknown[:4])}"
                         + (f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""),
                         "use an adapter made for a Qwen2ForCausalLM (LoRA on its linear layers)")
    unpaired = sorted(n for n in tensors if is_adapter(n) and
                      n[:-len(".lora_a.weight")] + (".lora_b.weight" if n.endswith(".lora_a.weight")
                                                    else ".lora_a.weight") not in tensors)
    if unpaired:
        raise DuokaError(f"{weights}: {unpaired[0]} has no partner (lora_A and lora_B come in pairs)",
                         "the adapter file is damaged; write it again")
    return Adapter(folder, scaling, tensors, cfg.get("base_model_name_or_path"))


@torch.no_grad()
def dequantized_base_(model: Qwen2) -> Qwen2:
    """A loaded plain base as a QLoRA run computes with it: each decoder linear weight
    replaced by its NF4 form dequantised (duoka.models.lora.nf4_round_trip). Merging a QLoRA
    run's adapter into this gives the function the run trained."""
    if model.lora is not None or model.options.packed_projections:
        raise ValueError("dequantized_base_ takes a plain model in the training layout")
    for block in model.layers.values():
        for layer in block.base_linears():
            layer.weight.copy_(nf4_round_trip(layer.weight))
    return model


def _rows(model: Qwen2) -> dict[str, tuple[str, int, int]]:
    """Hugging Face weight name -> (the model's tensor holding it, first row, rows): a packed
    model (ModelOptions.packed_projections) holds q/k/v and gate/up one after the other."""
    where = {}
    for name, tensor in model.state_dict().items():
        row = 0
        for hf, shape in checkpoint_sources(name, tuple(tensor.shape), model.args):
            where[hf] = (name, row, shape[0])
            row += shape[0]
    return where


@torch.no_grad()
def merge_adapter(model: Qwen2, adapter: Adapter | str | Path) -> Qwen2:
    """Add the adapter's product into a loaded base (W += scaling · B A, in fp32, rounded
    once to the weight's dtype) and put in its whole modules: the result computes what the
    base with the adapter computes, with no adapter left. Works on a plain or a packed
    (serving) model, whole on one device; a tensor-parallel model is not merged here.
    Every tensor is checked against the model before any weight changes."""
    if not isinstance(adapter, Adapter):
        adapter = read_adapter(adapter)
    if model.lora is not None:
        raise ValueError("merge_adapter merges into a model without adapters")
    params = model.state_dict()
    if any(isinstance(t, DTensor) for t in params.values()):
        raise ValueError("merge_adapter needs the whole weights: merge before sharding")
    rows = _rows(model)
    deltas, whole, problems = [], [], []
    for name, tensor in adapter.tensors.items():
        if name.endswith(".lora_b.weight"):
            continue
        if name.endswith(".lora_a.weight"):
            base = name.removesuffix(".lora_a.weight") + ".weight"
            b = adapter.tensors[name.removesuffix(".lora_a.weight") + ".lora_b.weight"]
            target, first, n = rows.get(duoka_to_hf(base), (None, 0, 0))
            if target is None or b.shape[1] != tensor.shape[0] or (b.shape[0], tensor.shape[1]) != (
                    n, params[target].shape[1]):
                problems.append(f"{base}: adapter {b.shape[0]} x {tensor.shape[1]}" +
                                ("" if target is None else f", model {n} x {params[target].shape[1]}"))
            else:
                deltas.append((params[target], first, n, b, tensor))
        else:  # a module trained whole (a tied embedding and head: one matrix under both names)
            target = rows.get(duoka_to_hf(name), (None,))[0]
            if target is None or params[target].shape != tensor.shape:
                problems.append(f"{name}: adapter {list(tensor.shape)}" +
                                ("" if target is None else f", model {list(params[target].shape)}"))
            else:
                whole.append((params[target], tensor))
    if problems:
        raise DuokaError(f"adapter {adapter.folder} does not fit this base: " + "; ".join(sorted(problems)[:4]),
                         "use the base model the adapter was trained on (its adapter_config.json names it)")
    for weight, first, n, b, a in deltas:
        part = weight[first:first + n]
        delta = (b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32)) * adapter.scaling
        part.copy_((part.float() + delta).to(weight.dtype))
    for weight, tensor in whole:
        weight.copy_(tensor.to(weight.device, weight.dtype))
    return model
