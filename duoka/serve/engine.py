"""The serving engine: one loop under `duoka generate`, `duoka serve` and the Python API.

Every step the scheduler picks which sequences run and how many of their tokens (prefill
chunks and one-token decodes together, under a token budget), the runner computes their
logits over the paged KV cache, the sampler picks each sequence's next token on the
device, and the detokenizer turns tokens into text and finds stop strings. Requests join
and leave between any two steps.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist

from duoka.data.tokenizer import Tokenizer, load_tokenizer
from duoka.errors import DuokaError
from duoka.hub import bundled_model_dir, resolve_model_dir
from duoka.models.qwen2.args import ModelOptions
from duoka.models.qwen2.hf_adapter import load_hf_model, read_config
from duoka.models.qwen2.peft import merge_adapter
from duoka.host.devices import compute_dtype_name
from duoka.serve.tp_shard import check_tp_size, load_tp_model, local_kv_heads
from duoka.serve.blocks import BlockManager
from duoka.serve.detok import IncrementalDetokenizer
from duoka.serve.params import MAX_LOGPROBS, RequestOutput, SamplingParams, TokenLogprob
from duoka.serve.runner import (
    CacheShape,
    ModelRunner,
    StepInputs,
    available_kv_bytes,
    cache_shape,
    decode_first,
    prepare_inputs,
)
from duoka.serve.sampling import Sampler, SampleRow
from duoka.serve.scheduler import ScheduledBatch, Scheduler, SeqStatus, Sequence
from duoka.serve.step_channel import broadcast_step, step_group, worker_loop

BUNDLED_MODEL_NAME = "duoka-tiny-qwen2"  # what clients call the model served when none is named

# Sampling defaults a model folder's generation_config.json may set (what vLLM takes from it).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k")


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of the cache's blocks in use
    kv_blocks: int
    block_size: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_hits: int  # of which found there
    prompt_tokens: int  # prompt tokens computed (cumulative; cached ones excluded)
    generation_tokens: int  # tokens sampled (cumulative)
    num_preemptions: int  # sequences preempted for lack of blocks, to be recomputed (cumulative)


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit, known once the engine has sized its cache: the same checks
    whether the engine is here or in its own process (serve.engine_process)."""
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise DuokaError("the prompt is empty", "give at least one token of prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise DuokaError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                             "tokenize with this model's tokenizer")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise DuokaError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) is {total} tokens, "
                f"more than this server's maximum context of {self.max_model_len} tokens",
                "shorten the prompt or lower max_tokens")
        if -(-total // self.block_size) > self.num_blocks:
            raise DuokaError(f"the request needs {total} tokens of KV cache; the whole cache holds "
                             f"{self.num_blocks * self.block_size}",
                             "lower max_tokens, or give the server more memory (--gpu-memory-utilization)")


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class LLMEngine:
    """Loads a Hugging Face Qwen2 folder (or hub id) and serves requests step by step.

    max_model_len: the longest prompt + output (default: the model's context).
    gpu_memory_utilization: the share of the GPU the process may fill, weights and cache
    together (CPU: the share of free RAM, at most CPU_KV_CACHE_GIB unless kv_cache_memory_gib).
    num_kv_blocks: a fixed cache size instead (tests use a tiny one to force preemption).
    adapter: a PEFT LoRA adapter folder, merged into the loaded weights (tp 1).
    runner_factory: builds the runner from ModelRunner's arguments (a benchmark of the host's
    work passes one whose execute returns logits without a model)."""

    def __init__(self, model: str | Path | None = None, *, device: str | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.9, block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, enable_prefix_caching: bool = True,
                 num_kv_blocks: int | None = None, kv_cache_memory_gib: float | None = None, seed: int = 0,
                 served_model_name: str | None = None, cuda_graphs: bool = True, compile: bool | None = None,
                 adapter: str | Path | None = None,
                 tp_group: dist.ProcessGroup | None = None, log=_log, runner_factory=ModelRunner):
        if not 0 < gpu_memory_utilization <= 1:
            raise DuokaError(f"--gpu-memory-utilization {gpu_memory_utilization} is outside (0, 1]",
                             "give the share of the GPU's memory to use, e.g. 0.9")
        if block_size < 1 or max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise DuokaError("block size, max_num_seqs and max_num_batched_tokens must be at least 1",
                             "leave them at their defaults (16, 256, 8192) unless you are tuning")
        folder = resolve_model_dir(model) if model is not None else bundled_model_dir()
        self.folder = folder
        self.model_name = served_model_name or str(model or BUNDLED_MODEL_NAME)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise DuokaError("--device cuda was asked for but PyTorch sees no GPU",
                             "run `nvidia-smi` to check the driver, or use --device cpu")
        self.dtype = getattr(torch, compute_dtype_name(dtype, self.device.type))
        args = read_config(folder)
        context = args.max_seq_len
        if max_model_len is not None and max_model_len > context:
            raise DuokaError(f"--max-model-len {max_model_len} is longer than the model's context of {context} tokens",
                             f"use --max-model-len {context} or less")
        self.max_model_len = max_model_len or context
        self.tokenizer: Tokenizer = load_tokenizer(folder)

        # Tensor parallelism: every rank builds this engine with the same arguments (the same
        # start-up collectives: the load, the profile step, the KV agreement, the CUDA graphs);
        # rank 0 then serves and sends each step to the others, which run_worker().
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        check_tp_size(args, self.tp)
        self._steps_group = step_group(tp_group) if self.tp > 1 else None
        t0 = time.perf_counter()
        # Each decoder block runs as one compiled graph around the attention operator (compile
        # None: on GPU only, where a decode step is then dozens of kernels per layer fewer;
        # bench/NOTES.md, "Serving"). q/k/v and gate/up are loaded as one weight each: one
        # matmul apiece without concatenating weights per step, which a decode bound by
        # reading the weights cannot spare.
        compile = self.device.type == "cuda" if compile is None else compile
        options = ModelOptions(compile="block" if compile else "none", compile_dynamic=True, packed_projections=True)
        if self.tp > 1:
            self.model = load_tp_model(folder, args, tp_group, self.device, self.dtype, options)
        else:
            self.model, _ = load_hf_model(folder, device=self.device, dtype=self.dtype, options=options)
        if adapter is not None:
            if self.tp > 1:
                raise DuokaError("a LoRA adapter with tensor parallelism is not supported yet",
                                 "merge it first: duoka export ADAPTER --merge --out DIR, then serve DIR")
            # Before the profile step, the cache sizing and the CUDA graphs: they all see the merged weights.
            merge_adapter(self.model, adapter)
        self.model.requires_grad_(False)  # inference only: nothing compiled traces a backward
        self.sampler = Sampler()
        kv_bytes = 0
        if num_kv_blocks is None:
            self._profile(max_num_batched_tokens, max_num_seqs, block_size)
            kv_bytes = available_kv_bytes(self.device, gpu_memory_utilization, kv_cache_memory_gib)
            if self.tp > 1:  # every rank's cache the same size: the smallest any rank can hold
                least = torch.tensor([kv_bytes], dtype=torch.int64, device=self.device)
                dist.all_reduce(least, op=dist.ReduceOp.MIN, group=tp_group)
                kv_bytes = int(least.item())
        shape = cache_shape(self.model, local_kv_heads(args, self.tp), block_size, self.dtype, kv_bytes,
                            self.max_model_len, max_num_seqs, num_kv_blocks)
        self.shape: CacheShape = shape
        self.runner = runner_factory(self.model, shape, self.device, self.max_model_len, max_num_seqs, cuda_graphs)
        log(f"duoka: loaded {folder} on {self.device} ({str(self.dtype).removeprefix('torch.')}) in "
            f"{time.perf_counter() - t0:.1f} s; KV cache {shape.tokens:,} tokens in {shape.num_blocks:,} blocks of "
            f"{block_size} ({shape.num_blocks * shape.bytes_per_block / 2**30:.2f} GiB), maximum concurrency "
            f"{shape.tokens / self.max_model_len:.1f}x at {self.max_model_len:,} tokens per request")

        stop_ids = self.tokenizer.stop_ids()
        if not stop_ids and args.eos_token_id is not None:
            stop_ids = {args.eos_token_id} if isinstance(args.eos_token_id, int) else set(args.eos_token_id)
        self.eos_ids = frozenset(stop_ids)
        self.blocks = BlockManager(shape.num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, self.max_model_len,
                                   self.eos_ids)
        self.vocab_size = args.vocab_size
        self.limits = RequestLimits(args.vocab_size, self.max_model_len, shape.block_size, shape.num_blocks)
        gen = self.tokenizer.generation_config
        self.default_params = {k: gen[k] for k in GENERATION_CONFIG_KEYS if k in gen}
        self._seeds = random.Random(seed)
        # id -> (seq, detok, its sampling row: params and seed fixed, output_index set each step)
        self._requests: dict[str, tuple[Sequence, IncrementalDetokenizer, SampleRow]] = {}
        self._aborted: list[RequestOutput] = []
        self._in_flight: tuple | None = None  # (batch, sampled request ids, PendingSample) of the launched step
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._preemptions = 0

    # ---------------------------------------------------------------- requests
    def make_params(self, **overrides) -> SamplingParams:
        """SamplingParams from the model's generation_config.json defaults and the request's fields."""
        known = {f.name for f in fields(SamplingParams)}
        return SamplingParams(**{**self.default_params, **{k: v for k, v in overrides.items() if k in known}})

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise DuokaError(f"request id {request_id!r} is already running", "give each request its own id")
        self.limits.check(prompt_ids, params)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        seq = Sequence(request_id, list(prompt_ids), params)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, stop=params.stop)
        self.scheduler.add(seq)
        # The row reads seq.output_ids, the list itself (it only grows), for the penalties.
        self._requests[request_id] = (seq, detok, SampleRow(params, seed, 0, seq.output_ids))

    def abort(self, request_id: str) -> None:
        """Free the request's blocks now; its final output (finish_reason "abort") comes with the next step."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        seq = entry[0]
        self.scheduler.abort(request_id)
        self._aborted.append(RequestOutput(request_id, [], "", None, True, "abort", seq.num_prompt_tokens,
                                           seq.num_output_tokens, seq.num_cached_tokens))

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._aborted) or self._in_flight is not None

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """One step of a one-deep pipeline: wait for the step in flight and record its tokens,
        schedule and launch the next one, then turn the recorded tokens into outputs (text, stop
        strings) while the device runs it. A request a stop string ends meanwhile loses the token
        its next step computes; its blocks are freed at once, and none is handed out again
        before that step has finished (scheduling waits for it)."""
        outputs, self._aborted = self._aborted, []
        landed = self._land()
        batch: ScheduledBatch = self.scheduler.schedule()
        self._preemptions += len(batch.preempted)
        if batch.items:
            self._launch(batch)
        requests = self._requests
        for seq, token, logprob in landed:
            if seq.request_id in requests:  # not aborted since
                outputs.append(self._output(seq, token, logprob))
        return outputs

    def _launch(self, batch: ScheduledBatch) -> None:
        items = decode_first(batch.items)
        inputs = prepare_inputs(items, self.shape.block_size)
        if self.tp > 1:
            broadcast_step(inputs, self._steps_group)
        logits = self.runner.execute(inputs)
        requests = self._requests
        rows, ids = [], []
        prompt_tokens = 0
        for item in items:
            seq = item.seq
            if item.start < len(seq.prompt_ids):
                prompt_tokens += min(item.num_new, len(seq.prompt_ids) - item.start)
            if item.sample:
                row = requests[seq.request_id][2]
                row.output_index = len(seq.output_ids)
                rows.append(row)
                ids.append(seq.request_id)
        self._prompt_tokens += prompt_tokens
        self._in_flight = (batch, ids, self.sampler.launch(logits, rows))

    def _land(self) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """The step in flight, finished: its tokens appended (the scheduler drops those of
        sequences finished or aborted meanwhile), as (sequence, token, logprob) to output."""
        if self._in_flight is None:
            return []
        batch, ids, pending = self._in_flight
        self._in_flight = None
        result = pending.result()
        sampled = dict(zip(ids, result.token_ids))
        logprobs = dict(zip(ids, result.logprobs)) if any(result.logprobs) else {}
        self._generation_tokens += len(sampled)
        return [(seq, sampled[seq.request_id], logprobs.get(seq.request_id))
                for seq in self.scheduler.update(batch, sampled)]

    def _output(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        detok = self._requests[seq.request_id][1]
        finished = seq.status is SeqStatus.FINISHED
        new_ids = [token]
        if finished and seq.finish_reason == "stop":  # a stop id: not part of the text
            text, stop = "", None
        else:
            text, stop = detok.push(new_ids)
            if stop is not None and not finished:
                self.scheduler.finish(seq, "stop")
                finished = True
        if finished:
            if stop is None:
                text += detok.flush()
            del self._requests[seq.request_id]
        return RequestOutput(seq.request_id, new_ids, text, None if logprob is None else [logprob], finished,
                             seq.finish_reason, len(seq.prompt_ids), len(seq.output_ids), seq.num_cached_tokens)

    def stats(self) -> EngineStats:
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, self.blocks.usage,
                           self.shape.num_blocks, self.shape.block_size, self.blocks.prefix_queries,
                           self.blocks.prefix_hits, self._prompt_tokens, self._generation_tokens, self._preemptions)

    # ---------------------------------------------------------------- tensor parallelism
    def run_worker(self) -> None:
        """A tp rank other than 0: run the steps rank 0 sends until its shutdown()."""
        worker_loop(self.runner, self._steps_group)

    def shutdown(self) -> None:
        """Rank 0: release the other tp ranks (their run_worker returns)."""
        if self.tp > 1 and self.tp_rank == 0:
            broadcast_step(None, self._steps_group)

    # ---------------------------------------------------------------- start-up
    @torch.inference_mode()
    def _profile(self, max_num_batched_tokens: int, max_num_seqs: int, block_size: int) -> None:
        """On GPU, run the largest step the scheduler can make (a full token budget, logits for
        max_num_seqs rows) so that the peak it leaves is counted before the cache is sized."""
        if self.device.type != "cuda":
            return
        tokens = min(max_num_batched_tokens, self.max_model_len)
        blocks = -(-tokens // block_size)
        args = self.model.args
        shape = CacheShape(args.n_layers, blocks, block_size, args.n_kv_heads, args.resolved_head_dim, self.dtype)
        runner = ModelRunner(self.model, shape, self.device, self.max_model_len, cuda_graphs=False)
        inputs = StepInputs(
            token_ids=torch.zeros(tokens, dtype=torch.long), positions=torch.arange(tokens),
            slot_mapping=torch.arange(tokens), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
            context_lens=torch.tensor([tokens], dtype=torch.int32), query_start=torch.tensor([0, tokens], dtype=torch.int32),
            logits_indices=torch.arange(tokens - min(tokens, max_num_seqs), tokens), max_query_len=tokens,
            num_decodes=0, max_context_len=tokens, prefill_context=tokens)
        # The sampler's worst case too: every row with top-k and top-p sorts the vocabulary.
        worst = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=MAX_LOGPROBS)
        logits = runner.execute(inputs)
        self.sampler.sample(logits, [SampleRow(worst, 0, 0, []) for _ in range(len(logits))])
        del runner
        torch.cuda.synchronize(self.device)


class LLM:
    """The Python API: `LLM("Qwen/Qwen2-0.5B-Instruct").generate(["Hello"], SamplingParams(max_tokens=32))`."""

    def __init__(self, model: str | Path | None = None, **engine_options):
        self.engine = LLMEngine(model, **engine_options)

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | None = None) -> list[Completion]:
        params = params or self.engine.make_params()
        tokenizer = self.engine.tokenizer
        texts: dict[str, list[str]] = {}
        ids: dict[str, list[int]] = {}
        done: dict[str, RequestOutput] = {}
        order = []
        for i, prompt in enumerate(prompts):
            request_id = f"llm-{i}"
            prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.add_request(request_id, prompt_ids, params)
            texts[request_id], ids[request_id] = [], []
            order.append(request_id)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                texts[out.request_id].append(out.new_text)
                ids[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    done[out.request_id] = out
        return [Completion("".join(texts[r]), ids[r], done[r].finish_reason, done[r].num_prompt_tokens,
                           done[r].num_cached_tokens) for r in order]
