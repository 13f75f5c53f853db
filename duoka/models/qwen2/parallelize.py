"""Apply the parallel layout to a meta-built Qwen2 (or one pipeline stage of it), in
torchtitan's order: float8 -> tensor parallel plan -> activation checkpointing -> compile -> FSDP2
(per block, then the root) or DDP.

The model itself stays a plain module; everything distributed happens here.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from duoka.config import Config
from duoka.errors import DuokaError
from duoka.models.qwen2.model import Qwen2
from duoka.parallel.balance import BlockTimer
from duoka.parallel.dims import ParallelDims

# TransformerBlock calls attention(x, cos, sin, cache, layer, input_pos, mask): only x is
# a sharded activation; the others pass through as they are.
_ATTENTION_ARGS = 7


def apply_tensor_parallel(model: Qwen2, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism with sequence parallelism (Korthikanti et al.
    2022, arXiv:2205.05198) on DTensor: q/k/v and gate/up projections split by output
    columns (whole heads per rank, QKV biases with them), o and down projections by input
    rows; between them the residual stream stays sharded on the sequence, and the norms run
    on their sequence shard. The output head is split by vocabulary and its logits stay
    sharded: the loss runs under `loss_parallel` and never gathers them."""
    plan = {}
    if model.tok_embeddings is not None and model.takes_tokens:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    elif model.tok_embeddings is not None:  # a last pipeline stage holding the tied weight only
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),) + (None,) * (_ATTENTION_ARGS - 1),
                                            desired_input_layouts=(Replicate(),) + (None,) * (_ATTENTION_ARGS - 1)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    # Both the embedding (rowwise) and the head (colwise) shard the [vocab, dim] weight on
    # the vocabulary: the tied weight keeps one layout, so re-tying after the plan is safe.
    model.tie_weights()


def convert_to_float8(model: Qwen2, recipe: str, fsdp: bool) -> None:
    """training.float8: swap the decoder blocks' linear layers for torchao's Float8Linear
    (float8 matmuls in forward and backward, dynamic scales; the weights stay in their
    dtype and keep their names, so checkpoints and exports do not change). The head stays
    in bf16 (torchtitan's default too): the fused loss multiplies by its weight directly,
    without calling the module, so converting it would change only the unfused loss.
    With tensorwise scaling under FSDP2 the weights are cast to float8 before the
    all-gather, which halves its bytes; their scales are then computed for all weights at
    once after each optimizer step (see precompute_float8_scales)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # torchao's float8 matmul needs both dimensions to be multiples of 16. Every Qwen2 shape
    # has them; a checkpoint that does not is refused, not trained half in float8.
    odd = [f"layers.{name} ({m.in_features} x {m.out_features})" for name, m in model.layers.named_modules()
           if isinstance(m, nn.Linear) and (m.in_features % 16 or m.out_features % 16)]
    if odd:
        raise DuokaError(f"training.float8={recipe} needs linear layers whose sizes are multiples of 16; "
                         f"{len(odd)} are not, e.g. {odd[0]}", "use training.float8=none for this model")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if float8_gathers(recipe, fsdp):
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn.startswith("layers."))


def float8_gathers(recipe: str, fsdp: bool) -> bool:
    """Whether FSDP2 all-gathers the float8 weights (torchao supports it for tensorwise scales)."""
    return fsdp and recipe == "tensorwise"


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: every float8-gathered weight's scale from one fused amax
    and one all-reduce, instead of one all-reduce per weight inside the next all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def parallelize_qwen2(model: Qwen2, dims: ParallelDims, mesh: DeviceMesh, cfg: Config, compute_dtype: torch.dtype,
                      block_timer: BlockTimer | None = None):
    """Returns the module to train (the model itself, sharded in place, or a DDP wrapper).

    Called on the meta device for FSDP (sharding happens before any memory is taken);
    DDP needs real storage, so the caller materialises first for ddp. block_timer (load
    balancing, debug slowdown) goes around every block's forward."""
    for block in model.layers.values():
        block.attention.fuse_qkv = cfg.training.fuse_qkv
    if cfg.training.float8 != "none":  # the trainer refused tp > 1 (check_float8)
        convert_to_float8(model, cfg.training.float8, dims.fsdp)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if cfg.training.activation_checkpointing == "full":
        for name, block in model.layers.items():
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    if cfg.training.compile:
        for block in model.layers.values():
            # Under activation checkpointing the compiled region is the block inside the
            # wrapper: compiling the wrapper recompiled once per block on GPU and hit
            # dynamo's recompile limit at the ninth (bench/NOTES.md section 18).
            block = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
            if dims.tp > 1:
                # The tensor-parallel plan's input/output hooks must stay outside the
                # compiled region: a whole compiled block gave wrong gradients (torch 2.13),
                # this way the gradients equal one process's (checked by hand, see the
                # issue-5 note; too slow to compile in CI). Compiling the
                # attention and MLP bodies still removes DTensor's dispatch from the matmuls.
                block.attention.forward = torch.compile(block.attention.forward, fullgraph=True)
                block.feed_forward.forward = torch.compile(block.feed_forward.forward, fullgraph=True)
            elif block_timer is not None:
                # The block timer's CUDA events must stay outside the compiled region, so it
                # wraps the compiled forward below; the whole forward (norms and residuals
                # included) is still one graph. Compiling only the attention and MLP bodies
                # here left the norms eager in every balanced run.
                block.forward = torch.compile(block.forward, fullgraph=True)
            else:
                block.compile(fullgraph=True)  # in place: parameter names stay the same
        # The fused loss's softmax pass too (not under tp: its logits are DTensors in loss_parallel).
        model.compile_loss = dims.tp == 1
    # The modules the block timer (load balancing, debug slowdown) measures: every block and
    # the LM head, the bulk of a step's compute (the head is not called with the fused loss).
    timed = [*model.layers.values(), *([model.output] if model.output is not None else [])] \
        if block_timer is not None else []
    for module in timed:
        # Wrapping forward (not the module call) keeps the timer after FSDP2's pre-forward
        # hook: the interval starts once the module's parameters are gathered.
        module.forward = block_timer.wrap(module.forward)

    if dims.fsdp:
        # bf16 parameters for compute, fp32 gradient reduction, fp32 master weights in the
        # optimizer: the usual mixed precision recipe.
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        # One shard dimension: plain FSDP2. Replica groups too: HSDP (with a shard size of 1
        # that is replicated weights with all-reduced gradients, DDP's semantics).
        dp_mesh = mesh["dp_shard"] if dims.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]
        reshard = cfg.parallel.reshard_after_forward
        if dims.pp > 1:
            # Each micro-batch's backward would gather the weights again: keep them
            # gathered between a stage's forward and backward (torchtitan's choice).
            reshard = False
        blocks = list(model.layers.values())
        per_unit = cfg.parallel.fsdp_blocks_per_unit
        if per_unit < 0:
            raise ValueError("resolve parallel.fsdp_blocks_per_unit=-1 with plan.memory.auto_blocks_per_unit first")
        per_unit = per_unit or len(blocks)
        for first in range(0, len(blocks), per_unit):
            unit = blocks[first:first + per_unit]
            # A list makes one FSDP2 unit of several blocks: one collective for all of them.
            fully_shard(unit if len(unit) > 1 else unit[0], mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        # The root holds the embedding, final norm and head; it is used last in forward and
        # first in backward, so keeping it gathered after forward saves one all-gather.
        fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
        for module in timed:
            block_timer.attach(module)  # after fully_shard: its hooks must run after FSDP2's
        return model
    for module in timed:
        block_timer.attach(module)
    if dims.world_size == 1:
        return model
    device_ids = [torch.cuda.current_device()] if mesh.device_type == "cuda" else None
    # gradient_as_bucket_view: gradients live in the all-reduce buckets themselves, saving a
    # copy of every gradient into and out of the buckets each step (and that memory).
    return DistributedDataParallel(model, device_ids=device_ids, process_group=mesh["dp_replicate"].get_group(),
                                   gradient_as_bucket_view=True, bucket_cap_mb=cfg.parallel.ddp_bucket_mb)


def unwrap(module: nn.Module) -> Qwen2:
    return module.module if isinstance(module, DistributedDataParallel) else module
