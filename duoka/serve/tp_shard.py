"""Tensor parallelism for serving: each rank builds and loads only its shard of the model,
as plain tensors (no DTensor: a decode step is a few milliseconds, and DTensor's dispatch
would cost more than the matmuls), with one all-reduce after attention and one after the MLP.

The layout is Megatron's (Shoeybi et al. 2019, arXiv:1909.08053), as gpt-fast's tp.py:
q/k/v and gate/up projections split by output rows (whole heads per rank, the q/k/v biases
with their rows), o and down projections split by input columns, so each rank's attention
and MLP produce a partial sum of the full output that one all-reduce completes. Embedding,
norms and output head stay whole on every rank.

A Qwen2-MoE layer splits its experts by width (Megatron's and vLLM's tensor-parallel MoE):
every routed expert's gate/up rows and down columns, stacked [E, out, in], are cut like a
dense MLP's, as are the shared expert's; the router and the shared expert's gate stay whole
(every rank routes its copy of the same tokens alike). Each rank then runs every expert on
a slice of its width, and the layer's output (routed + gated shared) is a partial sum that
one all-reduce completes, in place of the dense MLP's.

Grouped-query attention with fewer KV heads than ranks (Qwen2-1.5B's 2 at tp 4) replicates
the KV heads: each rank keeps the one KV head its query heads read. A shard is a Qwen2 built
with the shard's sizes (shard_args), so every module is configured at construction and the
paged KV cache is allocated with the local head count like any model's.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs, ModelOptions
from duoka.models.qwen2.hf_adapter import (
    checkpoint_sources,
    hf_expert,
    hf_to_duoka,
    open_checkpoint,
    refuse_nonfinite,
)
from duoka.models.qwen2.model import Attention, FeedForward, Qwen2, build_model, materialize
from duoka.models.qwen2.moe import MoE, RoutingStats

# Parameters split by output rows (dim 0) or input columns (dim 1); every other one is
# replicated. The key/value projections are split by rows too, by KV head (kv_head_range).
_Q_ROWS = ("attention.wq.weight", "attention.wq.bias")
_KV_ROWS = ("attention.wk.weight", "attention.wk.bias", "attention.wv.weight", "attention.wv.bias")
_MLP_ROWS = ("feed_forward.w1.weight", "feed_forward.w3.weight")
_Q_COLUMNS = ("attention.wo.weight",)
_MLP_COLUMNS = ("feed_forward.w2.weight",)
# A MoE layer: the shared expert splits as a dense MLP; the routed experts, stacked
# [E, out, in], by each expert's rows (gate/up: dim 1) or columns (down: dim 2).
_SHARED_ROWS = ("feed_forward.shared_expert.w1.weight", "feed_forward.shared_expert.w3.weight")
_SHARED_COLUMNS = ("feed_forward.shared_expert.w2.weight",)
_EXPERT_ROWS = ("feed_forward.experts.w1", "feed_forward.experts.w3")
_EXPERT_COLUMNS = ("feed_forward.experts.w2",)


def _has_dense_mlp(args: ModelArgs) -> bool:
    """Whether some layer has the dense MLP of intermediate_size (in a MoE model every layer
    may be sparse, and that width then unused)."""
    return len(args.moe_layers) < args.n_layers


def tp_problems(args: ModelArgs, tp: int) -> list[str]:
    """Why `tp` ranks cannot split this model (empty when they can)."""
    if tp < 1:
        return [f"tp={tp} is not a process count"]
    problems = []
    if args.n_heads % tp:
        problems.append(f"its {args.n_heads} attention heads are not divisible by {tp}")
    if tp <= args.n_kv_heads and args.n_kv_heads % tp:
        problems.append(f"its {args.n_kv_heads} KV heads are not divisible by {tp}")
    if tp > args.n_kv_heads and tp % args.n_kv_heads:
        # Replicated KV heads: each rank's query heads must all read one KV head.
        problems.append(f"{tp} is not a multiple of its {args.n_kv_heads} KV heads (needed to replicate them)")
    if _has_dense_mlp(args) and args.intermediate_size % tp:
        problems.append(f"its MLP width {args.intermediate_size} is not divisible by {tp}")
    if args.num_experts and args.moe_intermediate_size % tp:
        problems.append(f"its routed experts' width (moe_intermediate_size) {args.moe_intermediate_size} "
                        f"is not divisible by {tp}")
    if args.num_experts and args.shared_expert_intermediate_size % tp:
        problems.append(f"its shared expert's width (shared_expert_intermediate_size) "
                        f"{args.shared_expert_intermediate_size} is not divisible by {tp}")
    return problems


def valid_tp_sizes(args: ModelArgs) -> list[int]:
    """Every tp that splits this model; none exceeds the query head count."""
    return [tp for tp in range(1, args.n_heads + 1) if not tp_problems(args, tp)]


def check_tp_size(args: ModelArgs, tp: int) -> None:
    """Refuse a tp that cannot split the model, before any process starts, naming the sizes that can."""
    problems = tp_problems(args, tp)
    if problems:
        sizes = ", ".join(str(n) for n in valid_tp_sizes(args))
        raise DuokaError(f"tensor parallelism over {tp} processes cannot split this model: " + "; ".join(problems),
                         f"use a tp that divides it: {sizes}")


def local_kv_heads(args: ModelArgs, tp: int) -> int:
    """KV heads one rank holds (and its paged KV cache is allocated with): a share of them,
    or one replicated head when there are fewer KV heads than ranks."""
    return max(1, args.n_kv_heads // tp)


def shard_args(args: ModelArgs, tp: int) -> ModelArgs:
    """The sizes of one rank's shard as a model of its own: its query heads, KV heads and MLP
    widths (dense, routed and shared experts), the head width pinned (dim // n_heads would
    change with the head count). A width no layer uses is left whole."""
    check_tp_size(args, tp)
    local = args.replace(n_heads=args.n_heads // tp, n_kv_heads=local_kv_heads(args, tp),
                         head_dim=args.resolved_head_dim)
    if _has_dense_mlp(args):
        local = local.replace(intermediate_size=args.intermediate_size // tp)
    if args.num_experts:
        local = local.replace(moe_intermediate_size=args.moe_intermediate_size // tp,
                              shared_expert_intermediate_size=args.shared_expert_intermediate_size // tp)
    return local


def kv_head_range(args: ModelArgs, tp: int, rank: int) -> tuple[int, int]:
    """[first, last) KV heads of `rank`. Replicated: the KV head its query heads' group reads."""
    if tp <= args.n_kv_heads:
        n = args.n_kv_heads // tp
        return rank * n, (rank + 1) * n
    first = (rank * (args.n_heads // tp)) // (args.n_heads // args.n_kv_heads)
    return first, first + 1


def shard_range(name: str, args: ModelArgs, tp: int, rank: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the full tensor that parameter `name` (duoka's name) holds on
    `rank`, or None when it is replicated."""
    suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
    hd = args.resolved_head_dim
    q = args.n_heads // tp * hd
    mlp = args.intermediate_size // tp
    if suffix in _Q_ROWS or suffix in _Q_COLUMNS:
        return (0 if suffix in _Q_ROWS else 1), rank * q, (rank + 1) * q
    if suffix in _KV_ROWS:
        first, last = kv_head_range(args, tp, rank)
        return 0, first * hd, last * hd
    if suffix in _MLP_ROWS or suffix in _MLP_COLUMNS:
        return (0 if suffix in _MLP_ROWS else 1), rank * mlp, (rank + 1) * mlp
    if suffix in _SHARED_ROWS or suffix in _SHARED_COLUMNS:
        shared = args.shared_expert_intermediate_size // tp
        return (0 if suffix in _SHARED_ROWS else 1), rank * shared, (rank + 1) * shared
    if suffix in _EXPERT_ROWS or suffix in _EXPERT_COLUMNS:
        width = args.moe_intermediate_size // tp
        return (1 if suffix in _EXPERT_ROWS else 2), rank * width, (rank + 1) * width
    return None


def build_shard(args: ModelArgs, tp: int, device: str | torch.device, dtype: torch.dtype,
                options: ModelOptions = ModelOptions()) -> Qwen2:
    """One rank's shard, allocated (uninitialised) on `device` in `dtype`: built on meta
    with shard_args, so no rank ever allocates a full projection."""
    return materialize(build_model(shard_args(args, tp), options), device, dtype)


@torch.no_grad()
def load_shard(model: Qwen2, folder: Path, args: ModelArgs, tp: int, rank: int, reference: Qwen2 | None = None,
               allow_unused: bool = False) -> None:
    """Fill a build_shard model with `rank`'s slices of the folder's safetensors. Sharded
    weights are read through safetensors' get_slice, so a rank reads only its part of each
    from disk: 72B loads at tp 8 without any rank holding a full layer's projections (nor a
    MoE model's rank a full expert: each expert's tensor is sliced, then they are stacked).
    The checkpoint's headers are checked against the full model `args` first (reference: a
    meta model of what to check instead, e.g. one without the projections a quantized
    checkpoint stores in its own tensors, which allow_unused then lets pass)."""
    files, handles = open_checkpoint(folder, reference if reference is not None else build_model(args), allow_unused)
    local = shard_args(args, tp)
    for name, param in model.state_dict().items():
        if name == "output.weight" and args.tie_word_embeddings:
            continue  # the embedding's weight, loaded under its own name
        sources = [hf_name for hf_name, _ in checkpoint_sources(name, tuple(param.shape), local)]
        parts = [_read_part(handles[files[hf_name]], hf_name, args, tp, rank) for hf_name in sources]
        if hf_expert(sources[0]) is not None:  # routed experts: one [out, in] tensor per expert, stacked
            value = torch.stack(parts)
        else:  # packed projections: their parts' rows in order
            value = parts[0] if len(parts) == 1 else torch.cat(parts)
        if tuple(value.shape) != tuple(param.shape):  # a bug in the layout, not in the checkpoint
            raise RuntimeError(f"{name}: slice {tuple(value.shape)} does not fit the shard's {tuple(param.shape)}")
        param.copy_(value)


def _read_part(source, hf_name: str, args: ModelArgs, tp: int, rank: int) -> torch.Tensor:
    """This rank's part of checkpoint tensor `hf_name`, read from disk alone (get_slice). One
    routed expert's tensor is a slice [out, in] of duoka's stacked [E, out, in]: its split
    dimension is the stacked one's less one."""
    part = shard_range(hf_to_duoka(hf_name), args, tp, rank)
    if part is None:
        return source.get_tensor(hf_name)
    dim, start, stop = part
    if hf_expert(hf_name) is not None:
        dim -= 1
    lazy = source.get_slice(hf_name)
    return lazy[start:stop] if dim == 0 else lazy[:, start:stop]


def all_reduce_outputs(model: nn.Module, group: dist.ProcessGroup | None) -> list[RemovableHandle]:
    """Sum each attention's and each MLP's output over the tp group, in place, where the
    row-split o and down projections leave partial sums: exactly two all-reduces per layer.
    A MoE layer's output (routed experts + gated shared expert) is summed once, as a whole:
    its shared expert, a FeedForward inside it, is not reduced on its own (that would add
    the full shared output tp times). Forward hooks stay outside compiled bodies and inside
    CUDA-graph captures."""
    def reduce(module: nn.Module, inputs, output: torch.Tensor) -> None:
        dist.all_reduce(output, group=group)

    def reduce_moe(module: nn.Module, inputs, output: tuple[torch.Tensor, RoutingStats]) -> None:
        # (output, RoutingStats): the statistics are already the same on every rank.
        dist.all_reduce(output[0], group=group)

    inner = {id(m.shared_expert) for m in model.modules() if isinstance(m, MoE)}
    return ([m.register_forward_hook(reduce) for m in model.modules()
             if isinstance(m, (Attention, FeedForward)) and id(m) not in inner]
            + [m.register_forward_hook(reduce_moe) for m in model.modules() if isinstance(m, MoE)])


def load_tp_model(folder: Path, args: ModelArgs, group: dist.ProcessGroup | None, device: str | torch.device,
                  dtype: torch.dtype, options: ModelOptions = ModelOptions(), check_weights: bool = True) -> Qwen2:
    """This rank's shard of the model in `folder` (config `args`), loaded and all-reducing
    over `group` (tp = the group's size, this rank = its rank in it), in eval mode; refused
    when a tensor of the shard holds NaN or infinity (check_weights). A rank that refuses
    ends the group: the launcher names its error."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    model = build_shard(args, tp, device, dtype, options)
    load_shard(model, folder, args, tp, rank)
    if check_weights:
        refuse_nonfinite(folder, model.state_dict())
    if tp > 1:
        all_reduce_outputs(model, group)
    return model.eval().requires_grad_(False)
