"""Hugging Face checkpoint folders in and out.

Reading: config.json -> ModelArgs (every field checked, and the size it implies against the
weight files); weights from `model.safetensors` or the shards named by
`model.safetensors.index.json` (each inside the folder: the folder is untrusted input),
renamed from transformers' names to duoka's. The headers are checked first (names and
shapes, every problem in one error), then each tensor is read through safetensors' memory
map and copied straight into the already allocated parameter in the target dtype and
device: at most one tensor is ever held twice. Pickle files are never opened.

Writing: the same layout transformers writes (config.json, one file or size-limited
shards plus the index), staged in a sibling folder and moved into place only once
complete, so an interrupted save never leaves a folder that looks whole.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from duoka.errors import DuokaError
from duoka.hub import resolve_model_dir
from duoka.models.lora import LoRAArgs, is_adapter
from duoka.models.qwen2.args import ModelArgs, ModelOptions, from_hf_config, to_hf_config
from duoka.models.qwen2.model import Qwen2, build_model, materialize, write_full_

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# transformers name inside a decoder layer -> duoka name inside a TransformerBlock
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    # a MoE layer's MLP (Qwen2MoeSparseMoeBlock); its routed experts are stacked (_EXPERTS)
    "mlp.gate.weight": "feed_forward.router.weight",
    "mlp.shared_expert.gate_proj.weight": "feed_forward.shared_expert.w1.weight",
    "mlp.shared_expert.up_proj.weight": "feed_forward.shared_expert.w3.weight",
    "mlp.shared_expert.down_proj.weight": "feed_forward.shared_expert.w2.weight",
    "mlp.shared_expert_gate.weight": "feed_forward.shared_expert_gate.weight",
}
# A MoE layer's routed experts: one duoka tensor [E, out, in] per projection holds what a
# transformers checkpoint stores as E tensors, mlp.experts.<e>.<projection>.weight.
_EXPERTS = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj",
            "feed_forward.experts.w2": "down_proj"}
_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES_BACK = {v: k for k, v in _LAYER_NAMES.items()}
_TOP_NAMES_BACK = {v: k for k, v in _TOP_NAMES.items()}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_DUOKA_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERTS_BACK = {v: k for k, v in _EXPERTS.items()}


def hf_to_duoka(name: str) -> str | None:
    """duoka's name for a transformers tensor; for one routed expert's projection, the name
    of the stacked tensor that holds it (hf_expert gives which slice)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _HF_LAYER.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    expert = hf_expert(name)
    return expert[0] if expert else None


def hf_expert(name: str) -> tuple[str, int] | None:
    """(stacked duoka tensor, expert index) for a transformers routed-expert weight, else None."""
    m = _HF_LAYER.match(name)
    e = _HF_EXPERT.match(m.group(2)) if m else None
    if e is None:
        return None
    return f"layers.{m.group(1)}.{_EXPERTS_BACK[e.group(2)]}", int(e.group(1))


def expert_names(name: str, num_experts: int) -> list[str] | None:
    """The transformers names of a stacked expert tensor's slices, in order; None for any other tensor."""
    m = _DUOKA_LAYER.match(name)
    if not (m and m.group(2) in _EXPERTS):
        return None
    return [f"model.layers.{m.group(1)}.mlp.experts.{e}.{_EXPERTS[m.group(2)]}.weight" for e in range(num_experts)]


def duoka_to_hf(name: str) -> str:
    if name in _TOP_NAMES_BACK:
        return _TOP_NAMES_BACK[name]
    m = _DUOKA_LAYER.match(name)
    if m and m.group(2) in _LAYER_NAMES_BACK:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES_BACK[m.group(2)]}"
    raise KeyError(f"no Hugging Face name for parameter {name}")


# ---------------------------------------------------------------- reading


def read_config(folder: Path) -> ModelArgs:
    """The folder's config.json as ModelArgs, every field checked (args.from_hf_config), and the
    size it implies checked against the weights on disk, when there are any (a folder with only
    a config.json is enough to plan with)."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise DuokaError(f"{folder} has no {CONFIG_FILE}", "a Hugging Face model folder needs config.json next to the weights")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DuokaError(f"{path} is not valid JSON ({e})", "restore the file from the original checkpoint") from None
    args = from_hf_config(cfg, source=str(path))
    check_size_on_disk(folder, args)
    return args


# The fewest bits a stored weight takes: 1 (no format packs more than 8 weights in a byte; GPTQ
# and AWQ store 2 a byte, FP8 1). A config that implies more parameters than that many per byte
# of its weight files describes another model (or was crafted: 2e9 layers would take minutes to
# build before any tensor is read), and is refused before anything is built.
MAX_PARAMS_PER_BYTE = 8


def check_size_on_disk(folder: Path, args: ModelArgs) -> None:
    """Refuse a config that implies far more parameters than the folder's weight files can hold."""
    files = _weight_file_paths(folder)
    if not files or not all(p.is_file() for p in files):  # none, or missing shards: weight_files says so
        return
    for path in files:
        open_safetensors(path)  # a file cut short or padded is named as such, not as a size mismatch
    on_disk = sum(p.stat().st_size for p in files)
    params = args.num_params()
    if params > MAX_PARAMS_PER_BYTE * on_disk:
        raise DuokaError(f"{folder / CONFIG_FILE} describes a model of {params:,} parameters, but its weight files "
                         f"hold {on_disk:,} bytes, fewer than 1 bit a parameter",
                         "config.json and the weights come from different models, or config.json was altered: restore "
                         "it from the original checkpoint")


# config.json's dtype name -> the torch dtype (the names config_fields.CONFIG_DTYPES allows): never
# getattr(torch, name), which would hand back whatever the torch module holds under that name.
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def checkpoint_dtype(folder: Path) -> torch.dtype | None:
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return _DTYPES.get(name) if isinstance(name, str) else None


def _weight_file_paths(folder: Path) -> list[Path]:
    """The weight files the folder's index names (each checked to lie inside it), or its single
    file; [] when it has neither."""
    if (folder / INDEX_FILE).is_file():
        return sorted(set(_index_entries(folder).values()))
    return [folder / SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else []


def _index_entries(folder: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from model.safetensors.index.json; every entry must name a file
    inside the folder, checked before any is opened."""
    index = folder / INDEX_FILE
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise DuokaError(f"{index} is not a valid safetensors index ({e!r})",
                         "restore it from the original checkpoint; it must hold a 'weight_map' object") from None
    if not isinstance(weight_map, dict):
        raise DuokaError(f"{index}: weight_map is a {type(weight_map).__name__}, not an object",
                         "restore it from the original checkpoint; it must hold a 'weight_map' object")
    roots = _allowed_roots(folder)
    return {name: _shard_path(folder, index, roots, name, fname) for name, fname in weight_map.items()}


def _allowed_roots(folder: Path) -> list[Path]:
    """Where a model folder's shards may lie: in the folder, and for a snapshot of the Hugging
    Face cache (its files are links into the repository's blobs) in that repository's blobs."""
    real = folder.resolve()
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent / "blobs")
    return roots


def _shard_path(folder: Path, index: Path, roots: list[Path], name: str, fname) -> Path:
    """An index entry's file, which must resolve inside the folder: an index is untrusted, and an
    absolute path, a ../ or a link out of the folder would make duoka read any file."""
    fix = ("an index may name only shard files inside its model folder: restore model.safetensors.index.json from "
           "the original checkpoint (or copy the shard into the folder)")
    if not isinstance(fname, str) or not fname:
        raise DuokaError(f"{index}: the entry for {name!r} is {fname!r}, not a file name", fix)
    path = folder / fname
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as e:  # a link loop
        raise DuokaError(f"{index}: the entry for {name!r} ({fname!r}) cannot be resolved ({e})", fix) from None
    if os.path.isabs(fname) or not any(real.is_relative_to(root) for root in roots):
        raise DuokaError(f"{index}: the entry for {name!r} names {fname!r}, which lies outside the model folder "
                         f"{folder}", fix)
    return path


def weight_files(folder: Path) -> dict[str, Path]:
    """Map every tensor name to the file holding it, from the index or the single file."""
    index = folder / INDEX_FILE
    single = folder / SINGLE_FILE
    if index.is_file():
        files = _index_entries(folder)
        missing = sorted({p.name for p in files.values() if not p.is_file()})
        if missing:
            raise DuokaError(f"{index.name} names shard files that are not in {folder}: {', '.join(missing)}",
                             "the download is incomplete; fetch the missing shards")
        return files
    if single.is_file():
        return {name: single for name in open_safetensors(single).keys()}
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    if pickles:
        raise DuokaError(
            f"{folder} holds only pickle weights ({', '.join(pickles[:3])}); duoka never unpickles checkpoints",
            "convert once with transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir) "
            "(it writes safetensors)",
        )
    raise DuokaError(f"{folder} has no {SINGLE_FILE} or {INDEX_FILE}", "point at a Hugging Face model folder with safetensors weights")


def open_safetensors(path: Path):
    """The file opened by safetensors, which also refuses a file whose size is not the one its
    header describes (cut short, or bytes appended: "file not fully covered")."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise DuokaError(f"{path} is not a readable safetensors file ({e})",
                         "the file is damaged or truncated; download it again") from None


# A model built with ModelOptions.packed_projections holds these tensors, each the
# checkpoint's tensors concatenated along the output rows in this order.
_PACKED = {
    "attention.wqkv.weight": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
    "attention.wqkv.bias": ("attention.wq.bias", "attention.wk.bias", "attention.wv.bias"),
    "feed_forward.w13.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
    "feed_forward.shared_expert.w13.weight": ("feed_forward.shared_expert.w1.weight",
                                              "feed_forward.shared_expert.w3.weight"),
}


def checkpoint_sources(name: str, shape: tuple[int, ...], args: ModelArgs) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors (HF name, shape) that the model's tensor `name` is made of, in
    the order that concatenated along dim 0 (and reshaped to `shape`) they give it."""
    m = _DUOKA_LAYER.match(name)
    experts = expert_names(name, shape[0]) if m else None
    if experts is not None:
        return [(hf, tuple(shape[1:])) for hf in experts]
    if not (m and m.group(2) in _PACKED):
        return [(duoka_to_hf(name), shape)]
    head_dim = args.resolved_head_dim
    width = args.shared_expert_intermediate_size if ".shared_expert." in m.group(2) else args.intermediate_size
    rows = ((args.n_heads * head_dim, args.n_kv_heads * head_dim, args.n_kv_heads * head_dim)
            if m.group(2).startswith("attention.") else (width, width))
    return [(duoka_to_hf(f"layers.{m.group(1)}.{part}"), (n, *shape[1:])) for part, n in zip(_PACKED[m.group(2)], rows)]


def _model_tensors(model: Qwen2) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """The model's tensor name -> its checkpoint sources, for every tensor this (possibly
    partial) model loads."""
    return {name: checkpoint_sources(name, tuple(tensor.shape), model.args) for name, tensor in model.state_dict().items()
            # transformers omits the tied head; its values are the embedding's. LoRA
            # adapters are not the base's: they start from their own init.
            if not (name == "output.weight" and model.args.tie_word_embeddings) and not is_adapter(name)}


def _expected_tensors(model: Qwen2) -> dict[str, tuple[int, ...]]:
    """HF name -> shape for every tensor this (possibly partial) model needs."""
    return {hf: shape for sources in _model_tensors(model).values() for hf, shape in sources}


def open_checkpoint(folder: Path, model: Qwen2, allow_unused: bool = False) -> tuple[dict[str, Path], dict]:
    """(HF name -> file, file -> open handle) for the folder's safetensors, once every tensor
    `model` needs (a meta-device model is enough: only shapes are read) is found in the
    headers with its shape; all problems are named in one error.

    allow_unused: accept checkpoint tensors the model does not hold (a pipeline stage
    loads only its layers). Missing or wrongly shaped tensors are always an error."""
    files = weight_files(folder)
    handles = {path: open_safetensors(path) for path in set(files.values())}
    expected = _expected_tensors(model)

    found: dict[str, tuple[int, ...]] = {}
    not_in_file = []
    for name, path in files.items():
        if name not in handles[path].keys():
            not_in_file.append(f"{name} (index says {path.name})")
            continue
        found[name] = tuple(handles[path].get_slice(name).get_shape())

    problems = []
    missing = sorted(set(expected) - set(found))
    tied_head = model.args.tie_word_embeddings and "lm_head.weight" in found
    unexpected = sorted(n for n in set(found) - set(expected) if not (tied_head and n == "lm_head.weight"))
    wrong = sorted(f"{n}: checkpoint {list(found[n])}, model {list(expected[n])}"
                   for n in set(found) & set(expected) if found[n] != expected[n])
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_short(missing)}")
    if not_in_file:
        problems.append(f"listed in the index but absent from their file: {_short(not_in_file)}")
    if unexpected and not allow_unused:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_short(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes ({len(wrong)}): {_short(wrong)}")
    if problems:
        raise DuokaError(f"checkpoint {folder} does not match its config.json:\n    " + "\n    ".join(problems),
                         "the weights and config.json come from different models, or the files are damaged")
    return files, handles


def load_hf_weights(model: Qwen2, folder: Path, allow_unused: bool = False, check_weights: bool = True) -> None:
    """Fill an allocated model from the folder's safetensors (checked by open_checkpoint),
    then refuse it if a tensor holds NaN or infinity (check_weights; refuse_nonfinite)."""
    files, handles = open_checkpoint(folder, model, allow_unused)
    params = model.state_dict()
    loaded = _model_tensors(model)
    for name, sources in loaded.items():
        parts = [handles[files[hf]].get_tensor(hf) for hf, _ in sources]
        # Packed projections concatenate their parts; stacked experts are the same bytes as [E, out, in].
        write_full_(params[name], parts[0] if len(parts) == 1 else torch.cat(parts).view(params[name].shape))
    if check_weights:
        refuse_nonfinite(folder, {name: params[name] for name in loaded})


# What a model folder's weights with NaN or infinity mean, and how to load them all the same.
FIX_NONFINITE = ("the weights are damaged (a failed download, save or conversion): download or export them again; "
                 "to load them anyway, turn the check off (duoka serve / generate / export: --skip-weight-check; "
                 "duoka train: --model.check_weights=false)")


def nonfinite_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the tensors that hold a NaN or infinity: one pass over each where it lies
    (on the GPU for a served model), a max-norm per tensor (a reduction: no tensor-sized
    temporary), and one wait for all of them. A sharded parameter is checked in its local part."""
    local = {name: t.to_local() if isinstance(t, DTensor) else t for name, t in tensors.items()}
    local = {name: t for name, t in local.items() if t.numel()}  # an FSDP2 shard may be empty
    if not local:
        return []
    norms = torch.stack([torch.linalg.vector_norm(t.detach(), ord=math.inf).float() for t in local.values()])
    return [name for name, ok in zip(local, torch.isfinite(norms).tolist()) if not ok]


def refuse_nonfinite(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    bad = nonfinite_names(tensors)
    if bad:
        raise DuokaError(f"{folder}: {len(bad)} weight tensor(s) hold NaN or infinite values: {_short(bad)}",
                         FIX_NONFINITE)


def _short(names: list[str], limit: int = 12) -> str:
    more = f", ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_hf_model(
    name_or_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    options: ModelOptions = ModelOptions(),
    lora: LoRAArgs | None = None,
    seed: int = 0,
    check_weights: bool = True,
) -> tuple[Qwen2, Path]:
    """Build the model (with `options`) on meta, allocate it once on `device` in `dtype`
    (default: the checkpoint's dtype on GPU, fp32 on CPU), then stream the weights in.
    lora: fresh adapters on the loaded base (their init drawn from `seed`), all in `dtype`;
    under QLoRA (lora.quantize) the base's decoder linear weights then in NF4."""
    folder = resolve_model_dir(name_or_path)
    args = read_config(folder)
    if dtype is None:
        dtype = checkpoint_dtype(folder) or torch.bfloat16
        if torch.device(device).type == "cpu":
            dtype = torch.float32  # CPU bf16 matmuls are slow and rarely what a user wants
    model = materialize(build_model(args, options, lora=lora), device, dtype)
    load_hf_weights(model, folder, check_weights=check_weights)
    if lora is not None:
        model.init_weights(seed, adapters_only=True)
        if lora.quantized:
            model.quantize_base_()
    return model.eval(), folder


# ---------------------------------------------------------------- writing

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.I)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = _SIZE.match(size)
    if not m:
        raise DuokaError(f"cannot read size {size!r}", "write it like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])


def hf_state_dict(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """duoka-named tensors under transformers' names, the tied head left out as HF does, a
    stacked expert tensor as one tensor per expert (views: nothing is copied here)."""
    out = {}
    for name, tensor in state_dict.items():
        if name == "output.weight" and args.tie_word_embeddings:
            continue
        experts = expert_names(name, tensor.shape[0])
        if experts is not None:
            out.update(zip(experts, tensor.unbind(0)))
        else:
            out[duoka_to_hf(name)] = tensor
    return out


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Greedy in order, as transformers does: a shard is closed when the next tensor
    would overflow it; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    current = 0
    for name, nbytes in sizes:
        if shards[-1] and current + nbytes > max_bytes:
            shards.append([])
            current = 0
        shards[-1].append(name)
        current += nbytes
    return shards


def save_hf_checkpoint(
    model: Qwen2,
    out_dir: str | Path,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    extra_files: Iterable[Path] = (),
) -> Path:
    """Write `model` as a Hugging Face folder that Qwen2ForCausalLM.from_pretrained reads.

    extra_files (tokenizer.json, tokenizer_config.json, ...) are copied alongside."""
    return save_hf_state_dict(model.state_dict(), model.args, out_dir, max_shard_size, dtype, extra_files)


def save_hf_state_dict(
    state_dict: dict[str, torch.Tensor],
    args: ModelArgs,
    out_dir: str | Path,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    extra_files: Iterable[Path] = (),
) -> Path:
    """The same from a full, duoka-named state dict (what a sharded model gathers)."""
    out = Path(out_dir)
    limit = parse_size(max_shard_size)
    tensors = hf_state_dict(state_dict, args)
    itemsize = (dtype or next(iter(tensors.values())).dtype).itemsize
    shards = plan_shards(((n, t.numel() * itemsize) for n, t in tensors.items()), limit)

    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        weight_map, total = {}, 0
        for i, names in enumerate(shards, start=1):
            fname = SINGLE_FILE if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            # One shard at a time on the host: a GPU model never needs a full CPU copy.
            shard = {n: _to_host(tensors[n], dtype) for n in names}
            _save_shard(shard, stage / fname)
            total += sum(t.numel() * t.element_size() for t in shard.values())
            weight_map.update({n: fname for n in names})
            del shard
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (stage / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        saved_dtype = dtype or next(iter(tensors.values())).dtype
        config = to_hf_config(args, dtype=str(saved_dtype).removeprefix("torch."))
        (stage / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        for extra in extra_files:
            extra = Path(extra)
            if extra.is_file():
                shutil.copy2(extra, stage / extra.name)
        readable_by_all(stage)
        _publish(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out


def _save_shard(shard: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, a failed write raised as the OSError it is: safetensors wraps
    it in its own error type ("... (os error 28)"), which would hide a full disk from every
    handler of OSError."""
    try:
        save_file(shard, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        found = re.search(r"os error (\d+)", str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from e


def _to_host(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach()
    if dtype is not None:
        t = t.to(dtype)
    return t.to("cpu").contiguous()


def readable_by_all(folder: Path) -> None:
    """safetensors creates files private to the owner; a model folder is meant to be shared
    like any file the user writes, so apply the ordinary umask instead."""
    umask = os.umask(0)
    os.umask(umask)
    for p in folder.iterdir():
        os.chmod(p, 0o666 & ~umask)


def _publish(stage: Path, out: Path) -> None:
    """Move a complete staging folder into place. Into an existing folder, files are
    replaced one by one with the weights index last, then the shards of an earlier save
    that the new files do not name are removed."""
    if not out.exists():
        os.replace(stage, out)
        return
    new_names = {p.name for p in stage.iterdir()}
    for p in sorted(stage.iterdir(), key=lambda p: p.name == INDEX_FILE):
        os.replace(p, out / p.name)
    for old in list(out.glob("model*.safetensors")) + [out / INDEX_FILE]:
        if old.exists() and old.name not in new_names:
            old.unlink()
    stage.rmdir()
