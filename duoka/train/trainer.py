"""The training loop, run by every worker process: a short loop over components.

    model (model_setup) -> data -> for each step: this rank's micro-batches (LoadBalancing's
    share), the global target-token count, forward/backward with accumulation (or the
    pipeline schedule), clip, optimizer -> at the step's end: figures gathered and published
    (StepMetrics), shares updated (LoadBalancing), checkpoints (Checkpointer) -> export.

Exactness: each micro-batch's loss is its summed cross-entropy divided by the number of
target tokens in the whole global batch (all ranks, all micro-batches), times the
data-parallel size to undo the mean that DDP and FSDP take over ranks. The summed gradient
is then exactly the gradient of the mean loss over the global batch, whatever the layout or
accumulation (tests/distributed checks 1 process = DDP = FSDP2 = HSDP = TP = PP under each
schedule, and their combinations). Under tensor parallelism the loss runs on
vocabulary-sharded logits (`loss_parallel`).

A mixture-of-experts model whose config asks for the router's load-balancing loss adds it
per micro-batch as transformers defines it (over one forward's tokens), weighted by the
micro-batch's target tokens (in its fused loss, or returned with the logits): the step's
loss is the mean cross-entropy plus router_aux_loss_coef x the token-weighted mean of the
micro-batches' balancing losses. Unlike the cross-entropy, that term depends on how the
batch is cut into micro-batches.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from duoka.cache import INDUCTOR_CACHE_ENV
from duoka.data.dataset import PackedWindows, Prefetcher, RandomTokens, share_batches, step_inputs
from duoka.data.sft import SFTWindows
from duoka.host.devices import compute_dtype_name
from duoka.models.lora import trainable_numel
from duoka.models.loss import IGNORE_INDEX, compiled_cross_entropy_sum, cross_entropy_sum
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.context_parallel import ContextGroup, shard_sequence
from duoka.monitor.mfu import peak_flops
from duoka.parallel.dims import ParallelDims
from duoka.parallel.dtensor import full_value, total_norm
from duoka.parallel.parallelize import (ParallelOptions, check_float8, float8_gathers, precompute_float8_scales,
                                        unwrap)
from duoka.plan.memory import auto_blocks_per_unit
from duoka.timing import Mark, PhaseTimer
from duoka.train.adapters import lora_args
from duoka.train.batch_plan import pipeline_microbatches, plan_batch
from duoka.train.checkpointer import Checkpointer
from duoka.train.compile_check import agree_to_compile, check_compile, check_stamp, compile_wanted, failing_ranks
from duoka.train.console import console_for
from duoka.train.export import export_trained
from duoka.train.health import Health
from duoka.train.load_balance import LoadBalancing
from duoka.train.lr_schedule import effective_lr, lr_at
from duoka.train.model_setup import Filler, Pipeline, auto_micro_batch, build_training_model, model_options
from duoka.train.optimizers import build_optimizer, clip_to_norm
from duoka.train.profiling import StepProfiler
from duoka.train.run_files import STOPPED_MARKER
from duoka.train.spec import RunSpec
from duoka.train.step_end import StepEnd, sync_debug, to_host
from duoka.train.step_metrics import RankFigures, StepMetrics, memory_figures
from duoka.train.watchdog import Watchdog

# The data thread builds up to PREFETCH_DEPTH + 1 steps ahead of the one training. New
# balance shares therefore take effect PREFETCH_DEPTH + 2 steps after the step that decided
# them: no batch already built is ever cut by stale shares.
PREFETCH_DEPTH = 2


class Trainer:
    def __init__(self, spec: RunSpec, device: torch.device, stop):
        self.spec, self.cfg, self.device, self.stop = spec, spec.cfg, device, stop
        cfg = self.cfg
        self.run_dir = Path(spec.run_dir)
        self.args = ModelArgs(**spec.model_args)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.console = console_for(self.rank)

        self.dims = dims = ParallelDims.from_config(cfg.parallel, self.world)
        self.mesh = dims.build_mesh(device.type)
        coords = dims.coordinates(self.rank)
        self.dp_rank, self.dp_size = dims.dp_rank(self.rank), dims.dp_size
        # Context parallelism: this rank's cp group, which splits each sequence of its batch.
        self.context = (ContextGroup(dims.context_mesh(device.type)["cp"].get_group(), dims.cp, dims.cp_rank(self.rank),
                                     dims.context_method(self.args.n_heads))
                        if dims.cp > 1 else None)
        # Ranks that differ only in tp or pp coordinate see the same data; one of each such
        # group counts its tokens and loss in the metrics: tp rank 0 of the last pp stage.
        self.counts_for_metrics = coords["tp"] == 0 and coords["pp"] == dims.pp - 1
        self.compute_dtype = getattr(torch, compute_dtype_name(cfg.training.dtype, device.type))
        check_float8(cfg.training.float8, dims.tp, device)
        self.lora = lora_args(cfg)  # LoRA adapters on a frozen base, or None (duoka.train.adapters)
        # The chunked head + cross-entropy needs the whole head on the rank: not under tp
        # (the vocabulary-parallel loss never gathers the logits) nor pp (the schedule owns the loss).
        self.fused_loss = cfg.training.fused_loss and not dims.model_parallel
        self.router_aux = self.args.router_aux_loss  # a MoE model's load-balancing loss, added per micro-batch

        # The micro-batch is settled before the model is built: FSDP2's unit size follows it.
        micro_batch = spec.micro_batch or auto_micro_batch(cfg, dims, self.args, device)
        units = spec.fsdp_blocks_per_unit
        if units is None:
            units = auto_blocks_per_unit(self.args, micro_batch, cfg.training.seq_len, dims.tp,
                                         cfg.parallel.reshard_after_forward and dims.pp == 1)
        self.batch = plan_batch(cfg.training.global_batch_size, self.dp_size, micro_batch)
        self.balance = LoadBalancing(cfg, dims, self.rank, self.world, device, cfg.training.global_batch_size,
                                     micro_batch, lag=PREFETCH_DEPTH + 2, console=self.console)
        self.model = self._build_model(units)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Gradients in the norm: a later pipeline stage's copy of the tied embedding is left out.
        tied_copy = self.pipeline is not None and self.pipeline.holds_tied_copy
        self.norm_params = [p for p in self.params if not (tied_copy and p is self.model.tok_embeddings.weight)]
        self.float8_scales = float8_gathers(cfg.training.float8, dims.fsdp)

        self.data = self._open_data()
        # The end-of-text id that separates packed documents, when attention stops at them.
        self.eot = spec.end_of_text if cfg.data.document_masking and spec.token_file is not None else None
        self.peak_lr = effective_lr(cfg.optimizer, cfg.training.global_batch_size)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.peak_lr, device.type, self.compiled)

        self.start_step, self.tokens_seen = spec.resume_step, 0
        self.checkpointer = Checkpointer(cfg.checkpoint, self.run_dir, device, spec.tokenizer_files, self.console)
        self.health = Health(cfg.reliability, cfg.debug.inject_nan_step, self.model, self.run_dir, device,
                             self.counts_for_metrics, self.start_step, cfg.debug.inject_nan_count)
        if spec.resume_from:
            self._resume(Path(spec.resume_from))
        peak = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                          cfg.metrics.peak_tflops)
        self.metrics = StepMetrics(cfg, self.run_dir, self.rank, self.world, device, self.args.num_params(),
                                   self.args.flops_per_token(cfg.training.seq_len, self.lora), peak,
                                   self.start_step, cfg.training.steps, self.console,
                                   moe=self.args if self.args.moe_layers else None)
        self.watchdog = Watchdog.start(cfg.reliability, self.run_dir, self.rank, self.world, device.type,
                                       self.start_step, self.console)

    def _build_model(self, units: int):
        """The model as this rank runs it: kernels and compilation chosen for the device (the
        compile check agreed by every rank), then the training layout applied; under pp the
        pipeline's stages and schedule."""
        cfg, dims, device, spec = self.cfg, self.dims, self.device, self.spec
        self.options = model_options(cfg, dims, device, compile=self._compile_works())
        self.compiled = self.options.compile != "none"
        # Where the compiled artefacts go (the launcher set it: duoka.cache), for the console.
        self.compile_cache = os.environ.get(INDUCTOR_CACHE_ENV) if self.compiled else None
        # Compiling the plain loss fuses away the fp32 logits (not under tp: loss_parallel's DTensors).
        self.compile_loss = self.compiled and dims.tp == 1
        par = ParallelOptions(compute_dtype=self.compute_dtype,
                              activation_checkpointing=cfg.training.activation_checkpointing == "full",
                              float8=cfg.training.float8, fsdp_blocks_per_unit=units,
                              reshard_after_forward=cfg.parallel.reshard_after_forward,
                              ddp_bucket_mb=cfg.parallel.ddp_bucket_mb)
        fill = Filler(spec.model_dir, cfg.training.seed, resuming=spec.resume_from is not None, partial=dims.pp > 1,
                      check_weights=cfg.model.check_weights)
        self.pipeline = None
        if dims.pp > 1:
            self.pipeline = Pipeline(cfg, self.args, self.options, par, dims, self.mesh, self.rank, self.world, device,
                                     fill, self.balance.timer, spec.stage_layers, self.balance.slow_factor,
                                     self.console)
            self.pipeline.build_schedule(pipeline_microbatches(cfg, self.batch.per_rank, self.batch.accumulation),
                                         self._pipeline_loss)
            return self.pipeline.model
        return build_training_model(self.args, self.options, par, dims, self.mesh, device, fill,
                                    self.balance.timer, self.lora)

    def _resume(self, path: Path) -> None:
        """Every component's state from the checkpoint: model, optimizer, step, balance shares, health."""
        state = self.checkpointer.load(path, self.model, self.optimizer)
        self.start_step, self.tokens_seen = state["step"], state["tokens"]
        if "balance" in state:
            self.balance.load_state_dict(state["balance"])
        if "health" in state:
            self.health.load_state_dict(state["health"])

    def _compile_works(self) -> bool:
        """training.compile for this device, checked on every rank before the model exists
        (duoka.train.compile_check): False on all ranks where it failed on any."""
        cfg, dims, device = self.cfg, self.dims, self.device
        if not compile_wanted(cfg.training.compile, device, dims.ep, dims.cp):
            return False
        # The check runs the block as the step will: FSDP2 casts the parameters to the
        # compute dtype, DDP keeps them fp32 under autocast.
        param_dtype = self.compute_dtype if dims.fsdp else torch.float32
        autocast = None if self.compute_dtype == torch.float32 or dims.fsdp else self.compute_dtype
        options = model_options(cfg, dims, device, compile=False)
        documents = cfg.data.document_masking and self.spec.token_file is not None
        inject = self.rank in failing_ranks(cfg.debug.fail_compile_ranks, self.world)
        # An injected failure must fail whatever an earlier run remembered.
        stamp = None if inject else check_stamp(self.args, options, param_dtype, autocast, device, documents)
        return agree_to_compile(lambda: check_compile(self.args, options, param_dtype, autocast, device, documents,
                                                      inject_failure=inject),
                                self.rank, self.world, self.run_dir, self.console, stamp)

    def _open_data(self):
        spec, cfg = self.spec, self.cfg
        if spec.token_file is None:
            return RandomTokens(self.args.vocab_size, cfg.training.seq_len, cfg.training.seed)
        if cfg.data.mode == "sft":
            return SFTWindows(Path(spec.token_file))
        return PackedWindows(Path(spec.token_file), cfg.training.seq_len)

    def _host_batches(self, step: int) -> list[dict]:
        """This rank's micro-batches of the step, built on the host by the data thread. Under
        pp the model derives varlen offsets from the document ids itself (the schedule splits
        the batch and cannot split offsets by sample)."""
        # Ulysses attends over the whole sequence: its varlen offsets are the unsplit batch's.
        varlen = (self.options.document_masking == "varlen" and self.dims.pp == 1
                  and (self.context is None or self.context.method == "ulysses"))
        offset, sizes = self.balance.plan(step, self.dp_rank)
        batches = [step_inputs(b, IGNORE_INDEX, self.eot, varlen,
                               always_positions=self.dims.model_parallel or self.context is not None)
                   for b in share_batches(self.data, step, self.cfg.training.global_batch_size, offset, sizes,
                                          self.cfg.training.seed)]
        if self.context is not None:  # every cp rank drew the group's batch: each keeps its chunks
            batches = [shard_sequence(b, self.context) for b in batches]
        return batches

    # ------------------------------------------------------------------ one step

    def _normalised(self, ce: torch.Tensor) -> torch.Tensor:
        """The loss whose gradient is exact under every layout (see the module doc): the
        gradient reduction averages over fsdp_size ranks (cp ranks included, each holding
        its own tokens' loss)."""
        return ce * self.dims.fsdp_size / self.global_tokens

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._normalised(cross_entropy_sum(logits, labels))

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
        """Summed cross-entropy in fp32. A function of its own so that the logits go out of
        scope before backward (a caller's variable would keep them alive through it)."""
        context = {"context": self.context} if self.context is not None else {}
        if self.fused_loss:
            with self._autocast():
                return self.model(**batch, **context)  # the model applies the head and the loss together
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with self._autocast():
            # A MoE model's router load-balancing term comes with the logits (see the module doc).
            logits, aux = (self.model(**inputs, **context, with_router_aux=True) if self.router_aux
                           else (self.model(**inputs, **context), None))
        if self.compile_loss:
            ce = compiled_cross_entropy_sum(logits, batch["labels"], varying_batch=self.balance.varying_batch)
        else:
            ce = cross_entropy_sum(logits, batch["labels"])
        return ce if aux is None else ce + aux * (batch["labels"] != IGNORE_INDEX).sum()

    def _forward_backward(self, micro: list[dict], phases: PhaseTimer) -> torch.Tensor:
        """The step's forward and backward; returns the rank's summed cross-entropy."""
        if self.pipeline is not None:
            with phases("pipeline"):  # forward and backward interleave inside the schedule
                normalised = self.pipeline.step(micro, self._loss_context)
            return normalised * self.global_tokens.double() / self.dims.fsdp_size
        loss_sum = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro):
            self.balance.before_micro_batch(len(batch["tokens"]))
            with self._sync_context(last=i == len(micro) - 1), self._loss_context():
                with phases("forward"):
                    ce = self._summed_loss(batch)
                with phases("backward"):
                    self._normalised(ce).backward()
            loss_sum += full_value(ce).detach()
        return loss_sum

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip to one global L2 norm over the model, each parameter counted once: across tp
        and dp shards (DTensor), across pipeline stages (squares summed over the pp group)."""
        norm = total_norm([p.grad for p in self.norm_params if p.grad is not None])
        if self.dims.pp > 1:
            squared = norm.float() ** 2
            dist.all_reduce(squared, group=self.mesh["pp"].get_group())
            norm = squared.sqrt()
        clip_to_norm(self.optimizer, self.params, norm, max_norm)
        return norm

    def _optimizer_step(self, step: int, loss_sum: torch.Tensor) -> tuple[torch.Tensor, float]:
        cfg = self.cfg
        grad_norm = self._clip_gradients(cfg.training.grad_clip if cfg.training.grad_clip > 0 else math.inf)
        lr = lr_at(step, cfg.training.steps, self.peak_lr, cfg.optimizer)
        self.optimizer.set_lr(lr)
        if self.health.allow_update(step, self.optimizer, grad_norm, loss_sum, self.global_tokens):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.float8_scales:
            precompute_float8_scales(self.model)
        return grad_norm, lr

    def _expert_counts(self) -> torch.Tensor | None:
        """A MoE model's routed assignments [MoE layers, E] over the step's micro-batches on this
        rank, summed over its pipeline stages (each fills its own layers' rows); None when dense."""
        parts = self.pipeline.model.parts if self.pipeline is not None else [unwrap(self.model)]
        counts = [c for c in (part.take_expert_counts() for part in parts) if c is not None]
        return torch.stack(counts).sum(dim=0) if counts else None

    def _step(self, step: int, prefetch: Prefetcher, last_end: Mark, wait: bool) -> StepEnd:
        """Launch one optimizer step; its figures are read later, from the returned StepEnd."""
        t0 = time.perf_counter()
        self.watchdog.begin_step(step + 1)
        host = prefetch.get(step)
        micro = [{k: t.to(self.device, non_blocking=True) for k, t in b.items()} for b in host]
        t_data = time.perf_counter() - t0
        # Counted on the GPU from the copied labels: a count made on the host would be a
        # synchronous copy, the host waiting for the previous step.
        local_tokens = sum((b["labels"] != IGNORE_INDEX).sum() for b in micro).to(torch.float64)
        global_tokens = local_tokens.clone()
        self.watchdog.enter("all_reduce of the token count")
        dist.all_reduce(global_tokens)  # every tp and pp rank of a replica holds the same tokens
        self.global_tokens = (global_tokens / (self.dims.tp * self.dims.pp)).float()
        phases = PhaseTimer(self.device)
        self.watchdog.enter("forward and backward")
        loss_sum = self._forward_backward(micro, phases)
        self.watchdog.enter("optimizer step")
        with phases("optimizer"):
            grad_norm, lr = self._optimizer_step(step, loss_sum)
        self.balance.after_optimizer()
        scalars = to_host(torch.stack([loss_sum.double(), grad_norm.double(), local_tokens]))
        counts = self._expert_counts()  # copied before the step's end mark, as the scalars
        done = StepEnd(step + 1, last_end, Mark(self.device), phases, scalars, lr, t_data,
                       sum(len(b["tokens"]) for b in host), memory_figures(self.device), time.perf_counter() - t0,
                       None if counts is None else to_host(counts))
        if wait:
            with sync_debug("default"):
                done.end.wait()
        return done

    def _finish_step(self, done: StepEnd, started: float) -> bool:
        """Everything that needs a step's results, once the GPU is past it. One all-gather
        carries every rank's figures, and with them whether any rank was asked to stop, so
        that all stop at the same step. Returns that."""
        t = time.perf_counter()
        self.watchdog.enter("wait for the device to finish the step", done.step)
        with sync_debug("default"):  # the one wait a deferred step end makes
            step_time = done.end.seconds_since(done.start)
        waited = time.perf_counter() - t
        counted = self.counts_for_metrics
        mine = RankFigures(loss_sum=float(done.scalars[0]) if counted else 0.0,
                           tokens=float(done.scalars[2]) if counted else 0.0, step_time=step_time,
                           data_time=done.data_time, samples=done.samples, compute_s=self.balance.compute_seconds(),
                           stop=self.stop.requested, save_done=self.checkpointer.written_here, **done.memory,
                           gpu=self.metrics.gpu_figures())
        self.watchdog.enter("metrics gather", done.step)
        ranks = self.metrics.gather(mine)
        self.tokens_seen += int(sum(r.tokens for r in ranks))
        record = self.metrics.record(done.step, ranks, self.tokens_seen, done.lr, float(done.scalars[1]))
        # Rank 0's phases and host times; the rest of the step is exposed communication and gaps.
        record["phase_s"] = dict(done.phases.seconds(), data=done.data_time)
        record["host_s"] = {"launch": done.launch_s, "wait": waited}
        balance = self.balance.end_step(done.step - 1, [r.compute_s for r in ranks], [int(r.samples) for r in ranks],
                                        record["phase_s"], done.samples)
        record["phase_s"]["other"] = max(0.0, step_time - sum(record["phase_s"].values()))
        if balance is not None:
            record["balance"] = balance
        if done.expert_counts is not None:  # every rank of a MoE run, each step, in this place
            self.watchdog.enter("all_reduce of the expert load", done.step)
            record["expert_load"] = self.metrics.expert_load(done.step, done.expert_counts)
        self.health.end_step(record)
        self.metrics.publish(record, time.perf_counter() - started, self.watchdog.take_alerts())
        self.checkpointer.finish_if_written_everywhere(all(r.save_done for r in ranks))
        self.health.raise_if_failing()
        self.checkpointer.prune_if_confirmed(self.health.healthy)
        return any(r.stop for r in ranks)

    # ------------------------------------------------------------------ the loop

    def train(self) -> None:
        started = time.perf_counter()
        self.console.print(self._banner())
        self.model.train()
        prefetch = Prefetcher(self._host_batches, self.start_step, self.cfg.training.steps,
                              pin=self.device.type == "cuda", depth=PREFETCH_DEPTH)
        try:
            self._loop(prefetch, started)
        finally:
            prefetch.close()
            self.checkpointer.close()
            self.metrics.close()
            self.watchdog.close()

    def _loop(self, prefetch: Prefetcher, started: float) -> None:
        cfg, steps = self.cfg, self.cfg.training.steps
        # A step's figures are read one step later, once the GPU is past it: the host never
        # waits for the GPU between steps. The load balancer reads its block timings at the
        # step's end, so it keeps the synchronous end.
        deferred = not self.balance.synchronous
        pending: StepEnd | None = None
        last_end = Mark(self.device)
        profiler = StepProfiler(cfg.metrics, self.device, self.run_dir / "profile", self.rank, steps)
        step = self.start_step - 1
        for step in range(self.start_step, steps):
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)  # peak_mem_gib is this step's peak
            profiler.before(step)
            check = "error" if cfg.debug.check_host_syncs and step >= self.start_step + 2 else "default"
            compiling = self.compiled and step == self.start_step
            if compiling:
                where = f" (artefacts cached in {self.compile_cache} for the next launch)" if self.compile_cache else ""
                self.console.print(f"step {step + 1}: compiling{where} ...")
            with sync_debug(check):
                # The trace must hold every kernel of the profiled steps.
                this = self._step(step, prefetch, last_end, wait=not deferred or profiler.last(step))
            if compiling:  # the compiler runs on the host, inside the step's launch
                self.console.print(f"step {step + 1} compiled in {this.launch_s:.1f} s")
            last_end = this.end
            if profiler.last(step):
                profiler.write()
                last_end = Mark(self.device)  # writing the trace is no part of the next step
            ready, pending = (pending, this) if deferred else (this, None)
            with sync_debug(check):
                stop = ready is not None and self._finish_step(ready, started)
            interval = cfg.checkpoint.interval
            save_now = interval and (step + 1) % interval == 0 and step + 1 != steps
            if (stop or save_now) and pending is not None:
                # A checkpoint holds the tokens seen so far, and metrics.jsonl must not lack a
                # step that a resume would skip: finish the step being saved first.
                stop = self._finish_step(pending, started) or stop
                pending = None
            if stop:
                self._stop_early(step + 1)
                return
            if save_now:
                self._save(step + 1)
                last_end = Mark(self.device)  # the next step's time leaves the save out
        if pending is not None:
            self._finish_step(pending, started)  # a stop asked for now ends the run anyway
        if step + 1 > self.start_step or not (self.run_dir / "checkpoints" / f"step-{steps}").exists():
            self._save(steps)
        self.checkpointer.finish()
        self.checkpointer.prune_if_confirmed(self.health.healthy)  # the run ended normally
        final = None
        if cfg.checkpoint.export_final:
            self.watchdog.enter("export of the final model")
            final = export_trained(self.model, self.args, self.run_dir, steps, self.spec.tokenizer_files,
                                   pipeline=self.pipeline is not None, lora=self.lora, base=self.spec.base)
        self.console.done(self.run_dir, final, time.perf_counter() - started)

    def _save(self, step: int) -> None:
        self.watchdog.enter("checkpoint save", step)
        self.health.check_weights(self.params, step)
        state = {"tokens": self.tokens_seen, "model_args": self.spec.model_args, "config": self.spec.config,
                 "dp_size": self.dp_size, "world_size": self.world, "balance": self.balance.state_dict(),
                 "healthy": self.health.healthy, "health": self.health.state_dict()}
        if self.spec.base is not None:
            state["base"] = self.spec.base  # a LoRA checkpoint names its frozen base (duoka.train.adapters)
        self.checkpointer.save(step, self.model, self.optimizer, state)

    def _stop_early(self, step: int) -> None:
        """SIGTERM or SIGINT (preemption, Ctrl-C): the step is finished; save, mark the run as stopped, leave."""
        self._save(step)
        self.checkpointer.finish()
        if self.rank == 0:
            (self.run_dir / STOPPED_MARKER).write_text(str(step))
        # The stop may have been asked on another rank only (all ranks stop at the same step).
        why = signal.Signals(self.stop.signal).name if self.stop.signal else "a signal to another rank"
        self.console.print(f"[bold yellow]stopped by {why} after step {step}[/]; continue with "
                           f"--checkpoint.resume=auto --job.output_dir={self.run_dir}")

    def _banner(self) -> str:
        b, cfg = self.batch, self.cfg
        return (f"[bold]duoka train[/] {self.args.num_params() / 1e6:.1f}M parameters"
                + (f" (LoRA rank {self.lora.rank}: {trainable_numel(self.model) / 1e6:.2f}M trained)" if self.lora
                   else "")
                + f" | {self.dims.describe()}" + (f" ({self.context.method})" if self.context else "") + " on "
                f"{self.world} x {self.device.type} | {str(self.compute_dtype).removeprefix('torch.')}"
                + (f" + float8 {cfg.training.float8} matmuls" if cfg.training.float8 != "none" else "")
                + (" | compiled" if self.compiled else "")
                + (f" | {self.optimizer.describe()}" if cfg.optimizer.name != "adamw" or cfg.optimizer.offload != "none"
                   else "")
                + f" | global batch {b.global_batch} = micro-batch {b.micro_batch} x accumulation {b.accumulation} "
                f"x dp {b.dp_size} | seq {cfg.training.seq_len} | peak lr {self.peak_lr:.3g}"
                + (" | fused chunked loss" if self.fused_loss else
                   " | vocabulary-parallel loss" if self.dims.tp > 1 else "")
                + (f" | resumed at step {self.start_step} from {self.spec.resume_from}" if self.spec.resume_from
                   else ""))
