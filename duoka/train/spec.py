"""The run as the launcher resolved it: one frozen, picklable value handed to every worker.

Everything that can be decided without a device is decided once, in the launcher, and
checked there (layout, batch arithmetic, FSDP2 units, pipeline stage sizes, the resume
point, float8 eligibility). A worker keeps only what needs its own device: the `auto`
compute dtype and kernels, and an `auto` micro-batch (with the FSDP2 unit size that
follows from it). Workers never write into the config.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from duoka.config import Config


@dataclass(frozen=True)
class RunSpec:
    config: dict  # Config.to_dict() of the resolved config (read with .cfg; never written)
    run_dir: str
    model_args: dict  # asdict(ModelArgs)
    world_size: int
    model_dir: str | None  # HF folder to load weights from, None for random init
    token_file: str | None  # cached token ids, None for random data
    tokenizer_files: tuple[str, ...]
    end_of_text: int | None  # the id between packed documents
    resume_from: str | None  # a complete checkpoint folder
    resume_step: int  # its step (0 without one)
    micro_batch: int | None  # None: `auto`, sized by each worker from its free GPU memory
    fsdp_blocks_per_unit: int | None  # None: sized by the worker with an auto micro-batch
    stage_layers: tuple[int, ...] | None  # decoder layers per pipeline stage; None: measured, or no pipeline
    base: dict | None = None  # LoRA runs: the frozen base's identity (duoka.train.adapters.base_identity)

    @cached_property
    def cfg(self) -> Config:
        return Config.from_dict(self.config)


# Written into the run directory by rank 0 when a run saved and stopped early (SIGTERM or
# SIGINT); node 0's launcher removes it when a run starts.
STOPPED_MARKER = "STOPPED"
# One line per automatic restart (--max-restarts), appended by node 0's launcher.
RESTARTS_LOG = "restarts.jsonl"

# The tokenizer's files, copied into every checkpoint and exported model.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def error_report_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"error-rank{rank}.json"


def write_error_report(run_dir: str | Path, rank: int, cause: str, fix: str | None, **extra) -> None:
    """The error a worker leaves for the launcher, which turns the reports into one message.
    If the file cannot be written (a full disk), the message still reaches the user on stderr."""
    try:
        error_report_path(run_dir, rank).write_text(json.dumps({"rank": rank, "cause": cause, "fix": fix, **extra}))
    except OSError:
        if not extra.get("lost_peer"):
            print(f"error: rank {rank}: {cause}" + (f"\n  fix: {fix}" if fix else ""), file=sys.stderr, flush=True)
