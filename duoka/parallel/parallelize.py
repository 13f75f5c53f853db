"""Apply the parallel layout to a meta-built Qwen2 (or one pipeline stage of it), in
torchtitan's order: float8 -> tensor parallel plan -> expert parallelism -> activation
checkpointing -> the caller's module hooks -> FSDP2 (the experts, per unit of blocks, then
the root) or DDP.

The model itself stays a plain module configured at construction (ModelOptions: kernels,
compiled bodies); everything distributed happens here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from duoka.errors import QUANT_INSTALL, DuokaError
from duoka.models.lora import LoRALinear
from duoka.models.qwen2.model import Qwen2
from duoka.parallel.dims import ParallelDims
from duoka.parallel.expert_parallel import apply_expert_parallel


@dataclass(frozen=True)
class ParallelOptions:
    """The resolved training choices that shape the layout (the launcher resolved them)."""
    compute_dtype: torch.dtype
    activation_checkpointing: bool
    float8: str  # "none" | "tensorwise" | "rowwise"
    fsdp_blocks_per_unit: int  # 0: one FSDP2 unit for all blocks; n >= 1: n consecutive blocks per unit
    reshard_after_forward: bool
    ddp_bucket_mb: int


class ModuleHooks(Protocol):
    """Hooks on the timed modules (timed_modules), e.g. the load balancer's block timer:
    before_shard registers what must run before FSDP2's hooks, after_shard what must run after."""

    def before_shard(self, modules: list[nn.Module]) -> None: ...

    def after_shard(self, modules: list[nn.Module]) -> None: ...


class _LoRAStyle:
    """A LoRA layer (duoka.models.lora.LoRALinear) split like its base layer. torch's
    Colwise/RowwiseParallel place a module's parameters in `_partition_linear_fn`, called
    for the layer and each of its sub-modules and written for a plain nn.Linear; no public
    hook takes a linear layer with sub-layers. This mixin is the one override of it, and
    `_check_partition_hook` checks at import that torch still calls it so.

    `placements`: the sub-module ("" the layer itself, "lora_a", "lora_b") -> the placement
    of its parameters; a parameter keeps its requires_grad (the base stays frozen)."""

    placements: dict[str, dict[str, Placement]]

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [self.placements[name][pname]],
                                        src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))


class LoRAColwiseParallel(_LoRAStyle, ColwiseParallel):
    """Column-parallel base (W, b split by output rows): B split the same way (its rows are
    the layer's output columns), A whole on every rank. The adapter's output is then
    sharded as the base's is, and A's gradient, a partial sum per rank, is all-reduced by DTensor."""

    placements = {"": {"weight": Shard(0), "bias": Shard(0)}, "lora_a": {"weight": Replicate()},
                  "lora_b": {"weight": Shard(0)}}


class LoRARowwiseParallel(_LoRAStyle, RowwiseParallel):
    """Row-parallel base (W split by input columns, its output a partial sum): A split by
    input columns as W is, B whole; the adapter's output is a partial sum too, reduced with
    the base's in one reduce-scatter."""

    placements = {"": {"weight": Shard(1), "bias": Replicate()}, "lora_a": {"weight": Shard(1)},
                  "lora_b": {"weight": Replicate()}}


def _check_partition_hook() -> None:
    for style in (ColwiseParallel, RowwiseParallel):
        if not callable(getattr(style, "_partition_linear_fn", None)):
            raise ImportError(f"this PyTorch's {style.__name__} has no _partition_linear_fn, which LoRA under "
                              "tensor parallelism overrides (duoka.parallel.parallelize._LoRAStyle)")


_check_partition_hook()


def _colwise(layer: nn.Module) -> ColwiseParallel:
    return LoRAColwiseParallel() if isinstance(layer, LoRALinear) else ColwiseParallel()


def _rowwise(layer: nn.Module, **kwargs) -> RowwiseParallel:
    return LoRARowwiseParallel(**kwargs) if isinstance(layer, LoRALinear) else RowwiseParallel(**kwargs)


def apply_tensor_parallel(model: Qwen2, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism with sequence parallelism (Korthikanti et al.
    2022, arXiv:2205.05198) on DTensor: q/k/v and gate/up projections split by output
    columns (whole heads per rank, QKV biases with them), o and down projections by input
    rows; between them the residual stream stays sharded on the sequence, and the norms run
    on their sequence shard. The output head is split by vocabulary and its logits stay
    sharded: the loss runs under `loss_parallel` and never gathers them. LoRA adapters are
    split like their layers (LoRAColwiseParallel, LoRARowwiseParallel)."""
    # The styles re-create each parameter as a DTensor; SequenceParallel's forgets whether
    # it trains (a LoRA model's frozen norms would train): the model's choice is put back.
    trains = {name: p.requires_grad for name, p in model.named_parameters()}
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
        attention, mlp = block.attention, block.feed_forward
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            # x is the attention's only positional input; rope and mask are
            # keyword arguments, which PrepareModuleInput passes through untouched.
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": _colwise(attention.wq),
            "attention.wk": _colwise(attention.wk),
            "attention.wv": _colwise(attention.wv),
            "attention.wo": _rowwise(attention.wo, output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": _colwise(mlp.w1),
            "feed_forward.w3": _colwise(mlp.w3),
            "feed_forward.w2": _rowwise(mlp.w2, output_layouts=Shard(1)),
        })
    # Both the embedding (rowwise) and the head (colwise) shard the [vocab, dim] weight on
    # the vocabulary: the tied weight keeps one layout, so re-tying after the plan is safe.
    model.tie_weights()
    for name, param in model.named_parameters():
        param.requires_grad_(trains[name])


def check_float8(recipe: str, tp: int, device: torch.device | None = None) -> None:
    """training.float8: refuse what cannot run. The launcher asks without a device (before
    any worker starts), each worker again with its GPU."""
    if recipe == "none":
        return
    if tp > 1:
        raise DuokaError(f"training.float8={recipe} is not supported with tensor parallelism (parallel.tp={tp})",
                         "use parallel.tp=1 (FSDP2 or DDP, with pp if needed), or training.float8=none")
    if importlib.util.find_spec("torchao") is None:
        raise DuokaError(f"training.float8={recipe} needs torchao, which is not installed",
                         f"{QUANT_INSTALL}, or training.float8=none")
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise DuokaError(f"training.float8={recipe} needs float8 matmuls: compute capability 8.9 or newer (Ada, "
                         f"Hopper, Blackwell); this GPU has {major}.{minor}", "use training.float8=none")


def convert_to_float8(model: Qwen2, recipe: str, fsdp: bool) -> None:
    """training.float8: swap the decoder blocks' linear layers for torchao's Float8Linear
    (float8 matmuls in forward and backward, dynamic scales; the weights stay in their
    dtype and keep their names, so checkpoints and exports do not change). The head stays
    in bf16 (torchtitan's default too): the fused loss multiplies by its weight directly,
    without calling the module, so converting it would change only the unfused loss.
    With tensorwise scaling under FSDP2 the weights are cast to float8 before the
    all-gather, which halves its bytes; their scales are then computed for all weights at
    once after each optimizer step (see precompute_float8_scales)."""
    # torchao is an optional dependency (check_float8 says how to install it): imported
    # only when float8 is asked for.
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
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # optional dependency, as above

    precompute_float8_dynamic_scale_for_fsdp(model)


def timed_modules(model: Qwen2) -> list[nn.Module]:
    """The modules a step's compute is measured on: every block (its activation-checkpoint
    wrapper if any) and the LM head when this model holds it, the bulk of a step's compute
    (the fused loss reads the head's weight without calling it)."""
    return [*model.layers.values(), *([model.output] if model.output is not None else [])]


def parallelize_qwen2(model: Qwen2, dims: ParallelDims, mesh: DeviceMesh | None, options: ParallelOptions,
                      hooks: ModuleHooks | None = None) -> nn.Module:
    """Returns the module to train (the model itself, sharded in place, or a DDP wrapper).

    Called on the meta device for FSDP (sharding happens before any memory is taken);
    DDP needs real storage, so the caller materialises first for ddp. hooks (load
    balancing, debug slowdown) go on timed_modules(model), around FSDP2's own hooks."""
    if options.float8 != "none":  # check_float8 refused tp > 1
        convert_to_float8(model, options.float8, dims.fsdp)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    expert_mesh = dims.expert_mesh(mesh.device_type) if dims.ep > 1 else None
    experts = apply_expert_parallel(model, expert_mesh["ep"]) if expert_mesh is not None else []
    if options.activation_checkpointing:
        # The wrapper calls the block's forward, whose compiled body (ModelOptions.compile)
        # is one graph shared by all blocks: compiling the wrapper would guard on each block.
        for name, block in model.layers.items():
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    timed = timed_modules(model)
    if hooks is not None:
        hooks.before_shard(timed)

    wrapped: nn.Module = model
    if dims.fsdp:
        if experts:
            shard_experts_fsdp(experts, dims, expert_mesh, options)
        shard_fsdp(model, dims, mesh, options)
    elif dims.world_size > 1:
        device_ids = [torch.cuda.current_device()] if mesh.device_type == "cuda" else None
        # gradient_as_bucket_view: gradients live in the all-reduce buckets themselves, saving a
        # copy of every gradient into and out of the buckets each step (and that memory).
        # No initial broadcast of a QLoRA model: DDP's would dequantise and requantise its
        # NF4 weights (another base); every rank builds the same model from the same source.
        quantized = model.lora is not None and model.lora.quantized
        wrapped = DistributedDataParallel(model, device_ids=device_ids, process_group=mesh["dp_replicate"].get_group(),
                                          gradient_as_bucket_view=True, bucket_cap_mb=options.ddp_bucket_mb,
                                          init_sync=not quantized)
    if hooks is not None:
        hooks.after_shard(timed)
    return wrapped


def shard_experts_fsdp(experts: list[nn.Module], dims: ParallelDims, expert_mesh: DeviceMesh,
                       options: ParallelOptions) -> None:
    """Each MoE layer's expert-parallel experts as an FSDP2 unit of its own, over the ranks
    holding the same experts (dp_replicate x dp_shard_mod_ep), sharded on dim 1: dim 0 is
    already the ep shard. Their reduced gradients are divided by the whole data-parallel size
    like every other parameter's (duoka.parallel.expert_parallel says why)."""
    mp = MixedPrecisionPolicy(param_dtype=options.compute_dtype, reduce_dtype=torch.float32)
    dp_mesh = (expert_mesh["dp_shard_mod_ep"] if dims.dp_replicate == 1
               else expert_mesh["dp_replicate", "dp_shard_mod_ep"])
    reshard = options.reshard_after_forward and dims.pp == 1
    for module in experts:
        fully_shard(module, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard,
                    shard_placement_fn=lambda param: Shard(1))
        module.set_gradient_divide_factor(float(dims.fsdp_size))
        # gloo has no PREMUL_SUM: sum, then divide. Not on a mesh of one rank, where FSDP2
        # divides in its copy instead and a forced sum would divide twice (torch 2.13).
        if expert_mesh.device_type != "cuda" and dp_mesh.size() > 1:
            module.set_force_sum_reduction_for_comms(True)


def shard_fsdp(model: Qwen2, dims: ParallelDims, mesh: DeviceMesh, options: ParallelOptions) -> None:
    """FSDP2 over the data-parallel mesh: units of options.fsdp_blocks_per_unit blocks, then the root."""
    # bf16 parameters for compute, fp32 gradient reduction, fp32 master weights in the
    # optimizer: the usual mixed precision recipe.
    mp = MixedPrecisionPolicy(param_dtype=options.compute_dtype, reduce_dtype=torch.float32)
    # One shard dimension: plain FSDP2. Replica groups too: HSDP (with a shard size of 1
    # that is replicated weights with all-reduced gradients, DDP's semantics).
    dp_mesh = mesh["dp_shard"] if dims.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]
    # Under pipelining each micro-batch's backward would gather the weights again: keep
    # them gathered between a stage's forward and backward (torchtitan's choice).
    reshard = options.reshard_after_forward and dims.pp == 1
    blocks = list(model.layers.values())
    if options.fsdp_blocks_per_unit < 0:
        raise ValueError("fsdp_blocks_per_unit must be resolved (0 or more) before parallelizing")
    per_unit = options.fsdp_blocks_per_unit or max(1, len(blocks))
    for first in range(0, len(blocks), per_unit):
        unit = blocks[first:first + per_unit]
        # A list makes one FSDP2 unit of several blocks: one collective for all of them.
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The root holds the embedding, final norm and head; it is used last in forward and
    # first in backward, so keeping it gathered after forward saves one all-gather.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)


def unwrap(module: nn.Module) -> Qwen2:
    return module.module if isinstance(module, DistributedDataParallel) else module
