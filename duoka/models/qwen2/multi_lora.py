"""Several LoRA adapters served at once by one packed (serving) Qwen2, as S-LoRA and Punica
batch them (Sheng et al. 2023, arXiv:2311.03285; Chen et al. 2023, arXiv:2310.18547): the
requests of every adapter, and the base model's, run side by side in one step.

Each projection that some adapter targets is replaced at load by a MultiLoRALinear holding
every adapter's weights stacked: for input x [T, in],

    y = base(x) + ((x @ A_cat.T) * M) @ B_cat.T

A_cat [R, in] stacks the A of each (adapter, target) pair (for the packed q/k/v: q's, k's and
v's of every adapter), R the sum of their ranks; B_cat [out, R] puts each pair's B in its
target's rows of the packed output (zeros elsewhere); M [T, R] is each token's adapter scale
on that adapter's columns and 0 elsewhere (0 everywhere for a base-model token). One pair of
matmuls per projection for all adapters, of shapes fixed at load: it runs inside CUDA graphs
and compiled blocks. M is computed from the step's adapter index per token, which the runner
writes into one AdapterIds object that every MultiLoRALinear of the model shares.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from duoka.errors import DuokaError
from duoka.models.lora import LINEAR_NAMES, is_adapter
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.model import Qwen2
from duoka.models.qwen2.peft import ADAPTER_CONFIG, read_adapter

# Every token pays for the sum of all adapters' ranks in each targeted projection (the
# shapes are fixed, whatever the token's adapter), so one large adapter slows every request,
# the base model's too: at 256, Qwen2-0.5B's o_proj (896 wide) does 57% more multiply-adds.
# Beyond it, serving the adapter merged (--adapter) is the better deal.
MAX_LORA_RANK = 256

# A packed serving block's projections and the targets (Hugging Face names) whose outputs
# they hold, in row order (ModelOptions.packed_projections).
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "attention.wqkv": ("q_proj", "k_proj", "v_proj"),
    "attention.wo": ("o_proj",),
    "feed_forward.w13": ("gate_proj", "up_proj"),
    "feed_forward.w2": ("down_proj",),
}
# Target -> duoka's unpacked module in a block: the name of the adapter's tensors (peft.duoka_name).
MODULES = {"q_proj": "attention.wq", "k_proj": "attention.wk", "v_proj": "attention.wv", "o_proj": "attention.wo",
           "gate_proj": "feed_forward.w1", "up_proj": "feed_forward.w3", "down_proj": "feed_forward.w2"}

# Under tensor parallelism: a duoka weight name -> the (dim, start, stop) of the full tensor
# this rank holds, or None when it is whole (serve.tp_shard.shard_range, bound to a rank).
Shard = Callable[[str], "tuple[int, int, int] | None"]


def target_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(out, in) of each target's weight in the whole model."""
    hd = args.resolved_head_dim
    q, kv, dim, mlp = args.n_heads * hd, args.n_kv_heads * hd, args.dim, args.intermediate_size
    return {"q_proj": (q, dim), "k_proj": (kv, dim), "v_proj": (kv, dim), "o_proj": (dim, q),
            "gate_proj": (mlp, dim), "up_proj": (mlp, dim), "down_proj": (dim, mlp)}


@dataclass(frozen=True)
class ServedLoRA:
    """One adapter as served beside others: read from its folder and checked against the model."""
    name: str
    folder: Path
    rank: int  # the largest of its (target, layer) pairs' ranks
    scaling: float
    targets: tuple[str, ...]  # Hugging Face names, in LINEAR_NAMES order
    tensors: dict[str, torch.Tensor]  # layers.N.<module>.lora_a.weight / lora_b.weight (duoka names)

    def pair(self, layer: str, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [rank, in], B [out, rank]) of `target` in layer `layer`."""
        return _pair(self.tensors, layer, target)


def read_lora(name: str, folder: str | Path, args: ModelArgs) -> ServedLoRA:
    """Read adapter `name` and check it fits the served model (`args`): a PEFT LoRA adapter
    (read_adapter's checks), no module trained whole, every layer adapted, one rank of at
    most MAX_LORA_RANK, and every A and B of the shape this model's projection needs. The
    shapes decide whether the base fits (hidden size, heads, MLP width, layer count), not
    the base's name in adapter_config.json: a local copy of the base has another name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DuokaError(f"--lora {name}={folder}: there is no folder {folder}",
                         "give the folder of a PEFT LoRA adapter (a LoRA run's hf/step-N)")
    adapter = read_adapter(folder)  # refuses a folder without adapter_config.json, DoRA, patterns, ...
    other_base = f"serve it on the base it was trained on ({adapter.base or 'its ' + ADAPTER_CONFIG + ' may say'})"

    def refuse(cause: str, fix: str = other_base) -> DuokaError:
        return DuokaError(f"--lora {name}={folder}: {cause}", fix)

    whole = sorted(n for n in adapter.tensors if not is_adapter(n))
    if whole:
        raise refuse(f"it trains {whole[0]} whole (modules_to_save), which adapters served side by side cannot "
                     "share", "serve it alone, merged: duoka serve --adapter DIR")
    layers: dict[str, set[int]] = {}
    for tensor_name in adapter.tensors:
        if tensor_name.endswith(".lora_a.weight"):
            _, layer, rest = tensor_name.split(".", 2)
            target = next(t for t, module in MODULES.items() if rest.startswith(module + "."))
            layers.setdefault(target, set()).add(int(layer))
    targets = tuple(t for t in LINEAR_NAMES if t in layers)
    if not targets:
        raise refuse("it holds no LoRA tensors", "point at the adapter folder a LoRA run or PEFT wrote")
    shapes, rank = target_shapes(args), 0
    for target in targets:
        if layers[target] != set(range(args.n_layers)):
            raise refuse(f"its {target} adapters cover layers {_span(layers[target])}, and this model has layers "
                         f"0-{args.n_layers - 1} (every layer must be adapted)")
        out, inp = shapes[target]
        for layer in range(args.n_layers):
            a, b = _pair(adapter.tensors, str(layer), target)
            rank = max(rank, a.shape[0])
            if a.shape[1] != inp or b.shape[0] != out:
                raise refuse(f"its layer {layer} {target} adapter maps {a.shape[1]} inputs to {b.shape[0]} outputs; "
                             f"this model's {target} maps {inp} to {out} (hidden size {args.dim}, "
                             f"{args.n_heads} heads of {args.resolved_head_dim}, MLP {args.intermediate_size})")
    if rank > MAX_LORA_RANK:
        raise refuse(f"its rank {rank} is above {MAX_LORA_RANK}, and every request would pay for it",
                     "serve it merged (duoka serve --adapter DIR) or export it merged as a model of its own")
    return ServedLoRA(name, folder, rank, adapter.scaling, targets, adapter.tensors)


def _pair(tensors: dict[str, torch.Tensor], layer: str, target: str) -> tuple[torch.Tensor, torch.Tensor]:
    stem = f"layers.{layer}.{MODULES[target]}"
    return tensors[f"{stem}.lora_a.weight"], tensors[f"{stem}.lora_b.weight"]


def _span(layers: set[int]) -> str:
    ordered = sorted(layers)
    return f"{ordered[0]}-{ordered[-1]}" if len(ordered) == ordered[-1] - ordered[0] + 1 else \
        ", ".join(map(str, ordered))


class AdapterIds:
    """The step's adapter slot per token (int32 [T]; 0 = the base model), one object shared by
    every MultiLoRALinear of a model. The runner sets it before each forward: a tensor of
    the step's token count, or, under a CUDA graph, a view of the graph's static buffer that
    each replay fills first."""

    def __init__(self):
        self.tokens: torch.Tensor | None = None

    def use(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens


class MultiLoRALinear(nn.Module):
    """A base projection plus every served adapter's share of it (the module's docstring).

    lora_a [R, in], lora_b [out, R]: the stacked adapters; segment_adapter [R] (int32): the
    slot (1..n) whose rank column each is; segment_scale [R]: that adapter's alpha / r."""

    def __init__(self, base: nn.Linear, lora_a: torch.Tensor, lora_b: torch.Tensor, segment_adapter: torch.Tensor,
                 segment_scale: torch.Tensor, ids: AdapterIds):
        super().__init__()
        self.base = base
        # Not in the state dict: the served model's weights stay the checkpoint's.
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer("lora_b", lora_b, persistent=False)
        self.register_buffer("segment_adapter", segment_adapter, persistent=False)
        self.register_buffer("segment_scale", segment_scale, persistent=False)
        self.ids = ids  # shared, set per step by the runner; a plain object, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., T, in] with T the step's tokens, as AdapterIds.tokens holds them."""
        scale = torch.where(self.ids.tokens[:, None] == self.segment_adapter, self.segment_scale, 0.0)
        return self.base(x) + F.linear(F.linear(x, self.lora_a) * scale, self.lora_b)


def _stack(loras: Sequence[ServedLoRA], layer: str, parts: tuple[str, ...], part_rows: tuple[int, ...],
           base: nn.Linear, shard: Shard | None) -> tuple[torch.Tensor, ...] | None:
    """(lora_a, lora_b, segment_adapter, segment_scale) of one projection whose output holds
    `parts` of `part_rows` rows each, or None when no adapter targets any of them. A
    tensor-parallel rank keeps, of a projection split by rows (q/k/v, gate/up), its rows of
    each B; of one split by columns (o, down), its columns of each A: its partial sum then
    holds its share of the adapters' too, and the all-reduce completes both."""
    first_rows = dict(zip(parts, (sum(part_rows[:i]) for i in range(len(parts)))))
    a_parts, b_blocks, seg_adapter, seg_scale = [], [], [], []
    for slot, lora in enumerate(loras, start=1):
        for part, rows in zip(parts, part_rows):
            if part not in lora.targets:
                continue
            a, b = lora.pair(layer, part)
            ranged = shard(f"layers.{layer}.{MODULES[part]}.weight") if shard is not None else None
            if ranged is not None:
                dim, start, stop = ranged
                a, b = (a, b[start:stop]) if dim == 0 else (a[:, start:stop], b)
            if b.shape[0] != rows or a.shape[1] != base.weight.shape[1]:  # a layout bug: read_lora checked shapes
                raise RuntimeError(f"layer {layer} {part}: adapter {tuple(b.shape)} x {tuple(a.shape)} does not fit "
                                   f"{rows} rows of {tuple(base.weight.shape)}")
            b_blocks.append((first_rows[part], len(seg_adapter), b))
            a_parts.append(a)
            seg_adapter += [slot] * a.shape[0]
            seg_scale += [lora.scaling] * a.shape[0]
    if not a_parts:
        return None
    lora_b = torch.zeros(base.weight.shape[0], len(seg_adapter), dtype=torch.float32)
    for row, col, b in b_blocks:
        lora_b[row:row + b.shape[0], col:col + b.shape[1]] = b
    lora_a = torch.cat([a.float() for a in a_parts])
    device, dtype = base.weight.device, base.weight.dtype
    return (lora_a.to(device, dtype), lora_b.to(device, dtype),
            torch.tensor(seg_adapter, dtype=torch.int32, device=device), torch.tensor(seg_scale, dtype=dtype,
                                                                                     device=device))


def add_loras(model: Qwen2, loras: Sequence[ServedLoRA], shard: Shard | None = None) -> AdapterIds:
    """Replace each projection of a packed (serving) model that some adapter targets by a
    MultiLoRALinear over all of them; adapter i of `loras` is slot i + 1. A projection no
    adapter targets stays as it is. Returns the AdapterIds those modules read. shard: under
    tensor parallelism, this rank's ranges of the full tensors."""
    if not model.options.packed_projections:
        raise ValueError("add_loras takes a serving model (ModelOptions.packed_projections)")
    ids = AdapterIds()
    for layer, block in model.layers.items():
        for path, parts in PROJECTIONS.items():
            owner_name, attr = path.split(".")
            owner = getattr(block, owner_name)
            base = getattr(owner, attr)
            rows = base.weight.shape[0]
            # This model's (this rank's) rows of each part: q, k, v as attention splits them.
            part_rows = tuple(owner.qkv_split) if path == "attention.wqkv" else (rows // len(parts),) * len(parts)
            stacked = _stack(loras, layer, parts, part_rows, base, shard)
            if stacked is not None:
                setattr(owner, attr, MultiLoRALinear(base, *stacked, ids))
    return ids


def adapter_ids_of(model: nn.Module) -> AdapterIds | None:
    """The AdapterIds a model's MultiLoRALinear modules share, or None for a model without."""
    return next((m.ids for m in model.modules() if isinstance(m, MultiLoRALinear)), None)
