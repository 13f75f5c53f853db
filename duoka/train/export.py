"""Hugging Face folders out of training: `duoka export` of a checkpoint (DCP, written under
any layout), and the trainer's export of the model it holds."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.hf_adapter import save_hf_checkpoint, save_hf_state_dict
from duoka.models.qwen2.model import build_model, materialize
from duoka.parallel.parallelize import unwrap
from duoka.train.checkpoint import load_model_weights
from duoka.train.integrity import (
    MANIFEST,
    METADATA,
    STATE_FILE,
    disk_full,
    find_damage,
    has_manifest,
    is_disk_full,
    read_state,
)
from duoka.train.spec import TOKENIZER_FILES


def export_checkpoint(checkpoint: Path, out: Path, dtype: str = "bfloat16", max_shard_size: str = "5GB",
                      no_dist: bool = False, warn: Callable[[str], None] | None = None) -> Path:
    """no_dist: read in this process alone although a process group exists (the trainer's
    rank 0 exporting at the end of a pipeline-parallel run). The checkpoint passes the
    checks a resume does (manifest, restricted metadata unpickler) before any tensor is read."""
    if not any((checkpoint / name).is_file() for name in (STATE_FILE, METADATA, MANIFEST)):
        hint = " (a .partial folder is an interrupted save)" if checkpoint.name.endswith(".partial") else ""
        raise DuokaError(f"{checkpoint} is not a complete duoka checkpoint{hint}",
                         "pass a RUN_DIR/checkpoints/step-N folder")
    if (damage := find_damage(checkpoint)) is not None:
        raise DuokaError(f"{checkpoint} is damaged: {damage}",
                         "export another checkpoint of the run (RUN_DIR/checkpoints/step-N), or restore this one's "
                         "files from a copy")
    if not has_manifest(checkpoint) and warn is not None:
        warn(f"{checkpoint} has no manifest (saved by an older duoka): not verified")
    state = read_state(checkpoint)
    args = ModelArgs(**state["model_args"])
    # One process, full model in fp32 on the host: DCP reads every shard of every rank.
    model = materialize(build_model(args), "cpu", torch.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")  # one process reading all shards is intended
        load_model_weights(checkpoint, model, no_dist=no_dist)
    extra = [checkpoint / name for name in TOKENIZER_FILES if (checkpoint / name).is_file()]
    try:
        return save_hf_checkpoint(model, out, max_shard_size=max_shard_size, dtype=getattr(torch, dtype),
                                  extra_files=extra)
    except OSError as e:  # the partial output folder is gone already (save_hf_checkpoint)
        if is_disk_full(e):
            raise disk_full(out, args.num_params() * getattr(torch, dtype).itemsize) from None
        raise


def export_trained(model, args: ModelArgs, run_dir: Path, step: int, tokenizer_files: tuple[str, ...],
                   pipeline: bool) -> Path:
    """The trained model as a Hugging Face folder under RUN_DIR/hf/step-N (every rank
    joins; rank 0 writes). Under pipeline parallelism no rank holds every stage: rank 0
    converts the step's checkpoint (all stages' files) in one process instead."""
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
    state = get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        state = {_clean_name(k): v for k, v in state.items()}
        if args.tie_word_embeddings:
            state.setdefault("output.weight", state["tok_embeddings.weight"])
        save_hf_state_dict(state, args, out, extra_files=[Path(f) for f in tokenizer_files])
    dist.barrier()
    return out


def _clean_name(name: str) -> str:
    """A parameter's name in the plain model, without the wrappers' prefixes."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(wrapper, "")
    return name
