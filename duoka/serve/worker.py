"""One GPU's share of serving (vLLM's and nano-vllm's Worker): the model, whole or this
tensor-parallel rank's shard, its paged KV cache and CUDA graphs (a ModelRunner), the
sampler, and the forward of every step.

Rank 0's LLMEngine owns a Worker and hands it each step. Under tensor parallelism that
Worker first sends the step to the other ranks (serve.step_channel), whose Workers run it
in run_loop(): that is all a rank above 0 does; it holds no tokenizer, scheduler, block
manager or detokenizer. Sampling runs on rank 0 only, so nothing of it travels.

Making a Worker only checks the config against the model (no collective, nothing loaded);
start() is where the ranks meet: the step group, the sharded load, the profile step, the
KV-cache agreement and the CUDA graph capture are collectives or hold some, so every rank
runs start() from the same EngineConfig, and they pair up in this order.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from duoka.errors import DuokaError
from duoka.host.devices import compute_dtype_name
from duoka.hub import bundled_model_dir, resolve_model_dir
from duoka.models import row_logprobs
from duoka.models.qwen2.args import ModelOptions
from duoka.models.qwen2.hf_adapter import load_hf_model, read_config
from duoka.models.qwen2.model import Qwen2
from duoka.models.qwen2.multi_lora import ServedLoRA, add_loras, read_lora
from duoka.models.qwen2.peft import merge_adapter
from duoka.serve.config import EngineConfig
from duoka.serve.dummy_weights import fill_random_
from duoka.serve.params import MAX_LOGPROBS, SamplingParams
from duoka.serve.prompt_logprobs import PendingPromptLogprobs, PromptRows, launch_prompt_logprobs
from duoka.serve.quant_load import (
    check_fits,
    check_quantizable,
    load_quantized_model,
    read_scheme,
    weight_bytes,
)
from duoka.serve.runner import CacheShape, ModelRunner, StepInputs, available_kv_bytes, cache_shape, profile_step
from duoka.serve.sampling import PendingSample, Sampler, SampleRow, TokenMasks
from duoka.serve.step_channel import broadcast_step, step_group, worker_loop
from duoka.serve.tp_shard import (
    all_reduce_outputs,
    build_shard,
    check_tp_size,
    load_tp_model,
    local_kv_heads,
    shard_range,
)


class StepRunner(Protocol):
    """What a Worker needs of its runner: ModelRunner, or a benchmark's stand-in. Prompt
    logprobs also need ModelRunner's execute_with_hidden and head."""

    def execute(self, inputs: StepInputs) -> torch.Tensor: ...


# Builds the runner from ModelRunner's arguments (model, cache shape, device, max_model_len,
# max_num_seqs, cuda_graphs, max_num_batched_tokens): a benchmark of the host's work passes one
# whose execute returns logits without running the model.
RunnerFactory = Callable[[Qwen2, CacheShape, torch.device, int, int, bool, int], StepRunner]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    """Ranks other than 0 say nothing: rank 0 speaks for the group."""


def model_folder(model: str | None) -> Path:
    """The folder a config's model names: a folder, a hub id's cached snapshot, or the bundled model."""
    return resolve_model_dir(model) if model is not None else bundled_model_dir()


def _checked_group(tp: int, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The tensor-parallel group (None at tp 1 without one): the given group, else the world."""
    if group is None and tp == 1:
        return None
    if not dist.is_initialized():
        raise DuokaError(f"tp={tp} needs torch.distributed initialised over {tp} processes",
                         f"start the ranks with `duoka serve --tp {tp}`, which does")
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if size != tp:
        raise DuokaError(f"the tensor-parallel group has {size} processes but the engine's tp is {tp}",
                         f"give tp={size}, or a group of {tp} processes")
    return group


class Worker:
    """The model side of serving on one device. folder: the config's model, already resolved
    (rank 0's engine loads its tokenizer from it first); None resolves it here."""

    def __init__(self, config: EngineConfig, *, folder: Path | None = None,
                 tp_group: dist.ProcessGroup | None = None, log=_log, runner_factory: RunnerFactory = ModelRunner):
        self.config = config
        self.folder = folder if folder is not None else model_folder(config.model)
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise DuokaError("--device cuda was asked for but PyTorch sees no GPU",
                             "run `nvidia-smi` to check the driver, or use --device cpu")
        self.dtype = getattr(torch, compute_dtype_name(config.dtype, self.device.type))
        self.args = read_config(self.folder)
        context = self.args.context_len  # a YaRN config: the scaled context
        if config.max_model_len is not None and config.max_model_len > context:
            raise DuokaError(f"--max-model-len {config.max_model_len} is longer than the model's context of "
                             f"{context} tokens", f"use --max-model-len {context} or less")
        self.max_model_len = config.max_model_len or context
        self.group = _checked_group(config.tp, tp_group)
        self.tp = config.tp
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        check_tp_size(self.args, self.tp)
        if config.adapter is not None and self.tp > 1:
            raise DuokaError("a LoRA adapter with tensor parallelism is not supported yet",
                             "merge it first: duoka export ADAPTER --merge --out DIR, then serve DIR")
        # The --lora adapters, read (host memory) and checked against the model before anything
        # loads; handed to the model in _load, then dropped here.
        self._loras: tuple[ServedLoRA, ...] = tuple(read_lora(name, folder, self.args)
                                                    for name, folder in config.loras)
        # The folder's quantization (GPTQ, AWQ, FP8 checkpoints) or --quantization's; checked
        # against the device's memory before anything loads.
        self.scheme = read_scheme(self.folder, config.quantization)
        check_quantizable(self.args, self.scheme, self.folder)
        if self.scheme is not None and (config.adapter is not None or config.loras):
            raise DuokaError(f"LoRA adapters on a quantized model ({self.scheme.method}) are not supported yet",
                             "serve the adapters on the bf16 model, or merge them first (duoka export --merge) and "
                             "quantize the merged model")
        check_fits(self.args, self.scheme, self.tp, self.device, config.gpu_memory_utilization)
        # The speculative draft model (rank 0 only: tp 1, EngineConfig refuses more), checked before the load.
        self.draft_folder = model_folder(config.speculative_model) if config.speculative_model is not None else None
        self.draft_args = read_config(self.draft_folder) if self.draft_folder is not None else None
        if self.draft_args is not None and self.draft_args.context_len < self.max_model_len:
            raise DuokaError(f"the draft model's context of {self.draft_args.context_len} tokens is shorter than "
                             f"the served {self.max_model_len}", f"serve with --max-model-len "
                             f"{self.draft_args.context_len} or less, or use a draft of the model's context")
        self.draft_runner: ModelRunner | None = None
        self.log = log
        self.runner_factory = runner_factory
        self.sampler = Sampler()
        self.model: Qwen2 | None = None
        self.shape: CacheShape | None = None
        self.runner: StepRunner | None = None
        self._steps_group: dist.ProcessGroup | None = None

    # ---------------------------------------------------------------- start-up
    def start(self) -> None:
        """Load the model, size the KV cache and build the runner: on every rank, in this order."""
        config = self.config
        if self.tp > 1:  # every rank makes it at the same point (dist.new_group pairs up)
            self._steps_group = step_group(self.group)
        t0 = time.perf_counter()
        self.model = self._load()
        # Before the cache is sized: the draft's weights are counted, and its cache shares the blocks.
        draft = self._load_draft() if self.draft_args is not None else None
        draft_block_bytes = self._draft_shape(draft, 0).bytes_per_block if draft is not None else 0
        kv_bytes = self._kv_bytes() if config.num_kv_blocks is None else 0
        shape = cache_shape(self.model, local_kv_heads(self.args, self.tp), config.block_size, self.dtype, kv_bytes,
                            self.max_model_len, config.max_num_seqs, config.num_kv_blocks, draft_block_bytes)
        self.shape = shape
        # The CUDA graphs are captured here, with the tp all-reduces inside: on every rank alike.
        self.runner = self.runner_factory(self.model, shape, self.device, self.max_model_len, config.max_num_seqs,
                                          config.cuda_graphs, config.max_num_batched_tokens)
        if draft is not None:  # the draft's own cache, block for block the target's (the same block tables)
            self.draft_runner = ModelRunner(draft, self._draft_shape(draft, shape.num_blocks), self.device,
                                            self.max_model_len, config.max_num_seqs, config.cuda_graphs,
                                            config.max_num_batched_tokens)
        quantized = f", {self.scheme.method} {self.scheme.bits}-bit projections" if self.scheme else ""
        if config.load_format == "dummy":
            quantized += ", RANDOM weights (--load-format dummy): for measuring only"
        if draft is not None:
            quantized += f"; speculative draft {self.draft_folder} ({weight_bytes(draft) / 2**30:.2f} GiB)"
        cache_gib = shape.num_blocks * (shape.bytes_per_block + draft_block_bytes) / 2**30
        self.log(f"duoka: loaded {self.folder} on {self.device} ({str(self.dtype).removeprefix('torch.')}{quantized}) "
                 f"in {time.perf_counter() - t0:.1f} s; weights {weight_bytes(self.model) / 2**30:.2f} GiB; KV cache "
                 f"{shape.tokens:,} tokens in {shape.num_blocks:,} blocks of {config.block_size} ({cache_gib:.2f} GiB), "
                 f"maximum concurrency {shape.tokens / self.max_model_len:.1f}x at {self.max_model_len:,} tokens per "
                 "request")

    def _load(self) -> Qwen2:
        config = self.config
        # Each decoder block runs as one compiled graph around the attention operator (compile
        # None: on GPU only, where a decode step is then dozens of kernels per layer fewer;
        # bench/NOTES.md, "Serving"). q/k/v and gate/up are loaded as one weight each: one
        # matmul apiece without concatenating weights per step, which a decode bound by
        # reading the weights cannot spare.
        compile = self.device.type == "cuda" if config.compile is None else config.compile
        options = ModelOptions(compile="block" if compile else "none", compile_dynamic=True, packed_projections=True)
        dummy = config.load_format == "dummy"
        if self.scheme is not None:
            model = load_quantized_model(self.folder, self.args, self.scheme, self.device, self.dtype, options,
                                         config.check_weights, self.group if self.tp > 1 else None, dummy)
        elif dummy:
            model = build_shard(self.args, self.tp, self.device, self.dtype, options)
            fill_random_(model)
            if self.tp > 1:
                all_reduce_outputs(model, self.group)
            model.eval()
        elif self.tp > 1:
            model = load_tp_model(self.folder, self.args, self.group, self.device, self.dtype, options,
                                  config.check_weights)
        else:
            model, _ = load_hf_model(self.folder, device=self.device, dtype=self.dtype, options=options,
                                     check_weights=config.check_weights)
        if config.adapter is not None:
            # Before the profile step, the cache sizing and the CUDA graphs: they all see the merged weights.
            merge_adapter(model, config.adapter)
        if self._loras:
            # Also before the profile step (it runs their matmuls: the shapes do not depend on the
            # step's adapters) and the CUDA graphs (they read the slots from a static buffer).
            # Under tensor parallelism each rank keeps its rows of B, or its columns of A.
            shard = partial(shard_range, args=self.args, tp=self.tp, rank=self.rank) if self.tp > 1 else None
            add_loras(model, self._loras, shard)
            self.log("duoka: LoRA adapters " + ", ".join(f"{lora.name} (rank {lora.rank}, {','.join(lora.targets)})"
                                                         for lora in self._loras) + " served beside the base")
            self._loras = ()
        model.requires_grad_(False)  # inference only: nothing compiled traces a backward
        return model

    def _load_draft(self) -> Qwen2:
        """The speculative draft model, whole on this device (random with --load-format dummy, as
        the model), compiled like the model's blocks."""
        config, args = self.config, self.draft_args
        compile = self.device.type == "cuda" if config.compile is None else config.compile
        options = ModelOptions(compile="block" if compile else "none", compile_dynamic=True, packed_projections=True)
        if config.load_format == "dummy":
            draft = build_shard(args, 1, self.device, self.dtype, options)
            fill_random_(draft)
            draft.eval()
        else:
            draft, _ = load_hf_model(self.draft_folder, device=self.device, dtype=self.dtype, options=options,
                                     check_weights=config.check_weights)
        draft.requires_grad_(False)
        return draft

    def _draft_shape(self, draft: Qwen2, num_blocks: int) -> CacheShape:
        args = draft.args
        return CacheShape(args.n_layers, num_blocks, self.config.block_size, args.n_kv_heads, args.resolved_head_dim,
                          self.dtype)

    def _kv_bytes(self) -> int:
        """What this process's cache may take after a profiled worst-case step; under tensor
        parallelism the least any rank can hold, so that every rank's cache is the same size."""
        config = self.config
        self._profile()
        kv_bytes = available_kv_bytes(self.device, config.gpu_memory_utilization, config.kv_cache_memory_gib)
        if self.tp > 1:
            least = torch.tensor([kv_bytes], dtype=torch.int64, device=self.device)
            dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self.group)
            kv_bytes = int(least.item())
        return kv_bytes

    def _profile(self) -> None:
        """On GPU, run the largest step the scheduler can make (a full token budget, logits for
        max_num_seqs rows) so that the peak it leaves is counted before the cache is sized. Every
        rank runs the same step, sampling included (as rank 0 does), so each measures rank 0's peak."""
        if self.device.type != "cuda":
            return
        config = self.config
        tokens = min(config.max_num_batched_tokens, self.max_model_len)
        # Logits rows: one per sequence, or under speculation K + 1 per speculating sequence.
        rows = config.max_num_seqs
        if config.speculation is not None:
            speculating = min(config.max_num_seqs, config.speculative_disable_by_batch_size)
            rows = max(rows, speculating * (config.num_speculative_tokens + 1))
        logits = profile_step(self.model, tokens, rows, config.block_size, self.dtype, self.device, self.max_model_len)
        # The sampler's worst case too: every row with top-k and top-p sorts the vocabulary, and the
        # bias and penalties keep a processed copy of the logits beside the model's (the penalties
        # run only on rows with tokens to count: one of prompt and one of output).
        worst = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                               frequency_penalty=0.5, logit_bias={0: 1.0}, logprobs=MAX_LOGPROBS)
        self.sampler.sample(logits, [SampleRow(worst, 0, 0, [0], [0]) for _ in range(len(logits))])
        torch.cuda.synchronize(self.device)

    # ---------------------------------------------------------------- steps
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Rank 0: the step's logits [S, vocab]. Under tensor parallelism the step goes to the
        other ranks first: their forwards' all-reduces meet this one's."""
        if self._steps_group is not None:
            broadcast_step(inputs, self._steps_group)
        return self.runner.execute(inputs)

    def execute_draft(self, inputs: StepInputs) -> torch.Tensor:
        """Rank 0: the speculative draft model's logits [S, draft vocab] for a step of its own
        (its cache shares the model's block tables)."""
        return self.draft_runner.execute(inputs)

    def execute_with_prompt(self, inputs: StepInputs, prompt: PromptRows) -> tuple[torch.Tensor, PendingPromptLogprobs]:
        """Rank 0: execute()'s logits, and the prompt logprobs of `prompt`'s rows launched on the
        device after the forward (the other ranks run the plain forward: the head that scores
        those rows is whole on every rank, so nothing of it travels)."""
        if self._steps_group is not None:
            broadcast_step(inputs, self._steps_group)
        logits, hidden = self.runner.execute_with_hidden(inputs, prompt.rows)
        # At most max_num_seqs rows of logits at once: what the profile step measured. The fused
        # kernel where the attention kernels run (backend "cuda": a GPU, or a test's interpreter).
        return logits, launch_prompt_logprobs(self.runner.head_logits, hidden, prompt, self.config.max_num_seqs,
                                              self.runner.backend == "cuda" and row_logprobs.available())

    def sample(self, logits: torch.Tensor, rows: list[SampleRow], masks: TokenMasks | None = None) -> PendingSample:
        """Rank 0: launch the sampling of `logits`, one row per entry of `rows` (masks: the
        constrained rows' allowed tokens), without waiting."""
        return self.sampler.launch(logits, rows, masks)

    def run_loop(self) -> None:
        """A rank other than 0: run every step rank 0 sends, until its shutdown()."""
        worker_loop(self.runner, self._steps_group)

    def shutdown(self) -> None:
        """Rank 0: release the other ranks (their run_loop returns)."""
        if self._steps_group is not None and self.rank == 0:
            broadcast_step(None, self._steps_group)


def run_worker(config: EngineConfig, tp_group: dist.ProcessGroup | None = None) -> None:
    """The whole life of a tensor-parallel rank above 0: its share of the start-up, then rank
    0's steps until rank 0 stops."""
    worker = Worker(config, tp_group=tp_group, log=_quiet)
    worker.start()
    worker.run_loop()
