"""Hugging Face folders out of training: `duoka export` of a checkpoint (DCP, written under
any layout), and the trainer's export of the model it holds; for LoRA runs, PEFT adapter
folders, and whole models with the adapter merged in."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from duoka.errors import DuokaError
from duoka.hub import resolve_model_dir
from duoka.models.lora import LoRAArgs
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.hf_adapter import (
    checkpoint_dtype,
    load_hf_model,
    load_hf_weights,
    save_hf_checkpoint,
    save_hf_state_dict,
)
from duoka.models.qwen2.model import build_model, materialize
from duoka.models.qwen2.peft import Adapter, dequantized_base_, merge_adapter, read_adapter, save_adapter
from duoka.parallel.dtensor import full_value
from duoka.parallel.parallelize import unwrap
from duoka.train.adapters import base_name, fingerprint, saved_lora
from duoka.train.checkpoint_io import load_model_weights, plain_name
from duoka.train.integrity import (
    MANIFEST,
    METADATA,
    STATE_FILE,
    UNVERIFIED,
    disk_full,
    find_damage,
    has_manifest,
    is_disk_full,
    load_metadata,
    read_state,
)
from duoka.train.run_files import TOKENIZER_FILES

# `duoka export --dtype auto`: the weights keep the dtype they are stored in, so nothing is
# lost by default and exporting a run's final checkpoint writes what RUN/hf/step-N holds.
AUTO = "auto"
EXPORT_DTYPES = (AUTO, "float32", "bfloat16", "float16")
# A folder whose config.json names no dtype: transformers loads it in float32 as well.
UNNAMED_DTYPE = "float32"


def stored_dtype(checkpoint: Path) -> str:
    """The dtype a checkpoint holds the model's weights in (float32: duoka keeps fp32 master
    weights under bf16 training), read from DCP's metadata; float32 where they differ."""
    metadata = load_metadata(checkpoint)
    dtypes = {str(item.properties.dtype).removeprefix("torch.")
              for name, item in metadata.state_dict_metadata.items()
              if name.startswith("model.") and getattr(item, "properties", None) is not None}
    return dtypes.pop() if len(dtypes) == 1 else "float32"


def _base_dtype(folder: Path | None) -> str:
    """The dtype a base model's folder stores its weights in (a random base: float32)."""
    dtype = checkpoint_dtype(folder) if folder is not None else None
    return str(dtype).removeprefix("torch.") if dtype is not None else UNNAMED_DTYPE


def export_checkpoint(checkpoint: Path, out: Path, dtype: str = AUTO, max_shard_size: str = "5GB",
                      no_dist: bool = False, warn: Callable[[str], None] | None = None, merge: bool = False,
                      base: str | None = None, trust_unverified: bool = False, check_weights: bool = True) -> Path:
    """no_dist: read in this process alone although a process group exists (the trainer's
    rank 0 exporting at the end of a pipeline-parallel run). The checkpoint passes the
    checks a resume does (manifest, restricted unpicklers) before any tensor is read; one
    without a manifest only when trust_unverified.

    A LoRA run's checkpoint becomes a PEFT adapter folder (its tensors in fp32, as trained),
    or with `merge` the base with the adapter merged in, as a whole Hugging Face model;
    `base` overrides the base folder the checkpoint names (it must be the same model).
    dtype "auto": the checkpoint's own (stored_dtype), merged: the base folder's."""
    if not any((checkpoint / name).is_file() for name in (STATE_FILE, METADATA, MANIFEST)):
        hint = " (a .partial folder is an interrupted save)" if checkpoint.name.endswith(".partial") else ""
        raise DuokaError(f"{checkpoint} is not a complete duoka checkpoint{hint}",
                         "pass a RUN_DIR/checkpoints/step-N folder, or a LoRA adapter folder with --merge")
    if (damage := find_damage(checkpoint, trust_unverified)) is not None:
        raise DuokaError(f"{checkpoint} is damaged: {damage}",
                         "export another checkpoint of the run (RUN_DIR/checkpoints/step-N), or restore this one's "
                         "files from a copy" if damage != UNVERIFIED else
                         "export a checkpoint that has one; if you trust this one (saved by a duoka older than "
                         "manifests, or copied without it), add --trust-unverified")
    if not has_manifest(checkpoint) and warn is not None:
        warn(f"{checkpoint} has no manifest (trusted by --trust-unverified): not verified")
    state = read_state(checkpoint)
    args = ModelArgs(**state["model_args"])
    lora = saved_lora(state)
    if merge and lora is None:
        raise DuokaError(f"--merge: {checkpoint} holds a whole model (trained without LoRA), there is no adapter "
                         "to merge", "leave out --merge")
    # One process, full model in fp32 on the host: DCP reads every shard of every rank.
    model = materialize(build_model(args, lora=lora), "cpu", torch.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")  # one process reading all shards is intended
        load_model_weights(checkpoint, model, no_dist=no_dist)
    extra = [checkpoint / name for name in TOKENIZER_FILES if (checkpoint / name).is_file()]
    if lora is not None:
        trained = {plain_name(n): p.detach() for n, p in model.named_parameters() if p.requires_grad}
        if not merge:
            return save_adapter(trained, lora, args, out, base_name(state.get("base")), extra)
        model, folder = _base_model(checkpoint, state, args, base, check_weights)
        if lora.quantized:  # QLoRA: into the base it trained on, the NF4 base dequantised
            dequantized_base_(model)
        merge_adapter(model, Adapter(checkpoint, lora.scaling, trained, None))
        return _save_model(model, out, _base_dtype(folder) if dtype == AUTO else dtype, max_shard_size, extra)
    return _save_model(model, out, stored_dtype(checkpoint) if dtype == AUTO else dtype, max_shard_size, extra)


def _base_model(checkpoint: Path, state: dict, args: ModelArgs, override: str | None, check_weights: bool):
    """The frozen base a LoRA checkpoint was trained on, whole on the host in fp32: read
    from its folder (checked against the recorded fingerprint) or drawn from its seed; with
    that folder (None for a drawn one)."""
    recorded = state.get("base")
    if recorded is None:
        raise DuokaError(f"{checkpoint} does not record its base model", "merge with the base folder: duoka export "
                         "CHECKPOINT --out DIR writes the adapter; PEFT's merge_and_unload() merges it")
    model = materialize(build_model(args), "cpu", torch.float32)
    if recorded["kind"] == "random" and override is None:
        model.init_weights(seed=recorded["seed"])
        return model, None
    folder = resolve_model_dir(override) if override else Path(recorded["path"])
    if not folder.is_dir():
        raise DuokaError(f"the base model of {checkpoint}, {folder}, is not here",
                         "give the base model's folder with --base DIR")
    if recorded["kind"] != "folder" or fingerprint(folder) != recorded["fingerprint"]:
        raise DuokaError(f"{folder} is not the base {checkpoint}'s adapters were trained on (another fingerprint)",
                         f"give --base the folder of that base ({recorded.get('path', 'a random init')})")
    load_hf_weights(model, folder, check_weights=check_weights)
    return model, folder


def merge_adapter_folder(adapter_dir: Path, out: Path, dtype: str = AUTO, max_shard_size: str = "5GB",
                         base: str | None = None, check_weights: bool = True) -> Path:
    """A PEFT LoRA adapter folder (a LoRA run's hf/step-N, or PEFT's own) merged into its
    base (`base`, else the adapter's base_model_name_or_path) as a whole Hugging Face model,
    in the base's dtype unless `dtype` names one."""
    adapter = read_adapter(adapter_dir)
    base = base or adapter.base
    if not base:
        raise DuokaError(f"{adapter_dir}/adapter_config.json names no base model (base_model_name_or_path)",
                         "give the base model's folder or hub id with --base")
    model, folder = load_hf_model(base, "cpu", torch.float32, check_weights=check_weights)
    merge_adapter(model, adapter)
    extra = [f for name in TOKENIZER_FILES for f in (adapter_dir / name, folder / name) if f.is_file()]
    return _save_model(model, out, _base_dtype(folder) if dtype == AUTO else dtype, max_shard_size,
                       list({f.name: f for f in reversed(extra)}.values()))


def _save_model(model, out: Path, dtype: str, max_shard_size: str, extra: list[Path]) -> Path:
    try:
        return save_hf_checkpoint(model, out, max_shard_size=max_shard_size, dtype=getattr(torch, dtype),
                                  extra_files=extra)
    except OSError as e:  # the partial output folder is gone already (save_hf_checkpoint)
        if is_disk_full(e):
            raise disk_full(out, model.args.num_params() * getattr(torch, dtype).itemsize) from None
        raise


def export_trained(model, args: ModelArgs, run_dir: Path, step: int, tokenizer_files: tuple[str, ...],
                   pipeline: bool, lora: LoRAArgs | None = None, base: dict | None = None) -> Path:
    """The trained model as a Hugging Face folder under RUN_DIR/hf/step-N (every rank
    joins; rank 0 writes); a LoRA run's as a PEFT adapter folder (base: the base's
    identity, named in adapter_config.json). Under pipeline parallelism no rank holds every
    stage: rank 0 converts the step's checkpoint (all stages' files) in one process instead."""
    out = run_dir / "hf" / f"step-{step}"
    if pipeline:
        checkpoint = run_dir / "checkpoints" / f"step-{step}"
        if not checkpoint.is_dir():
            raise DuokaError("under pipeline parallelism the final Hugging Face export is made from the final "
                             "checkpoint, and checkpoint.enabled=false",
                             "enable checkpoints, or set checkpoint.export_final=false and run duoka export")
        if dist.get_rank() == 0:
            export_checkpoint(checkpoint, out, dtype="float32", no_dist=True)
        dist.barrier()
        return out
    if lora is not None:
        # Only what trained is gathered, parameter by parameter in the same order on every
        # rank (a sharded one is a collective), never the frozen base.
        trained = {plain_name(n): full_value(p).detach().cpu() for n, p in unwrap(model).named_parameters()
                   if p.requires_grad}
        if dist.get_rank() == 0:
            save_adapter(trained, lora, args, out, base_name(base), [Path(f) for f in tokenizer_files])
        dist.barrier()
        return out
    state = get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        state = {plain_name(k): v for k, v in state.items()}
        if args.tie_word_embeddings:
            state.setdefault("output.weight", state["tok_embeddings.weight"])
        save_hf_state_dict(state, args, out, extra_files=[Path(f) for f in tokenizer_files])
    dist.barrier()
    return out
