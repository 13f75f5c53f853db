"""The model a plan is for: a flavor name or a Hugging Face folder / hub id, resolved to its
shape (ModelArgs, all the planner counts from) and the [model] section of the config the
plan emits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from duoka.errors import DuokaError
from duoka.hub import resolve_model_dir
from duoka.models.qwen2.args import FLAVORS, ModelArgs
from duoka.models.qwen2.hf_adapter import read_config


@dataclass(frozen=True)
class ModelChoice:
    label: str  # what the output calls it
    args: ModelArgs
    config: dict  # the [model] section of the emitted TOML: {"flavor": ...} or {"path": ...}


def resolve_model(ref: str) -> ModelChoice:
    """A flavor name ("qwen2-7b", or "7b" for short) or a Hugging Face folder / hub id."""
    key = ref.lower()
    if key not in FLAVORS and f"qwen2-{key}" in FLAVORS:
        key = f"qwen2-{key}"
    if key in FLAVORS:
        return ModelChoice(key, FLAVORS[key], {"flavor": key})
    path = Path(ref).expanduser()
    if not path.exists() and "/" not in ref:
        raise DuokaError(f"--model {ref} is neither a flavor nor a model folder",
                         f"use a flavor ({', '.join(FLAVORS)}) or a Hugging Face folder / hub id")
    return ModelChoice(str(ref), read_config(resolve_model_dir(ref)), {"path": str(ref)})
