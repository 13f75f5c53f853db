"""LoRA runs: the [lora] section as the model's LoRAArgs, what it cannot be combined with,
and the identity of the frozen base that a LoRA checkpoint records.

A LoRA checkpoint holds what changes (the adapters, the modules trained whole, their
optimizer state) and not the base, which is read again from its folder (or drawn again
from the seed) on resume. So the checkpoint names its base, and a resume onto another
base is refused before any worker starts: the adapters would load, and mean nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from duoka.errors import DuokaError
from duoka.models.lora import LoRAArgs
from duoka.models.qwen2.args import ModelArgs

# Bytes read at each end of every weight file for the base's fingerprint: enough to tell
# two checkpoints of one shape apart (their first and last tensors differ), without
# reading a 15 GB base at every launch.
FINGERPRINT_BYTES = 1 << 20
FINGERPRINT_FILES = ("config.json", "model.safetensors.index.json")


def lora_args(cfg) -> LoRAArgs | None:
    """The [lora] section as the model's LoRAArgs (None: LoRA off); bad names are refused here."""
    c = cfg.lora
    return LoRAArgs.parse(c.rank, c.alpha, c.dropout, c.target_modules, c.modules_to_save)


def check_layout(cfg, pp: int) -> None:
    """What a LoRA run cannot be combined with (yet), refused before launch."""
    if cfg.lora.rank == 0:
        return
    if pp > 1:
        raise DuokaError(f"LoRA (lora.rank={cfg.lora.rank}) is not supported with pipeline parallelism "
                         f"(parallel.pp={pp})", "use parallel.pp=1 with parallel.dp_mode=fsdp")
    if cfg.training.float8 != "none":
        raise DuokaError(f"LoRA (lora.rank={cfg.lora.rank}) is not supported with training.float8="
                         f"{cfg.training.float8}: float8 layers replace the linear layers that carry the adapters",
                         "use training.float8=none for LoRA runs")


def saved_lora(state: dict) -> LoRAArgs | None:
    """The LoRA settings a checkpoint was trained with (its train_state.json: `state`)."""
    c = state.get("config", {}).get("lora", {})
    return LoRAArgs.parse(c.get("rank", 0), c.get("alpha", 0.0), c.get("dropout", 0.0),
                          c.get("target_modules", "all-linear"), c.get("modules_to_save", ""))


def base_name(base: dict | None) -> str | None:
    """adapter_config.json's base_model_name_or_path: the base folder (None: a random base,
    which nothing outside duoka can rebuild)."""
    return base["path"] if base is not None and base["kind"] == "folder" else None


def fingerprint(folder: Path) -> str:
    """sha256 over the folder's config.json and weights index and, for every safetensors
    file, its name, size and FINGERPRINT_BYTES at each end."""
    h = hashlib.sha256()
    for name in FINGERPRINT_FILES:
        if (folder / name).is_file():
            h.update(name.encode() + b"\0" + (folder / name).read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            h.update(f.read(FINGERPRINT_BYTES))
            f.seek(max(0, size - FINGERPRINT_BYTES))
            h.update(f.read(FINGERPRINT_BYTES))
    return h.hexdigest()


def base_identity(model_dir: str | Path | None, args: ModelArgs, seed: int) -> dict:
    """What the frozen base is: a Hugging Face folder (its path and fingerprint), or the
    seeded random init of a shape (a function of the seed and the shape only)."""
    if model_dir is not None:
        folder = Path(model_dir).resolve()
        return {"kind": "folder", "path": str(folder), "fingerprint": fingerprint(folder)}
    return {"kind": "random", "seed": seed, "shape": dataclasses.asdict(args)}


def _describe(base: dict) -> str:
    if base["kind"] == "folder":
        return f"the base in {base['path']} (fingerprint {base['fingerprint'][:12]})"
    return f"a random base (training.seed={base['seed']})"


def check_resume(checkpoint: Path, state: dict, lora: LoRAArgs | None, base: dict | None) -> None:
    """Refuse to resume `checkpoint` (its train_state.json: `state`) unless it was trained
    with the same LoRA settings on the same base."""
    saved = saved_lora(state)
    new_dir = "start a new run (another job.output_dir)"
    if saved is None and lora is not None:
        raise DuokaError(f"{checkpoint} holds a whole model trained without LoRA; this run asks for lora.rank="
                         f"{lora.rank}",
                         f"resume it without the [lora] settings, or {new_dir} from its export (duoka export "
                         f"{checkpoint} --out DIR, then model.path=DIR)")
    if saved is not None and lora is None:
        raise DuokaError(f"{checkpoint} holds LoRA adapters (lora.rank={saved.rank}); this run has LoRA off",
                         f"resume with the run's [lora] settings (lora.rank={saved.rank} ...), or {new_dir}")
    if saved is None:
        return
    if dataclasses.replace(saved, dropout=lora.dropout) != lora:  # dropout changes no parameter
        raise DuokaError(f"{checkpoint} was trained with LoRA {saved}; this run asks for LoRA {lora}",
                         f"resume with the [lora] settings it was saved with, or {new_dir}")
    was = state.get("base")
    if was is None:
        raise DuokaError(f"{checkpoint} does not record its base model", f"{new_dir}")
    if was["kind"] != base["kind"] or (was.get("fingerprint"), was.get("seed"), was.get("shape")) != (
            base.get("fingerprint"), base.get("seed"), base.get("shape")):
        fix = (f"set model.path={was['path']} (or a copy of it)" if was["kind"] == "folder"
               else f"set training.seed={was['seed']} and leave model.path empty")
        raise DuokaError(f"{checkpoint}'s adapters were trained on {_describe(was)}; this run's base is "
                         f"{_describe(base)}", f"{fix}, or {new_dir}")
