"""The training loop, run by every worker process. Explicit, top to bottom:

    set up the process group and mesh -> build the model on meta -> parallelize ->
    allocate + init (or load) -> for each step: this rank's micro-batches, the global
    target-token count, forward/backward with accumulation, clip, optimizer, metrics ->
    Hugging Face export at the checkpoint interval and at the end.

Exactness: each micro-batch's loss is its summed cross-entropy divided by the number of
target tokens in the whole global batch (all ranks, all micro-batches), times the
data-parallel size to undo the mean that DDP and FSDP take over ranks. The summed
gradient is then exactly the gradient of the mean loss over the global batch, whatever
the layout or accumulation (tests/distributed checks 1 process = DDP = FSDP2 = HSDP =
TP = PP under each schedule, and their combinations).

Under tensor parallelism the loss runs on vocabulary-sharded logits (`loss_parallel`).
Under pipeline parallelism the micro-batch loop is the schedule's: the rank's whole batch
goes to `schedule.step`, which splits it into micro-batches and calls the same loss.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.attention import SDPBackend

from duoka.config import Config
from duoka.data.dataset import PackedWindows, Prefetcher, RandomTokens, share_batches, step_inputs
from duoka.data.sft import SFTWindows
from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.hf_adapter import load_hf_weights, save_hf_state_dict
from duoka.models.qwen2.model import build_model
from duoka.models.qwen2.parallelize import float8_gathers, parallelize_qwen2, precompute_float8_scales, unwrap
from duoka.monitor.alerts import check as check_alerts
from duoka.monitor.gpu import GpuSampler, decode_clock_reasons, index_of_uuid, load_nvml
from duoka.monitor.metrics import MetricsFile, mfu, peak_flops
from duoka.monitor.sinks import PrometheusSink, TensorBoardSink
from duoka.parallel.balance import Balancer, BlockTimer, parse_rank_factors
from duoka.parallel.balance import check_config as check_balance_config
from duoka.parallel.dims import ParallelDims
from duoka.plan.memory import auto_blocks_per_unit, largest_fitting_micro_batch
from duoka.train.checkpoint import async_stager, load_checkpoint, save_checkpoint
from duoka.train.loss import IGNORE_INDEX, compiled_cross_entropy_sum, cross_entropy_sum
from duoka.train.profiling import start_profile, write_profile
from duoka.train.optim import build_optimizer, clip_to_norm, effective_lr, lr_at, plan_batch


@dataclass
class WorkerSpec:
    """Everything the launcher resolved for the workers (plain data: it is pickled to them)."""

    config: dict
    run_dir: str
    model_args: dict
    model_dir: str | None  # HF folder to load weights from, None for random init
    token_file: str | None  # cached token ids, None for random data
    tokenizer_files: list[str]
    resume_from: str | None = None  # a complete checkpoint folder
    end_of_text: int | None = None  # the id between packed documents


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of each worker process (started by the elastic launcher or in process)."""
    rank = int(os.environ.get("RANK", 0))
    # The trainer turns SIGTERM into "save and stop"; once it is done, SIGTERM must end the
    # process again (a one-process run trains inside the `duoka train` process itself).
    sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        trainer = Trainer(spec)
        trainer.train()
        if trainer.stop_requested and "TORCHELASTIC_RUN_ID" in os.environ:
            # The agent is shutting down on SIGTERM and joins its workers without releasing
            # them normally; the checkpoint is saved, so leave at once.
            dist.destroy_process_group()
            os._exit(0)
    except DuokaError as e:
        _report_error(spec.run_dir, rank, e.cause, e.fix)
        raise SystemExit(2)
    except torch.OutOfMemoryError:
        cfg = spec.config
        _report_error(spec.run_dir, rank,
                      f"CUDA out of memory on rank {rank} (micro-batch {cfg['training']['micro_batch_size']}, "
                      f"seq_len {cfg['training']['seq_len']})",
                      "lower training.micro_batch_size (or set it to auto), set training.activation_checkpointing="
                      "full, or shard with parallel.dp_mode=fsdp")
        raise SystemExit(2)
    except Exception:
        _report_error(spec.run_dir, rank, f"worker {rank} crashed:\n{traceback.format_exc()}", None)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)


def _report_error(run_dir: str, rank: int, cause: str, fix: str | None) -> None:
    """Leave the error where the launcher finds it, so the user reads one clear message
    instead of a wall of tracebacks from every rank."""
    path = Path(run_dir) / f"error-rank{rank}.json"
    with contextlib.suppress(OSError):
        path.write_text(json.dumps({"rank": rank, "cause": cause, "fix": fix}))


def document_kernel(choice: str, device: torch.device) -> str:
    """The document-masking kernel for data.document_masking_kernel on this device."""
    if choice == "auto":
        return "varlen" if device.type == "cuda" else "sdpa"
    if choice == "varlen" and device.type != "cuda":
        raise DuokaError("data.document_masking_kernel=varlen needs CUDA (flash attention) and this run is on CPU",
                         "use --data.document_masking_kernel=auto (sdpa on CPU)")
    return choice


SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}


def select_attention_kernel(choice: str, device: torch.device) -> SDPBackend | None:
    """training.attention_kernel: the one SDPA kernel this process's causal attention may
    use (None: PyTorch's own order). Only that kernel is allowed, the math fallback
    included, so a shape it cannot run fails loudly instead of running slowly.
    auto: cuDNN's attention on compute capability 9.0+, where it ran causal attention for
    every Qwen2 shape 1.3-1.9x faster than flash, gradients within bf16 rounding
    (bench/results/attention_kernels.md); elsewhere PyTorch's own order.

    The model applies the choice itself, inside its forward (Attention.sdpa_backend):
    the process-wide switches alone are not part of torch.compile's cache key, so a
    compiled block cached under another choice ran that choice's kernel (seen on H200,
    bench/NOTES.md section 16). The switches are set too, for any other SDPA call."""
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
    return SDPA_BACKENDS[choice]


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
                         "pip install torchao (a version made for this PyTorch), or training.float8=none")
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise DuokaError(f"training.float8={recipe} needs float8 matmuls: compute capability 8.9 or newer (Ada, "
                         f"Hopper, Blackwell); this GPU has {major}.{minor}", "use training.float8=none")


# What each rank contributes to the per-step all-gather (float64; NaN where not measured).
ROW_FIELDS = ("loss_sum", "tokens", "step_time", "data_time", "stop", "peak_gib", "compute_s", "samples",
              "active_gib", "alloc_retries", "ooms", "gpu_index", "gpu_util", "gpu_mem_used", "gpu_mem_total",
              "gpu_temp", "gpu_power", "gpu_sm_clock", "gpu_clock_mask", "gpu_pcie_tx", "gpu_pcie_rx", "gpu_nvlink_tx",
              "gpu_nvlink_rx", "gpu_sm_active", "gpu_sm_occupancy", "gpu_throttle_mask", "save_done")
COL = {name: i for i, name in enumerate(ROW_FIELDS)}
ALERT_WARMUP_STEPS = 3


def _gpu_reading(rank: int, row: torch.Tensor) -> dict:
    """A rank's NVML figures from its gathered row, in metrics.jsonl's `gpus` list."""
    def value(name, kind=float):
        x = float(row[COL[name]])
        return None if math.isnan(x) else kind(x)

    reasons = decode_clock_reasons(value("gpu_clock_mask", int))
    return {"rank": rank, "index": value("gpu_index", int), "utilization_pct": value("gpu_util", int),
            "memory_used_bytes": value("gpu_mem_used", int), "memory_total_bytes": value("gpu_mem_total", int),
            "temperature_c": value("gpu_temp", int), "power_w": value("gpu_power"),
            "sm_clock_mhz": value("gpu_sm_clock", int), "clock_reasons": reasons,
            "pcie_tx_bytes_per_s": value("gpu_pcie_tx"), "pcie_rx_bytes_per_s": value("gpu_pcie_rx"),
            "nvlink_tx_bytes_per_s": value("gpu_nvlink_tx"), "nvlink_rx_bytes_per_s": value("gpu_nvlink_rx"),
            "sm_active_pct": value("gpu_sm_active"), "sm_occupancy_pct": value("gpu_sm_occupancy"),
            "throttled": decode_clock_reasons(value("gpu_throttle_mask", int))}


# The data thread builds up to PREFETCH_DEPTH + 1 steps ahead of the one training. New
# balance shares therefore take effect PREFETCH_DEPTH + 2 steps after the step that decided
# them: no batch already built is ever cut by stale shares.
PREFETCH_DEPTH = 2


class Trainer:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.cfg = cfg = Config.from_dict(spec.config)
        self.run_dir = Path(spec.run_dir)
        self.args = ModelArgs(**spec.model_args)

        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            kwargs = {"device_id": self.device} if self.device.type == "cuda" else {}
            dist.init_process_group(backend, rank=self.rank, world_size=self.world, **kwargs)

        self.dims = ParallelDims.from_config(cfg.parallel, self.world)
        self.dims.check_model(self.args.n_heads, self.args.n_kv_heads, self.args.n_layers,
                              cfg.parallel.pp_stages_per_rank)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.coords = self.dims.coordinates(self.rank)
        self.dp_rank, self.dp_size = self.dims.dp_rank(self.rank), self.dims.dp_size
        # Ranks that differ only in tp or pp coordinate see the same data; one of each such
        # group counts its tokens and loss in the metrics: tp rank 0 of the last pp stage.
        self.counts_for_metrics = self.coords["tp"] == 0 and self.coords["pp"] == self.dims.pp - 1

        dtype = cfg.training.dtype
        if dtype == "auto":
            dtype = "bf16" if self.device.type == "cuda" else "fp32"
        self.compute_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32

        self.document_kernel = document_kernel(cfg.data.document_masking_kernel, self.device)
        self.sdpa_backend = select_attention_kernel(cfg.training.attention_kernel, self.device)
        check_float8(cfg.training.float8, self.dims.tp, self.device)
        self.float8_scales = float8_gathers(cfg.training.float8, self.dims.fsdp)
        self.schedule = None  # the pipeline schedule, built once the micro-batch count is known
        # The chunked head + cross-entropy needs the whole head on the rank: not under tp
        # (the vocabulary-parallel loss also never gathers the logits) nor pp (the schedule
        # owns the loss call). The banner says which loss runs.
        self.fused_loss = cfg.training.fused_loss and not self.dims.model_parallel
        # Compiling the plain loss fuses away the fp32 logits (not under tp: loss_parallel's DTensors).
        self.compile_loss = cfg.training.compile and self.dims.tp == 1
        # Load balancing measures each block's forward on this rank; debug.slow_ranks slows
        # the named ranks' blocks (fault injection for tests and demos).
        self.balance_weights = check_balance_config(cfg.parallel, cfg.debug, self.dims.model_parallel, self.dims.tp,
                                                    self.dims.pp, self.dp_size, self.world)
        self.slow_factor = parse_rank_factors(cfg.debug.slow_ranks, self.world).get(self.rank, 1.0)
        # Each rank reads its own GPU through NVML, found by UUID (NVML ignores
        # CUDA_VISIBLE_DEVICES); the readings travel in the per-step all-gather.
        self.gpu_sampler = self._gpu_sampler()
        self.active_alerts: set[str] = set()
        self.block_timer = BlockTimer(self.device, self.slow_factor, varying_batch=cfg.parallel.balance != "off") \
            if cfg.parallel.balance != "off" or self.slow_factor < 1 else None
        # The micro-batch is settled before the model is built: FSDP2's unit size follows it.
        mb = cfg.training.micro_batch_size
        if mb == "auto":
            mb = self._auto_micro_batch()
        if cfg.parallel.fsdp_blocks_per_unit == -1:
            cfg.parallel.fsdp_blocks_per_unit = auto_blocks_per_unit(
                self.args, mb, cfg.training.seq_len, self.dims.tp,
                cfg.parallel.reshard_after_forward and self.dims.pp == 1)
        self.model = self._build_pipeline() if self.dims.pp > 1 else self._build_model()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.n_params = self.args.num_params()  # what the MFU alert expects depends on the model size
        # Parameters whose gradients enter the norm: a last pipeline stage's copy of the
        # tied embedding is left out (the first stage counts it).
        tied_copy = (self.dims.pp > 1 and self.args.tie_word_embeddings and 0 not in self.stage_ids
                     and self.model.tok_embeddings is not None)
        self._norm_params = [p for p in self.params if not (tied_copy and p is self.model.tok_embeddings.weight)]

        if spec.token_file is None:
            self.data = RandomTokens(self.args.vocab_size, cfg.training.seq_len, cfg.training.seed)
        elif cfg.data.mode == "sft":
            self.data = SFTWindows(Path(spec.token_file))
        else:
            self.data = PackedWindows(Path(spec.token_file), cfg.training.seq_len)
        # The end-of-text id that separates packed documents, when attention stops at them.
        self.eot = spec.end_of_text if cfg.data.document_masking and spec.token_file is not None else None
        self.batch = plan_batch(cfg.training.global_batch_size, self.dp_size, mb)
        # FSDP2 gathers parameters in every micro-batch: equal micro-batch counts on all ranks.
        self.balancer = Balancer(cfg.parallel.balance, self.dp_size, cfg.training.global_batch_size,
                                 self.batch.micro_batch, equal_count=self.dims.fsdp, weights=self.balance_weights,
                                 window=cfg.parallel.balance_window, hysteresis=cfg.parallel.balance_hysteresis,
                                 lag=PREFETCH_DEPTH + 2)  # see PREFETCH_DEPTH
        if self.dims.pp > 1:
            self._build_schedule()

        self.peak_lr = effective_lr(cfg.optimizer, cfg.training.global_batch_size)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.peak_lr, self.device.type)
        self.peak = peak_flops(torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
                               cfg.metrics.peak_tflops)
        self.flops_per_token = self.args.flops_per_token(cfg.training.seq_len)

        self.start_step, self.tokens_seen = 0, 0
        self.pending_save = None
        self.async_group = dist.new_group(backend="gloo") if cfg.checkpoint.async_save else None
        # The per-step metrics rows travel on the host (see _gather_rank_rows).
        self.metrics_group = dist.new_group(backend="gloo")
        self.stager = async_stager(self.device) if cfg.checkpoint.async_save else None
        if spec.resume_from:
            t = time.perf_counter()
            state = load_checkpoint(Path(spec.resume_from), self.model, self.optimizer)
            self.start_step, self.tokens_seen = state["step"], state["tokens"]
            if "balance" in state and not self.balancer.load_state_dict(state["balance"]) and self.rank == 0:
                _Console().out.print("balance: the checkpoint's shares were for another data-parallel size or "
                                     "global batch; starting from equal shares")
            if self.rank == 0:
                _Console().out.print(f"loaded {spec.resume_from} in {time.perf_counter() - t:.1f} s")
        # A preempted job gets SIGTERM: finish the step, save, then stop (see train()).
        self.stop_requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _gpu_sampler(self) -> GpuSampler | None:
        if self.device.type != "cuda":
            return None
        nvml = load_nvml()
        index = index_of_uuid(nvml, str(torch.cuda.get_device_properties(self.device).uuid)) if nvml else None
        if index is None:  # monitoring only: say so once and train on
            if self.rank == 0:
                _Console().out.print("[yellow]NVML cannot read this GPU: no per-GPU readings in the metrics[/]")
            return None
        return GpuSampler(nvml, [index], self.cfg.metrics.gpu_interval_s)

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True

    # ------------------------------------------------------------------ setup

    def _with_attention_kernels(self, model):
        """The model (or pipeline stage) with this run's attention kernels: document masking's
        and the one SDPA kernel for causal attention."""
        model.attention_backend = self.document_kernel
        model.set_sdpa_backend(self.sdpa_backend)
        return model

    def _build_model(self):
        cfg = self.cfg
        model = self._with_attention_kernels(build_model(self.args))  # meta: no memory yet
        if self.dims.fsdp:
            model = parallelize_qwen2(model, self.dims, self.mesh, cfg, self.compute_dtype, self.block_timer)
            model.to_empty(device=self.device)  # each rank allocates only its shards
            self._fill(model)
            return model
        model.to_empty(device=self.device)
        model.tie_weights()
        self._fill(model)
        return parallelize_qwen2(model, self.dims, self.mesh, cfg, self.compute_dtype, self.block_timer)

    def _build_pipeline(self):
        """This rank's pipeline stages, each parallelized like a whole model (TP, AC,
        compile, FSDP2 over the data-parallel mesh), then allocated and filled; returned
        as one ModelParts for the optimizer and checkpoints."""
        # Imported here: torch.distributed.pipelining pulls in torch._dynamo (0.8 s a process).
        from duoka.models.qwen2.pipeline import ModelParts, TiedEmbeddingSync, build_stage_model, layer_counts, stage_ids

        cfg, dims = self.cfg, self.dims
        n_stages = dims.pp * cfg.parallel.pp_stages_per_rank
        if cfg.parallel.pp_layers == "measured":
            self.stage_counts = self._measured_stage_counts(n_stages)
        else:
            self.stage_counts = layer_counts(self.args, n_stages, cfg.parallel.pp_layers, cfg.training.seq_len)
        self.stage_ids = stage_ids(self.coords["pp"], dims.pp, cfg.parallel.pp_stages_per_rank)
        parts = []
        for sid in self.stage_ids:
            part = self._with_attention_kernels(build_stage_model(self.args, sid, self.stage_counts))
            part = parallelize_qwen2(part, dims, self.mesh, cfg, self.compute_dtype, self.block_timer)
            part.to_empty(device=self.device)
            self._fill(part)
            parts.append(part)
        self.pp_parts = parts
        self.tied_sync = None
        if self.args.tie_word_embeddings:
            # The first stage (pp rank 0) and the last (pp rank pp-1) hold copies of the
            # tied weight: one pair of ranks per (dp_replicate, dp_shard, tp) coordinate.
            ranks = torch.arange(self.world).view(dims.pp, -1)
            pairs = [(int(a), int(b)) for a, b in zip(ranks[0], ranks[-1])]
            self.tied_sync = TiedEmbeddingSync(pairs, self.rank)
        return ModelParts(parts)

    def _measured_stage_counts(self, n_stages: int) -> list[int]:
        """pp_layers=measured: time a block and the head on every GPU. A stage runs at the
        pace of the slowest rank holding it; when the stages' paces differ by more than 10%
        (GPUs of different speed) the layers split in inverse proportion, otherwise (timing
        noise) all stages count as the slowest and split evenly."""
        from duoka.models.qwen2.pipeline import balanced_counts, balanced_counts_uneven, measure_stage_costs

        mb = self.cfg.training.micro_batch_size
        mb = 1 if mb == "auto" else mb  # the ratio of the two costs barely depends on it
        layer, head = measure_stage_costs(self.args, mb, self.cfg.training.seq_len, self.device, self.compute_dtype)
        # debug.slow_ranks: the slowed blocks will take 1/factor as long in training too.
        mine = torch.tensor([layer, head], device=self.device, dtype=torch.float64) / self.slow_factor
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        by_pp = torch.stack(gathered).view(self.dims.pp, -1, 2).amax(dim=1)  # ranks are pp-major
        stage_layer = [float(by_pp[s % self.dims.pp, 0]) for s in range(n_stages)]  # stage s on pp rank s % pp
        head = float(by_pp[(n_stages - 1) % self.dims.pp, 1])
        if max(stage_layer) > 1.1 * min(stage_layer):
            counts = balanced_counts_uneven(self.args.n_layers, stage_layer, head)
        else:
            counts = balanced_counts(self.args.n_layers, n_stages, max(stage_layer), head)
        if self.rank == 0:
            blocks = ", ".join(f"{c * 1e3:.1f}" for c in stage_layer)
            _Console().out.print(f"pipeline stages by measured cost: a block [{blocks}] ms per stage, the head "
                                 f"{head * 1e3:.1f} ms (forward + backward) -> layers {counts}")
        return counts

    def _build_schedule(self) -> None:
        from duoka.models.qwen2.pipeline import build_schedule

        cfg = self.cfg
        n_micro = cfg.parallel.pp_microbatches or self.batch.accumulation
        if self.batch.per_rank % n_micro:
            raise DuokaError(f"parallel.pp_microbatches={n_micro} does not divide the per-rank batch of "
                             f"{self.batch.per_rank} samples",
                             f"choose a divisor of {self.batch.per_rank} (0: per-rank batch / micro_batch_size)")
        n_stages = self.dims.pp * cfg.parallel.pp_stages_per_rank
        self.schedule = build_schedule(self.pp_parts, self.stage_ids, n_stages, cfg.parallel.pp_schedule, n_micro,
                                       self._pipeline_loss, self.device, self.mesh["pp"].get_group())

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss for one micro-batch, normalised like every other layout's."""
        ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum",
                             ignore_index=IGNORE_INDEX)
        return ce * self.dp_size / self._global_tokens

    def _fill(self, model) -> None:
        if self.spec.resume_from:
            return  # every value comes from the checkpoint (DCP loading is strict about missing keys)
        if self.spec.model_dir:
            load_hf_weights(model, Path(self.spec.model_dir), allow_unused=self.dims.pp > 1)
        else:
            model.init_weights(seed=self.cfg.training.seed)

    def _auto_micro_batch(self) -> int:
        per_rank = self.cfg.training.global_batch_size // self.dp_size
        if self.cfg.training.global_batch_size % self.dp_size:
            plan_batch(self.cfg.training.global_batch_size, self.dp_size, 1)  # raises with the arithmetic
        if self.device.type != "cuda":
            return per_rank  # host memory is rarely the limit for the models a CPU can train
        free, _ = torch.cuda.mem_get_info(self.device)
        par, dims = self.cfg.parallel, self.dims
        mb = largest_fitting_micro_batch(self.args, per_rank, self.cfg.training.seq_len, dims.dp_shard,
                                         self.cfg.training.activation_checkpointing == "full",
                                         free + torch.cuda.memory_allocated(self.device),
                                         tp=dims.tp, pp=dims.pp, dp_mode=par.dp_mode, dp_replicate=dims.dp_replicate,
                                         pp_schedule=par.pp_schedule, pp_stages_per_rank=par.pp_stages_per_rank)
        # Ranks may see different free memory (another process on one GPU): agree on the smallest.
        t = torch.tensor([mb], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # ------------------------------------------------------------------ loop

    def _sync_context(self, last: bool):
        """Skip the gradient reduction on all but the last micro-batch of a step (FSDP2
        then keeps unsharded fp32 gradients in between, unless reduce_every_microbatch)."""
        if self.dims.fsdp:
            self.model.set_requires_gradient_sync(last or self.cfg.parallel.reduce_every_microbatch)
            return contextlib.nullcontext()
        if not last and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _autocast(self):
        # FSDP casts parameters itself (MixedPrecisionPolicy); DDP runs under autocast.
        if self.compute_dtype == torch.float32 or self.dims.fsdp:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _loss_context(self):
        """Cross-entropy on vocabulary-sharded logits under tensor parallelism (forward and
        backward must both run inside)."""
        return loss_parallel() if self.dims.tp > 1 else contextlib.nullcontext()

    def _summed_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed cross-entropy in fp32. A function of its own so that the bf16 logits go out
        of scope before backward: held by a caller's variable they stay alive through the
        whole backward pass (4.6 GiB for Qwen2-0.5B at micro-batch 8, seq 2048, measured)."""
        if self.fused_loss:
            with self._autocast():
                return self.model(**batch)  # the model applies the head and the loss together
        model_inputs = {k: v for k, v in batch.items() if k != "labels"}
        with self._autocast():
            logits = self.model(**model_inputs)
        if self.compile_loss:
            return compiled_cross_entropy_sum(logits, batch["labels"], varying_batch=self.balancer.mode != "off")
        return cross_entropy_sum(logits, batch["labels"])

    def _pipeline_step(self, micro: list[dict], global_tokens: torch.Tensor) -> torch.Tensor:
        """One optimizer step's forward and backward through the pipeline schedule: the
        rank's micro-batches joined into one batch, which the schedule splits again into
        pp_microbatches. Returns the summed cross-entropy (on the last stage; 0 elsewhere)."""
        batch = {k: torch.cat([m[k] for m in micro]) for k in micro[0]}
        tokens, labels = batch.pop("tokens"), batch.pop("labels")
        self._global_tokens = global_tokens
        args = (tokens,) if 0 in self.stage_ids else ()
        losses: list[torch.Tensor] = []  # the last stage's normalised micro-batch losses
        with self._loss_context():
            self.schedule.step(*args, target=labels, losses=losses, return_outputs=False, **batch)
        if self.tied_sync is not None:
            self.tied_sync(self.model.tok_embeddings.weight if self.model.tok_embeddings is not None else None)
        if not losses:
            return torch.zeros((), device=self.device)
        return sum(_local(x).detach().double() for x in losses) * global_tokens.double() / self.dp_size

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip to a global L2 norm over every parameter of the model, counted once: across
        tp and dp shards (DTensor), across pipeline stages (summed squares over the pp
        group), and the tied embedding once although two stages hold a copy."""
        grads = [p.grad for p in self._norm_params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if self.dims.pp > 1:
            squared = norm.float() ** 2
            dist.all_reduce(squared, group=self.mesh["pp"].get_group())
            norm = squared.sqrt()
        clip_to_norm(self.optimizer, self.params, norm, max_norm)
        return norm

    def train(self) -> None:
        cfg, steps = self.cfg, self.cfg.training.steps
        is_main = self.rank == 0
        if is_main:
            _truncate_metrics(self.run_dir / "metrics.jsonl", self.start_step)
        self.sinks = self._open_sinks()
        console = _Console() if is_main else None
        if console:
            console.banner(self)
        started = time.perf_counter()
        self.model.train()
        prefetch = Prefetcher(
            lambda s: [step_inputs(b, IGNORE_INDEX, self.eot, self.document_kernel == "varlen" and self.dims.pp == 1,
                                   always_positions=self.dims.model_parallel)
                       for b in share_batches(self.data, s, cfg.training.global_batch_size,
                                              *self.balancer.plan(s, self.dp_rank), cfg.training.seed)],
            self.start_step, steps, pin=self.device.type == "cuda", depth=PREFETCH_DEPTH)
        # Pipeline stages split the batch themselves and cannot split varlen offsets by
        # sample: under pp the model derives them from the document ids on the device.
        try:
            self._loop(steps, prefetch, console, started)
        finally:
            prefetch.close()
            if self.stager is not None:
                self.stager.close()
                self.stager = None  # its pinned host buffers go with it
            for sink in self.sinks:
                sink.close()
            if self.gpu_sampler is not None:
                self.gpu_sampler.close()

    def _open_sinks(self) -> list:
        """metrics.jsonl and TensorBoard on rank 0; a Prometheus endpoint on each node's
        first rank, covering that node's ranks."""
        cfg, sinks = self.cfg.metrics, []
        if self.rank == 0:
            sinks.append(MetricsFile(self.run_dir / "metrics.jsonl"))
            if cfg.tensorboard:
                sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        if cfg.prometheus_port and int(os.environ.get("LOCAL_RANK", 0)) == 0:
            first = self.rank  # local rank 0: ranks are numbered node by node
            try:
                sink = PrometheusSink(cfg.prometheus_host, cfg.prometheus_port, list(range(first, first + local_world)))
            except OSError as e:
                raise DuokaError(f"metrics.prometheus_port={cfg.prometheus_port} on {cfg.prometheus_host} cannot be "
                                 f"opened ({e})", "choose a free port, or 0 to turn the endpoint off") from None
            sinks.append(sink)
            if self.rank == 0:
                _Console().out.print(f"Prometheus metrics on http://{cfg.prometheus_host}:{sink.port}/metrics")
        return sinks

    def _loop(self, steps, prefetch, console, started) -> None:
        cfg = self.cfg
        step = self.start_step - 1
        # A step's figures (loss, grad norm, times) are read one step later, once the GPU is
        # past it: the host then never waits for the GPU between steps and launches the next
        # step while the last one runs (the GPU idled ~5 ms a step before: Qwen2-0.5B on
        # 2 x H200 +6.7%, bench/NOTES.md section 10). Load balancing and the debug slowdown
        # read their block timings at the step's end and keep the synchronous end.
        deferred = self.block_timer is None and self.balancer.mode == "off"
        pending: _StepEnd | None = None
        last_end = _Mark(self.device)
        profiler, last_profiled = None, min(steps, cfg.metrics.profile_step + cfg.metrics.profile_steps - 1)
        for step in range(self.start_step, steps):
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)  # peak_mem_gib is this step's peak
            if step + 1 == cfg.metrics.profile_step:
                profiler = start_profile(self.device)
            check = "error" if cfg.debug.check_host_syncs and step >= self.start_step + 2 else "default"
            with _sync_debug(check):
                t0 = time.perf_counter()
                host = prefetch.get(step)
                samples = sum(len(b["tokens"]) for b in host)
                micro = [{k: t.to(self.device, non_blocking=True) for k, t in b.items()} for b in host]
                t_data = time.perf_counter() - t0

                # Counted on the GPU from the copied labels: a tensor made from a count on the
                # host would be a synchronous copy, the host waiting for the previous step.
                local_tokens = sum((b["labels"] != IGNORE_INDEX).sum() for b in micro).to(torch.float64)
                global_tokens = local_tokens.clone()
                dist.all_reduce(global_tokens)  # every tp and pp rank of a replica holds the same tokens
                global_tokens = (global_tokens / (self.dims.tp * self.dims.pp)).float()
                phases = PhaseTimer(self.device)
                if self.schedule is not None:
                    with phases("pipeline"):  # forward and backward interleave inside the schedule
                        loss_sum = self._pipeline_step(micro, global_tokens)
                else:
                    loss_sum = torch.zeros((), device=self.device)
                    for i, batch in enumerate(micro):
                        if self.block_timer is not None:  # debug.slow_ranks: the untimed per-sample work
                            self.block_timer.slow_untimed(len(batch["tokens"]))
                        with self._sync_context(last=i == len(micro) - 1), self._loss_context():
                            with phases("forward"):
                                ce = self._summed_loss(batch)
                            with phases("backward"):
                                (ce * self.dp_size / global_tokens).backward()
                        loss_sum += _local(ce).detach()

                with phases("optimizer"):
                    max_norm = cfg.training.grad_clip if cfg.training.grad_clip > 0 else math.inf
                    grad_norm = self._clip_gradients(max_norm)
                    lr = lr_at(step, steps, self.peak_lr, cfg.optimizer)
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    if self.float8_scales:
                        precompute_float8_scales(self.model)
                if self.block_timer is not None:  # debug.slow_ranks: the optimizer's share
                    self.block_timer.slow_optimizer()
                # The loss, norm and token count go to host memory behind the step's work, and
                # the step's end is marked after that copy: reading them later waits for nothing
                # else (.item() would wait for every kernel queued since, the next step's too).
                scalars = _to_host(torch.stack([loss_sum.double(), grad_norm.double(), local_tokens]))
                this = _StepEnd(step + 1, last_end, _Mark(self.device), phases, scalars, lr,
                                t_data, samples, self._memory_row(), time.perf_counter() - t0)
                last_end = this.end
                profiled = profiler is not None and step + 1 == last_profiled
                if not deferred or profiled:
                    with _sync_debug("default"):
                        this.end.wait()  # the trace must hold every kernel of the profiled steps
            if profiled:
                write_profile(profiler, self.run_dir / "profile", self.rank, self.device)
                last_end = _Mark(self.device)  # writing the trace is no part of the next step

            ready, pending = (pending, this) if deferred else (this, None)
            with _sync_debug(check):
                stop = ready is not None and self._finish_step(ready, console, started, steps)
            interval = cfg.checkpoint.interval
            save_now = interval and (step + 1) % interval == 0 and step + 1 != steps
            if (stop or save_now) and pending is not None:
                # A checkpoint holds the tokens seen so far, and metrics.jsonl must not lack a
                # step that a resume would skip: finish the step being saved first.
                stop = self._finish_step(pending, console, started, steps) or stop
                pending = None
            if stop:
                self.checkpoint(step + 1)
                self._finish_pending_save()
                if self.rank == 0:
                    (self.run_dir / "STOPPED").write_text(str(step + 1))
                if console:
                    console.out.print(f"[bold yellow]stopped by SIGTERM after step {step + 1}[/]; continue with "
                                      f"--checkpoint.resume=auto --job.output_dir={self.run_dir}")
                return
            if save_now:
                self.checkpoint(step + 1)
                last_end = _Mark(self.device)  # the next step's time leaves the save out
        if pending is not None:
            self._finish_step(pending, console, started, steps)  # a stop asked for now ends the run anyway
        if step + 1 > self.start_step or not (self.run_dir / "checkpoints" / f"step-{steps}").exists():
            self.checkpoint(steps)
        self._finish_pending_save()
        final = self.export(steps) if cfg.checkpoint.export_final else None
        if console:
            console.done(self.run_dir, final, time.perf_counter() - started)

    def _memory_row(self) -> dict:
        """The step's allocator figures, read when its work is launched (the allocator counts
        on the host, so they are already final) and before the next step resets the peak."""
        if self.device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self.device)
        return {"peak_gib": torch.cuda.max_memory_allocated(self.device) / 2**30,
                "active_gib": torch.cuda.memory_allocated(self.device) / 2**30,
                "alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0)}

    def _finish_step(self, done: _StepEnd, console, started: float, steps: int) -> bool:
        """Everything that needs a step's results, once the GPU is past it: the per-rank rows,
        the metrics record and its sinks, the console line, a background save's completion.
        Returns whether a rank was asked to stop (SIGTERM), which every rank then sees."""
        cfg = self.cfg
        t = time.perf_counter()
        with _sync_debug("default"):  # the one wait a deferred step end makes
            step_time = done.end.seconds_since(done.start)
        waited = time.perf_counter() - t
        # One small all-gather per step carries every rank's figures for the metrics line
        # and whether any rank was asked to stop, so all stop at the same step.
        per_rank = self._gather_rank_rows(done, step_time)
        self.tokens_seen += int(per_rank[:, COL["tokens"]].sum())
        record = self._record(done.step, per_rank, self.tokens_seen, done.lr, float(done.scalars[1]))
        # Rank 0's phases; the rest of the step is exposed communication and host gaps.
        record["phase_s"] = dict(done.phases.seconds(), data=done.data_time)
        # The host's side, rank 0: launching the step's work, and waiting for the GPU to finish
        # it once the next step is launched. A wait near zero means the GPU waits for the host.
        record["host_s"] = {"launch": done.launch_s, "wait": waited}
        if self.block_timer is not None:
            self.block_timer.account_step(record["phase_s"].get("forward", 0.0),
                                          record["phase_s"].get("optimizer", 0.0), done.samples)
        record["phase_s"]["other"] = max(0.0, step_time - sum(record["phase_s"].values()))
        if self.balancer.mode != "off":
            record["balance"] = self._balance_step(done.step - 1, per_rank, console)
        if cfg.metrics.alerts:
            record["alerts"] = self._alerts(record, console)
        for sink in self.sinks:
            sink.write(record)
        if console and (done.step % cfg.metrics.log_interval == 0 or done.step == steps
                        or done.step == self.start_step + 1):
            console.progress(record, steps, time.perf_counter() - started, self.start_step)
        # Finish a background save only when every rank's write is done: each rank's own
        # poll could differ, and one rank alone entering the barrier in
        # _saved_in_background would meet the others' next collectives (a hang seen in CI).
        if self.pending_save is not None and per_rank[:, COL["save_done"]].min() > 0:
            with _sync_debug("default"):
                self.pending_save.poll(wait=True)
                self._saved_in_background()
        return bool(per_rank[:, COL["stop"]].max() > 0)

    def _balance_step(self, step: int, per_rank: torch.Tensor, console) -> dict:
        """Feed the balancer the step's gathered block times and sample counts (one row per
        rank; a data-parallel rank's figure is its first rank's, which are all of them
        without tp or pp); log a change of shares. Returns the metrics.jsonl `balance` entry."""
        seconds = [float(r[COL["compute_s"]]) for r in per_rank]
        samples = [int(r[COL["samples"]]) for r in per_rank]
        shares = self.balancer.shares_for(step)
        message = self.balancer.observe(step, seconds, samples)
        if message and console:
            console.out.print(message)
        return {"mode": self.balancer.mode, "shares": shares, "next_shares": self.balancer.shares_for(step + 1),
                "compute_s": seconds,
                "speed": [n / t if t > 0 else None for n, t in zip(samples, seconds)]}

    def _gather_rank_rows(self, done: _StepEnd, step_time: float) -> torch.Tensor:
        """Every rank's ROW_FIELDS for the step, [world, len(ROW_FIELDS)] on the host. The
        gather runs on a gloo group: on the host, so it never queues behind the GPU's work."""
        counted = self.counts_for_metrics
        row = dict.fromkeys(ROW_FIELDS, math.nan)
        row.update(loss_sum=float(done.scalars[0]) if counted else 0.0, tokens=float(done.scalars[2]) if counted else 0,
                   step_time=step_time, data_time=done.data_time, stop=float(self.stop_requested),
                   compute_s=self.block_timer.step_seconds() if self.block_timer is not None else 0.0,
                   samples=done.samples, **done.memory,
                   save_done=float(self.pending_save is not None and self.pending_save.future.done()))
        if self.gpu_sampler is not None:
            g = self.gpu_sampler.latest()[0]
            row.update({f"gpu_{k}": float(v) for k, v in (
                ("index", g.index), ("util", g.utilization_pct), ("mem_used", g.memory_used_bytes),
                ("mem_total", g.memory_total_bytes), ("temp", g.temperature_c), ("power", g.power_w),
                ("sm_clock", g.sm_clock_mhz), ("clock_mask", g.clock_mask), ("pcie_tx", g.pcie_tx_bytes_per_s),
                ("pcie_rx", g.pcie_rx_bytes_per_s), ("nvlink_tx", g.nvlink_tx_bytes_per_s),
                ("nvlink_rx", g.nvlink_rx_bytes_per_s), ("sm_active", g.sm_active_pct),
                ("sm_occupancy", g.sm_occupancy_pct), ("throttle_mask", g.throttle_mask)) if v is not None})
        mine = torch.tensor([row[k] for k in ROW_FIELDS], dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine, group=self.metrics_group)
        return torch.stack(gathered)

    def _record(self, step: int, per_rank: torch.Tensor, tokens_seen: int, lr: float, grad_norm: float) -> dict:
        """The metrics.jsonl line (design.md's contract) from the gathered per-rank rows."""
        col = {k: per_rank[:, i] for k, i in COL.items()}
        slowest = float(col["step_time"].max())  # a synchronous step takes as long as its slowest rank
        tps = float(col["tokens"].sum()) / slowest
        rank_loss = [float(loss / n) if n > 0 else None for loss, n in zip(col["loss_sum"], col["tokens"])]
        record = {
            "step": step,
            "loss": float(col["loss_sum"].sum() / col["tokens"].sum()),
            "loss_max_rank": max((x for x in rank_loss if x is not None), default=None),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens_seen,
            "tokens_per_s": tps,
            "tokens_per_s_per_gpu": tps / self.world,
            "mfu": mfu(self.flops_per_token, tps, self.world, self.peak),
            "step_time_s": slowest,
            "data_time_s": float(col["data_time"].max()),
            "per_rank": {
                "loss": rank_loss,
                "step_time_s": [float(x) for x in col["step_time"]],
                "data_time_s": [float(x) for x in col["data_time"]],
            },
        }
        if self.device.type == "cuda":  # the largest over ranks (pipeline stages differ)
            record["peak_mem_gib"] = float(col["peak_gib"].max())
            for key, name in (("peak_mem_gib", "peak_gib"), ("active_mem_gib", "active_gib"),
                              ("alloc_retries", "alloc_retries"), ("ooms", "ooms")):
                record["per_rank"][key] = [float(x) for x in col[name]]
        if not math.isnan(float(col["gpu_index"][0])):
            record["gpus"] = [_gpu_reading(rank, per_rank[rank]) for rank in range(self.world)]
        return record

    def _alerts(self, record: dict, console) -> list[dict]:
        """The step's alerts; each is logged once when it starts, not on every step it lasts.
        The first steps of a process compile, fill the data queue and warm the allocator:
        no alerts from them."""
        if record["step"] <= self.start_step + ALERT_WARMUP_STEPS:
            return []
        found = check_alerts(record, self.n_params)
        kinds = {a.kind for a in found}
        if console:
            for a in found:
                if a.kind not in self.active_alerts:
                    console.out.print(f"[bold yellow]alert ({a.kind})[/]: {a.message}")
        self.active_alerts = kinds
        return [a.to_dict() for a in found]

    def _finish_pending_save(self) -> None:
        if self.pending_save is not None:
            self.pending_save.poll(wait=True)
            self._saved_in_background()

    def _saved_in_background(self) -> None:
        if self.rank == 0:
            _Console().out.print(f"checkpoint step-{self.pending_save.step} written in the background: training "
                                 f"blocked {self.pending_save.blocked_s:.2f} s")
        self.pending_save = None
        dist.barrier()

    def checkpoint(self, step: int) -> None:
        if not self.cfg.checkpoint.enabled:
            return
        t = time.perf_counter()
        self._finish_pending_save()  # one save in flight at a time (waiting for it blocks training too)
        train_state = {"tokens": self.tokens_seen, "model_args": self.spec.model_args, "config": self.spec.config,
                       "dp_size": self.dp_size, "world_size": self.world, "balance": self.balancer.state_dict()}
        result = save_checkpoint(self.run_dir, step, self.model, self.optimizer, train_state,
                                 self.spec.tokenizer_files, self.cfg.checkpoint.keep, self.async_group,
                                 self.cfg.checkpoint.write_threads, self.stager)
        if self.async_group is not None:
            # Blocked: waiting for the previous save, then the copy to host memory.
            result.step, result.blocked_s = step, time.perf_counter() - t
            self.pending_save = result
        elif self.rank == 0:
            _Console().out.print(f"checkpoint step-{step} written: training blocked {time.perf_counter() - t:.2f} s")

    # ------------------------------------------------------------------ export

    def export(self, step: int) -> Path:
        """Model weights in Hugging Face format under hf/step-N (all ranks gather, rank 0
        writes)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        out = self.run_dir / "hf" / f"step-{step}"
        if self.dims.pp > 1:
            # No rank holds every stage: rank 0 converts the final checkpoint (all stages'
            # files) into a Hugging Face folder, in one process.
            checkpoint = self.run_dir / "checkpoints" / f"step-{step}"
            if not checkpoint.is_dir():
                raise DuokaError("under pipeline parallelism the final Hugging Face export is made from the final "
                                 "checkpoint, and checkpoint.enabled=false",
                                 "enable checkpoints, or set checkpoint.export_final=false and run duoka export")
            if self.rank == 0:
                from duoka.train.export import export_checkpoint

                export_checkpoint(checkpoint, out, dtype="float32", no_dist=True)
            dist.barrier()
            return out
        model = unwrap(self.model)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            state = {_clean_name(k): v for k, v in state.items()}
            if self.args.tie_word_embeddings:
                state.setdefault("output.weight", state["tok_embeddings.weight"])
            save_hf_state_dict(state, self.args, out, extra_files=[Path(f) for f in self.spec.tokenizer_files])
        dist.barrier()
        return out


@contextlib.contextmanager
def _sync_debug(mode: str):
    """PyTorch's sync debug mode for the enclosed code, the previous mode restored after:
    "error" (debug.check_host_syncs) raises at an operation that makes the host wait for
    the GPU; "default" lets pass a wait that is meant (a step's end event, a background
    save's completion). Nothing on a machine without CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy into pinned host memory (a plain tensor on CPU)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class _Mark:
    """A point in the step's timeline: a CUDA event on the compute stream (GPU time, read
    later without stopping the host), or the wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.time = time.perf_counter()

    def wait(self) -> None:
        if self.cuda:
            self.event.synchronize()

    def seconds_since(self, earlier: _Mark) -> float:
        if not self.cuda:
            return self.time - earlier.time
        self.event.synchronize()
        return earlier.event.elapsed_time(self.event) / 1000


@dataclass
class _StepEnd:
    """What a step leaves for its metrics, read once the GPU has finished it."""
    step: int  # 1-based, as in metrics.jsonl
    start: _Mark  # the previous step's end: the step's time includes any gap before it
    end: _Mark
    phases: PhaseTimer
    scalars: torch.Tensor  # [summed loss, gradient norm, tokens] in (pinned) host memory, valid once `end` is
    lr: float
    data_time: float
    samples: int
    memory: dict
    launch_s: float  # host time from the step's start to its last launch


class PhaseTimer:
    """Time spent in each phase of a step: GPU time between CUDA events recorded on the
    compute stream (read once the GPU has finished the step, so timing adds no sync), or
    wall clock on CPU. A phase's interval includes waiting for communication it depends on
    (FSDP2's all-gathers in forward, the last gradient reduction in backward)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.intervals: list[tuple[str, _Mark, _Mark]] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = _Mark(self.device)
        with torch.profiler.record_function(f"duoka.{name}"):  # names the phase in a profiled step's trace
            yield
        self.intervals.append((name, start, _Mark(self.device)))

    def seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, start, end in self.intervals:
            out[name] = out.get(name, 0.0) + end.seconds_since(start)
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's value (the loss under loss_parallel is replicated) or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop records past the checkpoint (a run that died after logging steps it
    never saved): metrics.jsonl then holds each step once, as if never interrupted."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["step"] <= last_step]
    if len(kept) != len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)


def _clean_name(name: str) -> str:
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(wrapper, "")
    return name


class _Console:
    """Rank 0's progress lines on stderr (rich), so stdout stays free for results."""

    def __init__(self):
        from rich.console import Console

        self.out = Console(stderr=True, highlight=False, soft_wrap=True)

    def banner(self, t: Trainer) -> None:
        b = t.batch
        self.out.print(
            f"[bold]duoka train[/] {t.args.num_params() / 1e6:.1f}M parameters | {t.dims.describe()} on "
            f"{t.world} x {t.device.type} | {str(t.compute_dtype).removeprefix('torch.')}"
            + (f" + float8 {t.cfg.training.float8} matmuls" if t.cfg.training.float8 != "none" else "")
            + " | global batch "
            f"{b.global_batch} = micro-batch {b.micro_batch} x accumulation {b.accumulation} x dp {b.dp_size} | "
            f"seq {t.cfg.training.seq_len} | peak lr {t.peak_lr:.3g}"
            + (" | fused chunked loss" if t.fused_loss else
               " | vocabulary-parallel loss" if t.dims.tp > 1 else "")
            + (f" | resumed at step {t.start_step} from {t.spec.resume_from}" if t.spec.resume_from else ""))

    def progress(self, r: dict, steps: int, elapsed: float, start_step: int = 0) -> None:
        eta = elapsed / max(1, r["step"] - start_step) * (steps - r["step"])
        mfu_text = f" | MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
        self.out.print(f"step {r['step']:>5}/{steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
                       f"{r['tokens_per_s']:,.0f} tok/s{mfu_text} | {r['step_time_s']:.2f} s/step | "
                       f"ETA {_duration(eta)}")

    def done(self, run_dir: Path, final: Path | None, elapsed: float) -> None:
        self.out.print(f"[bold green]done[/] in {_duration(elapsed)}. Run directory: {run_dir}")
        if final is not None:
            self.out.print(f"Try it:  duoka generate --model {final} --prompt \"Return the\"")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
