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
import importlib.util
from pathlib import Path

from duoka.errors import QUANT_INSTALL, DuokaError
from duoka.models.lora import NF4_BLOCK, NF4_SCALER_BLOCK, LoRAArgs, nf4_shardable
from duoka.models.qwen2.args import ModelArgs
from duoka.parallel.dims import ParallelDims

# Bytes read at each end of every weight file for the base's fingerprint: enough to tell
# two checkpoints of one shape apart (their first and last tensors differ), without
# reading a 15 GB base at every launch.
FINGERPRINT_BYTES = 1 << 20
FINGERPRINT_FILES = ("config.json", "model.safetensors.index.json")


def lora_args(cfg) -> LoRAArgs | None:
    """The [lora] section as the model's LoRAArgs (None: LoRA off); bad names are refused here."""
    c = cfg.lora
    return LoRAArgs.parse(c.rank, c.alpha, c.dropout, c.target_modules, c.modules_to_save, c.quantize)


def check_layout(cfg, dims: ParallelDims, args: ModelArgs) -> None:
    """What a LoRA run cannot be combined with (yet), refused before launch."""
    if cfg.lora.rank == 0:
        return
    if dims.pp > 1:
        raise DuokaError(f"LoRA (lora.rank={cfg.lora.rank}) is not supported with pipeline parallelism "
                         f"(parallel.pp={dims.pp})", "use parallel.pp=1 with parallel.dp_mode=fsdp")
    if cfg.training.float8 != "none":
        raise DuokaError(f"LoRA (lora.rank={cfg.lora.rank}) is not supported with training.float8="
                         f"{cfg.training.float8}: float8 layers replace the linear layers that carry the adapters",
                         "use training.float8=none for LoRA runs")
    if cfg.lora.quantize != "none":
        check_quantized_layout(cfg.lora.quantize, dims, args)


def check_quantized_layout(quantize: str, dims: ParallelDims, args: ModelArgs) -> None:
    """QLoRA runs on one process, under DDP, and under FSDP2 with one shard group (tested
    against one process); what torchao's NF4Tensor cannot be split for is refused."""
    what = f"QLoRA (lora.quantize={quantize})"
    if importlib.util.find_spec("torchao") is None:
        raise DuokaError(f"{what} needs torchao (its NF4 tensors), which is not installed",
                         f"{QUANT_INSTALL}, or lora.quantize=none")
    if dims.tp > 1:
        raise DuokaError(f"{what} is not supported with tensor parallelism (parallel.tp={dims.tp}): torchao's NF4 "
                         "weights split by rows only, and tensor parallelism splits o_proj and down_proj by columns",
                         "use parallel.tp=1 (DDP, or parallel.dp_mode=fsdp to shard the 4-bit base), or "
                         "lora.quantize=none")
    if dims.fsdp and dims.dp_replicate > 1:
        raise DuokaError(f"{what} is not supported with HSDP (parallel.dp_replicate={dims.dp_replicate} with "
                         "dp_mode=fsdp): torchao's NF4 weights do not gather under FSDP2 with replica groups",
                         "use parallel.dp_replicate=1 (FSDP2 over all ranks), or parallel.dp_mode=ddp")
    if dims.fsdp and dims.dp_shard > 1:
        bad = [f"{name} ({out} x {inp})" for name, (inp, out) in args.linear_shapes().items()
               if not nf4_shardable(out, inp, dims.dp_shard)]
        if bad:
            raise DuokaError(f"{what} under FSDP2 splits each 4-bit weight into {dims.dp_shard} shards of whole rows "
                             f"and whole double-quantisation blocks (up to {NF4_BLOCK * NF4_SCALER_BLOCK:,} weights), "
                             f"which this model's {', '.join(bad)} do not divide into",
                             "use parallel.dp_mode=ddp (the 4-bit base whole on every rank), or a parallel.dp_shard "
                             "that divides them")


def saved_lora(state: dict) -> LoRAArgs | None:
    """The LoRA settings a checkpoint was trained with (its train_state.json: `state`)."""
    c = state.get("config", {}).get("lora", {})
    return LoRAArgs.parse(c.get("rank", 0), c.get("alpha", 0.0), c.get("dropout", 0.0),
                          c.get("target_modules", "all-linear"), c.get("modules_to_save", ""),
                          c.get("quantize", "none"))


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
