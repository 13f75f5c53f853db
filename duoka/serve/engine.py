"""The serving engine: one loop under `duoka generate`, `duoka serve` and the Python API.

Every step the scheduler picks which sequences run and how many of their tokens (prefill
chunks and one-token decodes together, under a token budget), the worker (serve.worker: the
model, its paged KV cache, the sampler) computes their logits and samples each sequence's
next token on the device, and the detokenizer turns tokens into text and finds stop
strings. Requests join and leave between any two steps.

The engine is built from an EngineConfig (serve.config). Under tensor parallelism it runs on
rank 0 only, its Worker sending each step to the other ranks' Workers.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import torch.distributed as dist

from duoka.data.tokenizer import Tokenizer, load_tokenizer
from duoka.errors import DuokaError
from duoka.serve.blocks import BlockManager
from duoka.serve.config import EngineConfig
from duoka.serve.detok import IncrementalDetokenizer
from duoka.serve.params import RequestOutput, SamplingParams, TokenLogprob
from duoka.serve.prompt_logprobs import prompt_rows
from duoka.serve.proposers import check_draft_tokenizer, default_proposer
from duoka.serve.runner import CacheShape, ModelRunner, decode_first, prepare_inputs
from duoka.serve.sampling import SampleRow
from duoka.serve.scheduler import ScheduledBatch, Scheduler, SeqStatus, Sequence
from duoka.serve.spec_verify import VerifyResult
from duoka.serve.speculative import ProposerFactory, SpecStep, Speculator
from duoka.serve.structured import GrammarRows
from duoka.serve.worker import RunnerFactory, Worker

BUNDLED_MODEL_NAME = "duoka-tiny-qwen2"  # what clients call the model served when none is named

# An engine whose only requests wait for their grammars sleeps this long per step, not spinning.
GRAMMAR_WAIT_S = 0.02
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
    # Speculative decoding (cumulative; 0 without it), as vLLM's spec_decode counters:
    spec_drafts: int = 0  # sequence-steps that verified at least one draft token
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # of which the model accepted
    spec_steps_off: int = 0  # steps decoded plainly: more requests running than speculative_disable_by_batch_size
    # Requests with prompt logprobs that computed cached blocks again, the blocks carrying no
    # stored entries of their k (cumulative), and those blocks' tokens:
    logprob_bypass_requests: int = 0
    logprob_bypass_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted draft tokens over draft tokens verified (0 before any)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a speculating sequence gains per verification: 1 + accepted per draft (vLLM's
        mean acceptance length, the token after the accepted ones included; 0 before any)."""
        return 1 + self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else 0.0


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
        # logit_bias is sorted by token id: its last id is the largest.
        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab_size:
            raise DuokaError(f"logit_bias token id {params.logit_bias[-1][0]} is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})", "bias token ids of this model's tokenizer")


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def lora_slot(names: tuple[str, ...], lora: str | None) -> int:
    """The slot of adapter `lora` among the served adapters `names` (1..n in order); 0 for None,
    the base model. Shared by the engine and its process's server side (the same refusal)."""
    if lora is None:
        return 0
    if lora in names:
        return names.index(lora) + 1
    raise DuokaError(f"LoRA adapter {lora!r} is not served here (served: {', '.join(names) or 'none'})",
                     "use one of the served adapters' names, or start the server with --lora NAME=DIR")


class LLMEngine:
    """Serves requests step by step from an EngineConfig: the scheduler, the block manager and
    the output processing (detokenizer, stop strings) here, the model in its Worker (rank 0's,
    under tensor parallelism: the other ranks run serve.worker.run_worker).

    tp_group: the tensor-parallel group, when config.tp > 1 (default: the whole world).
    runner_factory: builds the Worker's runner (serve.worker.RunnerFactory; a benchmark of
    the host's work passes one whose execute returns logits without a model).
    proposer_factory: builds the speculative proposer from the config and the started Worker
    (under speculation; a benchmark passes a draft of controlled agreement)."""

    def __init__(self, config: EngineConfig, *, tp_group: dist.ProcessGroup | None = None, log=_log,
                 runner_factory: RunnerFactory = ModelRunner, proposer_factory: ProposerFactory = default_proposer):
        self.config = config
        self.log = log
        worker = self.worker = Worker(config, tp_group=tp_group, log=log, runner_factory=runner_factory)
        if worker.rank != 0:
            raise RuntimeError("an LLMEngine runs on rank 0 of its tensor-parallel group; the other ranks run "
                               "serve.worker.run_worker")
        self.folder, self.device, self.dtype = worker.folder, worker.device, worker.dtype
        self.max_model_len = worker.max_model_len
        self.model_name = config.served_model_name or str(config.model or BUNDLED_MODEL_NAME)
        # The --lora adapters as (name, folder), in slot order (slot i + 1; 0 is the base model).
        self.loras: tuple[tuple[str, str], ...] = config.loras
        self.lora_names: tuple[str, ...] = tuple(name for name, _ in config.loras)
        if self.model_name in self.lora_names:  # a request's model field must name one model
            raise DuokaError(f"--lora {self.model_name} has the name the base model is served under",
                             "give the adapter another name, or the base one with --served-model-name")
        # Before the load, which takes minutes for a large model: a folder without a tokenizer fails at once.
        self.tokenizer: Tokenizer = load_tokenizer(self.folder)
        if worker.draft_folder is not None:
            check_draft_tokenizer(self.tokenizer, worker.draft_folder, self.folder)
        worker.start()
        self.shape: CacheShape = worker.shape
        args = worker.args
        for warning in self.tokenizer.warnings(args.vocab_size):
            log(f"duoka: warning: {warning}")

        stop_ids = self.tokenizer.stop_ids()
        if not stop_ids and args.eos_token_id is not None:
            stop_ids = {args.eos_token_id} if isinstance(args.eos_token_id, int) else set(args.eos_token_id)
        self.eos_ids = frozenset(stop_ids)
        self.blocks = BlockManager(self.shape.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   self.eos_ids, config.num_speculative_tokens or 0,
                                   config.speculative_disable_by_batch_size, config.max_prefill_beside_decodes)
        self.speculator = None
        if config.speculation is not None:
            self.speculator = Speculator(proposer_factory(config, worker), worker.sampler, self.shape.block_size,
                                         lambda request_id: self._requests[request_id][2])
        self.vocab_size = args.vocab_size
        self.limits = RequestLimits(args.vocab_size, self.max_model_len, self.shape.block_size, self.shape.num_blocks)
        gen = self.tokenizer.generation_config
        self.default_params = {k: gen[k] for k in GENERATION_CONFIG_KEYS if k in gen}
        self._seeds = random.Random(config.seed)
        # Constrained requests (structured output) wait here until their grammar has compiled.
        self.grammars = GrammarRows(self.tokenizer, args.vocab_size, self.eos_ids)
        self._compiling: list[Sequence] = []
        self._accepts: list[tuple[Sequence, int]] = []  # landed tokens of constrained requests, not yet accepted
        # id -> (seq, detok, its sampling row: params and seed fixed, output_index set each step)
        self._requests: dict[str, tuple[Sequence, IncrementalDetokenizer, SampleRow]] = {}
        self._aborted: list[RequestOutput] = []
        # The launched step: (batch, sampled request ids, PendingSample or None, PendingPromptLogprobs or None).
        self._in_flight: tuple | None = None
        # Requests with prompt_logprobs, until their first output (their entries gather on their
        # Sequence). Empty (the common case), a step looks for no prompt rows.
        self._scoring: set[str] = set()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._preemptions = 0
        self._spec_steps_off = 0

    # ---------------------------------------------------------------- requests
    def make_params(self, **overrides) -> SamplingParams:
        """SamplingParams from the model's generation_config.json defaults and the request's fields."""
        known = {f.name for f in fields(SamplingParams)}
        return SamplingParams(**{**self.default_params, **{k: v for k, v in overrides.items() if k in known}})

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    lora: str | None = None, after: str | None = None) -> None:
        """lora: the name of a --lora adapter to run the request with (None: the base model).
        after: a running request whose prompt this one repeats (another of its n choices): this
        one waits for that prompt's blocks and reuses them."""
        if request_id in self._requests:
            raise DuokaError(f"request id {request_id!r} is already running", "give each request its own id")
        self.limits.check(prompt_ids, params)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        sibling = self._requests.get(after)[0] if after in self._requests else None
        seq = Sequence(request_id, list(prompt_ids), params, adapter=self.adapter_index(lora), after=sibling)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, stop=params.stop)
        if params.prompt_logprobs is not None:
            self._scoring.add(request_id)
        if params.structured is not None:
            self.grammars.submit(request_id, params.structured)
            self._compiling.append(seq)
        else:
            self.scheduler.add(seq)
        # The row reads seq.output_ids, the list itself (it only grows), for the penalties;
        # until min_tokens are generated, the stop ids cannot be sampled.
        blocked = (set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
                   if params.min_tokens else ())
        self._requests[request_id] = (seq, detok, SampleRow(params, seed, 0, seq.output_ids, seq.prompt_ids,
                                                            tuple(sorted(blocked))))

    def adapter_index(self, lora: str | None) -> int:
        """The index of adapter `lora` in the model's adapter slots (1..n, --lora's order); 0,
        for None, is the base model. An unknown name is refused, naming the loaded ones."""
        return lora_slot(self.lora_names, lora)

    def abort(self, request_id: str) -> None:
        """Free the request's blocks now; its final output (finish_reason "abort") comes with the next step."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        seq = entry[0]
        self.scheduler.abort(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)
        self.grammars.drop(request_id)
        self._scoring.discard(request_id)
        if seq in self._compiling:
            self._compiling.remove(seq)
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
        if self._compiling:
            outputs += self._admit_compiled()
        batch: ScheduledBatch = self.scheduler.schedule()
        self._preemptions += len(batch.preempted)
        self._spec_steps_off += batch.speculation_off
        if batch.items:
            self._launch(batch)
        if self._accepts:  # no step launched: the grammars still advance
            self._accept_landed()
        if not batch.items and self._compiling and self._in_flight is None and not landed:
            self.grammars.wait(GRAMMAR_WAIT_S)  # nothing to run until a grammar compiles: no busy loop
        requests = self._requests
        for seq, tokens, logprobs in landed:
            if seq.request_id in requests:  # not aborted since
                outputs.append(self._output(seq, tokens, logprobs))
        return outputs

    def _launch(self, batch: ScheduledBatch) -> None:
        items = decode_first(batch.items)
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
        prompt = prompt_rows(items) if self._scoring else None
        # Speculation stays out of a step that scores prompt rows (their rows follow the plain layout).
        spec = self.speculator.plan(items) if self.speculator is not None and prompt is None else None
        if spec is not None:
            self._launch_verify(batch, spec)
            return
        inputs = prepare_inputs(items, self.shape.block_size)
        scored = None
        if prompt is None:  # under tensor parallelism, the step is sent to the other ranks first
            logits = self.worker.execute(inputs)
        else:
            logits, scored = self.worker.execute_with_prompt(inputs, prompt)
        # The grammars advance and the constrained rows' masks are filled on the host while the
        # device runs the forward (a JSON mask: ~10-40 us a row for Qwen2's vocabulary).
        if self._accepts:
            self._accept_landed()
        masks = self.grammars.fill(list(enumerate(ids))) if self.grammars else None
        # A step of prompts that generate nothing (max_tokens 0) samples nothing.
        sample = self.worker.sample(logits, rows, masks) if rows else None
        self._in_flight = (batch, ids, sample, scored)

    def _launch_verify(self, batch: ScheduledBatch, spec: SpecStep) -> None:
        """A speculative step: the forward over every row, then the verification on the device."""
        logits = self.worker.execute(spec.inputs)
        if self._accepts:
            self._accept_landed()
        masks = self.grammars.fill(list(zip(spec.first_rows, spec.ids))) if self.grammars else None
        self._in_flight = (batch, spec.ids, self.speculator.launch(logits, spec, masks), None, spec)

    def _land(self) -> list[tuple[Sequence, list[int], list[TokenLogprob] | None]]:
        """The step in flight, finished: its tokens appended (the scheduler drops those of
        sequences finished or aborted meanwhile), as (sequence, tokens, logprobs) to output."""
        if self._in_flight is None:
            return []
        batch, ids, pending, scored, *spec = self._in_flight
        self._in_flight = None
        if spec:
            return self._land_verified(batch, ids, pending.result(), spec[0])
        sampled, logprobs = {}, {}
        if pending is not None:
            result = pending.result()
            sampled = dict(zip(ids, result.token_ids))
            logprobs = dict(zip(ids, result.logprobs)) if any(result.logprobs) else {}
        if scored is not None:
            for span, entries in scored.result():
                if span.seq.status is SeqStatus.RUNNING:  # not aborted since
                    span.seq.prompt_logprob_entries.append(entries)
        self._generation_tokens += len(sampled)
        # A request that generates nothing lands once, without a token, when its prompt is done.
        landed = []
        for seq in self.scheduler.update(batch, sampled):
            token, logprob = sampled.get(seq.request_id), logprobs.get(seq.request_id)
            landed.append((seq, [] if token is None else [token], None if logprob is None else [logprob]))
        self._grammar_accepts(landed)
        return landed

    def _land_verified(self, batch: ScheduledBatch, ids: list[str], result: VerifyResult,
                       spec: SpecStep) -> list[tuple[Sequence, list[int], list[TokenLogprob] | None]]:
        """A speculative step's landing: each sequence's accepted drafts and the token after them."""
        self.speculator.count(spec, result)
        sampled = {rid: tokens[-1] for rid, tokens in zip(ids, result.token_ids)}
        accepted = {rid: tokens[:-1] for rid, tokens in zip(ids, result.token_ids) if len(tokens) > 1}
        logprobs = dict(zip(ids, result.logprobs))
        landed, requests = [], self._requests
        for seq in self.scheduler.update(batch, sampled, accepted):
            # What the scheduler appended: a stop or eos among the accepted drafts cut the rest.
            tokens = seq.output_ids[requests[seq.request_id][2].output_index:] if seq.request_id in sampled else []
            lps = logprobs.get(seq.request_id)
            landed.append((seq, tokens, None if lps is None else lps[:len(tokens)]))
            self._generation_tokens += len(tokens)
        self._grammar_accepts(landed)
        return landed

    def _grammar_accepts(self, landed: list[tuple[Sequence, list[int], list | None]]) -> None:
        if self.grammars:  # advanced in the next _launch, while the device runs its forward
            self._accepts = [(seq, token) for seq, tokens, _ in landed if seq.request_id in self.grammars
                             for token in tokens]

    def _accept_landed(self) -> None:
        """Advance the constrained requests' grammars by their landed tokens. A grammar that has
        ended (its stop token taken, even under ignore_eos) ends its request; if that request
        was scheduled again meanwhile, the token of that step is dropped, as for a stop string."""
        accepts, self._accepts = self._accepts, []
        grammars = self.grammars
        for seq, token in accepts:
            if seq.request_id in grammars and grammars.accept(seq.request_id, token) \
                    and seq.status is not SeqStatus.FINISHED:
                self.scheduler.finish(seq, "stop")

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand the requests whose grammar has compiled to the scheduler, in arrival order; a
        grammar that failed to compile ends its request (the API checked it, so this is rare)."""
        waiting, outputs = [], []
        for seq in self._compiling:
            try:
                if not self.grammars.ready(seq.request_id):
                    waiting.append(seq)
                    continue
            except DuokaError as e:
                self.log(f"duoka: request {seq.request_id}: {e.cause}")
                self._requests.pop(seq.request_id, None)
                self._scoring.discard(seq.request_id)
                self.grammars.drop(seq.request_id)
                outputs.append(RequestOutput(seq.request_id, [], "", None, True, "abort", seq.num_prompt_tokens, 0, 0))
                continue
            self.scheduler.add(seq)
        self._compiling = waiting
        return outputs

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
        """The output of one step's landed tokens (none: a prompt that generates nothing is done)."""
        detok = self._requests[seq.request_id][1]
        finished = seq.status is SeqStatus.FINISHED
        # A sequence that landed finished with "stop" ends with its stop id: not part of the text.
        text_ids = tokens[:-1] if finished and seq.finish_reason == "stop" else tokens
        text, stop = "", None
        for i, token in enumerate(text_ids):  # one at a time: a stop string ends the output at its token
            piece, stop = detok.push([token])
            text += piece
            if stop is not None:
                cut = len(tokens) - i - 1  # accepted speculative tokens after it, which never happened
                # A sequence that finished with this very token keeps its reason (a length reached too).
                if not finished or cut:
                    self.scheduler.finish(seq, "stop")
                    finished = True
                if cut:
                    seq.truncate_output(len(seq.output_ids) - cut)
                    self._generation_tokens -= cut
                    tokens = tokens[:i + 1]
                    logprobs = None if logprobs is None else logprobs[:i + 1]
                break
        if finished:
            if stop is None:
                text += detok.flush()
            del self._requests[seq.request_id]
            self.grammars.drop(seq.request_id)
            if self.speculator is not None:
                self.speculator.forget(seq.request_id)
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None and len(seq.output_ids) <= len(tokens):  # its first output
            self._scoring.discard(seq.request_id)
            prompt_logprobs = seq.prompt_logprob_entries.columns()
        return RequestOutput(seq.request_id, tokens, text, logprobs, finished, seq.finish_reason, len(seq.prompt_ids),
                             len(seq.output_ids), seq.num_cached_tokens, prompt_logprobs)

    def stats(self) -> EngineStats:
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, self.blocks.usage,
                           self.shape.num_blocks, self.shape.block_size, self.blocks.prefix_queries,
                           self.blocks.prefix_hits, self._prompt_tokens, self._generation_tokens, self._preemptions,
                           *self._spec_figures(), self.blocks.logprob_bypass_requests,
                           self.blocks.logprob_bypass_tokens)

    def _spec_figures(self) -> tuple[int, int, int, int]:
        if self.speculator is None:
            return 0, 0, 0, 0
        c = self.speculator.counters
        return c.drafts, c.draft_tokens, c.accepted_tokens, self._spec_steps_off

    def shutdown(self) -> None:
        """Release the other tensor-parallel ranks (their run_worker returns); nothing at tp 1."""
        self.grammars.close()
        self.worker.shutdown()


class LLM:
    """The Python API: `LLM("Qwen/Qwen2-0.5B-Instruct").generate(["Hello"], SamplingParams(max_tokens=32))`.
    options: EngineConfig's fields (docs/serving.md lists them); a name that is none of them is
    refused. tp_group, log and runner_factory are LLMEngine's."""

    def __init__(self, model: str | Path | None = None, *, tp_group: dist.ProcessGroup | None = None, log=_log,
                 runner_factory: RunnerFactory = ModelRunner, **options):
        config = EngineConfig.from_options(model=model, **options)
        self.engine = LLMEngine(config, tp_group=tp_group, log=log, runner_factory=runner_factory)

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
