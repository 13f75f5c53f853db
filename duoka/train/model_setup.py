"""The model a worker trains: its kernels for this device, its parallel layout, its weights.

Built on the meta device with every option given at construction (ModelOptions), then
parallelized (parallelize_qwen2), allocated and filled: from the Hugging Face weights, by
the layout-independent init, or left for the checkpoint to fill on resume. Under pipeline
parallelism the rank's stages are built the same way and run by a schedule (Pipeline).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from duoka.errors import DuokaError
from duoka.models.lora import LoRAArgs, cast_frozen_
from duoka.models.qwen2.args import ModelArgs, ModelOptions
from duoka.models.qwen2.hf_adapter import load_hf_weights
from duoka.models.qwen2.model import build_model
from duoka.models.qwen2.stages import balanced_counts, balanced_counts_uneven, stage_ids
from duoka.parallel.dims import ParallelDims
from duoka.parallel.dtensor import full_value
from duoka.parallel.parallelize import ModuleHooks, ParallelOptions, parallelize_qwen2
from duoka.parallel.pipeline import (
    ModelParts,
    TiedEmbeddingSync,
    build_schedule,
    build_stage_model,
    measure_stage_costs,
)
from duoka.plan.memory import largest_fitting_micro_batch
from duoka.plan.optimizer_costs import optimizer_from_config
from duoka.train.batch_plan import plan_batch

# pp_layers=measured: stage paces within this ratio count as timing noise, and the layers split evenly.
MEASURED_PACE_NOISE = 1.1


def document_kernel(choice: str, device: torch.device) -> str:
    """The document-masking kernel for data.document_masking_kernel on this device."""
    if choice == "auto":
        return "varlen" if device.type == "cuda" else "sdpa"
    if choice == "varlen" and device.type != "cuda":
        raise DuokaError("data.document_masking_kernel=varlen needs CUDA (flash attention) and this run is on CPU",
                         "use --data.document_masking_kernel=auto (sdpa on CPU)")
    return choice


def attention_kernel(choice: str, device: torch.device) -> str | None:
    """training.attention_kernel: the one SDPA kernel causal attention may use (None:
    PyTorch's own order). Only that kernel is allowed, the math fallback included, so a
    shape it cannot run fails loudly instead of running slowly. auto: cuDNN on compute
    capability 9.0+, where it ran every Qwen2 shape fastest (bench/results/attention_kernels.md).

    The model applies the choice inside its forward (ModelOptions.sdpa_backend), because
    torch.compile keys its cache on that, not on the process-wide switches; the switches
    are set too, for any other SDPA call."""
    if choice == "auto":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
            return None
        choice = "cudnn"
    if device.type != "cuda":
        raise DuokaError(f"training.attention_kernel={choice} selects a GPU kernel and this run is on CPU",
                         "use --training.attention_kernel=auto")
    torch.backends.cuda.enable_flash_sdp(choice == "flash")
    torch.backends.cuda.enable_cudnn_sdp(choice == "cudnn")
    torch.backends.cuda.enable_mem_efficient_sdp(choice == "efficient")
    torch.backends.cuda.enable_math_sdp(False)
    return choice


def model_options(cfg, dims: ParallelDims, device: torch.device, compile: bool) -> ModelOptions:
    """The model's kernels for this device; `compile`: training.compile as resolved and
    checked (duoka.train.compile_check)."""
    compile_mode = "none"
    if compile:
        # Tensor parallelism's input/output hooks must stay outside the compiled region:
        # a whole compiled block gave wrong gradients; its attention and MLP bodies are exact.
        compile_mode = "parts" if dims.tp > 1 else "block"
    return ModelOptions(document_masking=document_kernel(cfg.data.document_masking_kernel, device),
                        sdpa_backend=attention_kernel(cfg.training.attention_kernel, device),
                        fuse_qkv=cfg.training.fuse_qkv, compile=compile_mode,
                        # The fused loss's softmax too (not under tp: its logits are DTensors).
                        compile_loss=compile and dims.tp == 1)


def auto_micro_batch(cfg, dims: ParallelDims, args: ModelArgs, device: torch.device) -> int:
    """training.micro_batch_size=auto: the largest divisor of the per-rank batch that the
    memory model fits in this GPU's free memory, the smallest over ranks (another process
    may hold memory on one GPU). The whole per-rank batch on CPU."""
    global_batch = cfg.training.global_batch_size
    if global_batch % dims.dp_size:
        plan_batch(global_batch, dims.dp_size, 1)  # raises with the arithmetic
    per_rank = global_batch // dims.dp_size
    if device.type != "cuda":
        return per_rank  # host memory is rarely the limit for the models a CPU can train
    free, _ = torch.cuda.mem_get_info(device)
    par = cfg.parallel
    mb = largest_fitting_micro_batch(args, per_rank, cfg.training.seq_len, dims.dp_shard,
                                     cfg.training.activation_checkpointing == "full",
                                     free + torch.cuda.memory_allocated(device), tp=dims.tp, pp=dims.pp,
                                     dp_mode=par.dp_mode, dp_replicate=dims.dp_replicate,
                                     pp_schedule=par.pp_schedule, pp_stages_per_rank=par.pp_stages_per_rank,
                                     optimizer=optimizer_from_config(cfg.optimizer), ep=dims.ep, cp=dims.cp,
                                     cp_method=dims.context_method(args.n_heads),
                                     fused_loss=cfg.training.fused_loss and not dims.model_parallel)
    t = torch.tensor([mb], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class Filler:
    """Fills an allocated model (or stage): Hugging Face weights, the seeded init, or
    nothing on resume (every value comes from the checkpoint; DCP is strict about missing keys).
    A LoRA model's frozen base is not in its checkpoints: it is filled on resume too, and
    its adapters start from their own init when the base comes from a folder."""

    def __init__(self, model_dir: str | None, seed: int, resuming: bool, partial: bool, check_weights: bool = True):
        self.model_dir, self.seed, self.resuming, self.partial = model_dir, seed, resuming, partial
        self.check_weights = check_weights

    def __call__(self, model) -> None:
        lora = getattr(model, "lora", None) is not None
        if self.resuming and not lora:
            return
        if self.model_dir:
            load_hf_weights(model, Path(self.model_dir), allow_unused=self.partial, check_weights=self.check_weights)
            if lora and not self.resuming:
                model.init_weights(seed=self.seed, adapters_only=True)
        else:
            model.init_weights(seed=self.seed)


def build_training_model(args: ModelArgs, options: ModelOptions, par: ParallelOptions, dims: ParallelDims, mesh,
                         device: torch.device, fill: Filler, hooks: ModuleHooks | None, lora: LoRAArgs | None = None):
    """The whole model, parallelized. FSDP2 shards on the meta device, so each rank
    allocates only its shards; DDP needs real storage before it wraps the model. With
    LoRA the frozen base is held in the compute dtype from the start (no fp32 copy).
    Under QLoRA the base is filled whole and quantized (its NF4 scales span each whole
    tensor, so every layout holds the same values), then sharded or wrapped: while it
    loads, each rank holds the base whole in the compute dtype, released layer by layer
    as it is quantized."""
    model = build_model(args, options, lora=lora)
    if lora is not None:
        cast_frozen_(model, par.compute_dtype)
    if dims.fsdp and not (lora is not None and lora.quantized):
        model = parallelize_qwen2(model, dims, mesh, par, hooks)
        model.to_empty(device=device)
        fill(model)
        return model
    model.to_empty(device=device)
    model.tie_weights()
    fill(model)
    if lora is not None and lora.quantized:
        model.quantize_base_()
    return parallelize_qwen2(model, dims, mesh, par, hooks)


class Pipeline:
    """This rank's pipeline stages, each parallelized like a whole model, and the schedule
    that runs a step's micro-batches through them. `model` names all stages as one module
    (ModelParts) for the optimizer and checkpoints."""

    def __init__(self, cfg, args: ModelArgs, options: ModelOptions, par: ParallelOptions, dims: ParallelDims, mesh,
                 rank: int, world: int, device: torch.device, fill: Filler, hooks: ModuleHooks | None,
                 stage_layers: tuple[int, ...] | None, slow_factor: float, console):
        self.device = device
        n_stages = dims.pp * cfg.parallel.pp_stages_per_rank
        if stage_layers is None:  # pp_layers=measured
            stage_layers = measured_stage_layers(cfg, args, dims, world, device, par.compute_dtype, n_stages,
                                                 slow_factor, console)
        self.stage_ids = stage_ids(dims.coordinates(rank)["pp"], dims.pp, cfg.parallel.pp_stages_per_rank)
        self.n_stages, self.schedule_name, self.pp_group = n_stages, cfg.parallel.pp_schedule, mesh["pp"].get_group()
        parts = []
        for sid in self.stage_ids:
            part = parallelize_qwen2(build_stage_model(args, options, sid, list(stage_layers)), dims, mesh, par, hooks)
            part.to_empty(device=device)
            fill(part)
            parts.append(part)
        self.parts = parts
        self.model = ModelParts(parts)
        self.tied_sync = None
        if args.tie_word_embeddings:
            # The first stage (pp rank 0) and the last (pp rank pp-1) hold copies of the
            # tied weight: one pair of ranks per (dp_replicate, dp_shard, tp) coordinate.
            ranks = torch.arange(world).view(dims.pp, -1)
            self.tied_sync = TiedEmbeddingSync([(int(a), int(b)) for a, b in zip(ranks[0], ranks[-1])], rank)
        self.schedule = None

    @property
    def holds_tied_copy(self) -> bool:
        """A later stage's copy of the tied embedding (the first stage counts it in the norm)."""
        return self.tied_sync is not None and 0 not in self.stage_ids and self.model.tok_embeddings is not None

    def build_schedule(self, n_microbatches: int, loss_fn) -> None:
        self.schedule = build_schedule(self.parts, self.stage_ids, self.n_stages, self.schedule_name, n_microbatches,
                                       loss_fn, self.device, self.pp_group)

    def step(self, micro: list[dict], loss_context) -> torch.Tensor:
        """One optimizer step's forward and backward: the rank's micro-batches joined into
        one batch, which the schedule splits again. Returns the sum of the last stage's
        normalised micro-batch losses (0 on other stages)."""
        batch = {k: torch.cat([m[k] for m in micro]) for k in micro[0]}
        tokens, labels = batch.pop("tokens"), batch.pop("labels")
        args = (tokens,) if 0 in self.stage_ids else ()
        losses: list[torch.Tensor] = []
        with loss_context():
            self.schedule.step(*args, target=labels, losses=losses, return_outputs=False, **batch)
        if self.tied_sync is not None:
            self.tied_sync(self.model.tok_embeddings.weight if self.model.tok_embeddings is not None else None)
        if not losses:
            return torch.zeros((), device=self.device)
        return sum(full_value(x).detach().double() for x in losses)


def measured_stage_layers(cfg, args: ModelArgs, dims: ParallelDims, world: int, device: torch.device,
                          dtype: torch.dtype, n_stages: int, slow_factor: float, console) -> tuple[int, ...]:
    """pp_layers=measured: time a block and the head on every GPU. A stage runs at the pace
    of the slowest rank holding it; paces that differ beyond MEASURED_PACE_NOISE (GPUs of
    different speed) split the layers in inverse proportion, otherwise evenly."""
    mb = cfg.training.micro_batch_size
    mb = 1 if mb == "auto" else mb  # the ratio of the two costs barely depends on it
    layer, head = measure_stage_costs(args, mb, cfg.training.seq_len, device, dtype)
    # debug.slow_ranks: the slowed blocks will take 1/factor as long in training too.
    mine = torch.tensor([layer, head], device=device, dtype=torch.float64) / slow_factor
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    by_pp = torch.stack(gathered).view(dims.pp, -1, 2).amax(dim=1)  # ranks are pp-major
    stage_layer = [float(by_pp[s % dims.pp, 0]) for s in range(n_stages)]  # stage s on pp rank s % pp
    head = float(by_pp[(n_stages - 1) % dims.pp, 1])
    if max(stage_layer) > MEASURED_PACE_NOISE * min(stage_layer):
        counts = balanced_counts_uneven(args.n_layers, stage_layer, head)
    else:
        counts = balanced_counts(args.n_layers, n_stages, max(stage_layer), head)
    blocks = ", ".join(f"{c * 1e3:.1f}" for c in stage_layer)
    console.print(f"pipeline stages by measured cost: a block [{blocks}] ms per stage, the head "
                  f"{head * 1e3:.1f} ms (forward + backward) -> layers {counts}")
    return tuple(counts)
