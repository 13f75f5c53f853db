"""`duoka export`: a training checkpoint (DCP, written under any layout) -> Hugging Face folder."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.hf_adapter import save_hf_checkpoint
from duoka.models.qwen2.model import build_model, materialize
from duoka.train.checkpoint import STATE_FILE, load_model_weights, read_train_state

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def export_checkpoint(checkpoint: Path, out: Path, dtype: str = "bfloat16", max_shard_size: str = "5GB",
                      no_dist: bool = False) -> Path:
    """no_dist: read in this process alone although a process group exists (the trainer's
    rank 0 exporting at the end of a pipeline-parallel run)."""
    if not (checkpoint / STATE_FILE).is_file() or not (checkpoint / ".metadata").is_file():
        hint = " (a .partial folder is an interrupted save)" if checkpoint.name.endswith(".partial") else ""
        raise DuokaError(f"{checkpoint} is not a complete duoka checkpoint{hint}",
                         "pass a RUN_DIR/checkpoints/step-N folder")
    state = read_train_state(checkpoint)
    args = ModelArgs(**state["model_args"])
    # One process, full model in fp32 on the host: DCP reads every shard of every rank.
    model = materialize(build_model(args), "cpu", torch.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")  # one process reading all shards is intended
        load_model_weights(checkpoint, model, no_dist=no_dist)
    extra = [checkpoint / name for name in TOKENIZER_FILES if (checkpoint / name).is_file()]
    return save_hf_checkpoint(model, out, max_shard_size=max_shard_size, dtype=getattr(torch, dtype),
                              extra_files=extra)
