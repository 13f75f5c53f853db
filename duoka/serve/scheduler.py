"""Continuous batching: which tokens of which sequences the model computes at each step.

The policy is vLLM v1's, first come first served, under one token budget per step
(max_num_batched_tokens) shared by prefills and decodes:

1. Running sequences, in admission order: a decode takes 1 token, an unfinished prefill
   its next chunk, min(remaining, budget). When one needs a block and none is free, the most
   recently admitted running sequence is preempted (possibly itself): its blocks are freed
   (their hashes stay, so its re-admission usually hits the prefix cache), num_computed = 0
   and it goes back to the FRONT of the waiting queue; its output tokens stay, so the
   recompute covers prompt + output and it carries on where it stopped.
2. Then, unless a preemption happened this step (blocks are short: admitting would only
   thrash), waiting sequences in arrival order while the budget, max_num_seqs and the free
   blocks last. A prompt longer than the remaining budget is chunked. The head of the queue
   that does not get blocks stops admission: nobody overtakes it, so nobody starves. So does
   a head whose sibling (Sequence.after: another choice of an n > 1 request) has not computed
   their shared prompt yet: admitted a step later, it finds the prompt's blocks cached. A
   request with prompt logprobs whose next blocks another such request is computing steps
   aside instead (the rest are admitted past it) and comes back to the front once they are
   cached with their entries: lm-eval's choices of one question share their context so.
3. A step that holds a decode computes at most max_prefill_beside_decodes prompt tokens
   (running chunks and admissions together; 0: no cap). A step's time grows with its tokens,
   and every stream waits for the whole step: the cap bounds the inter-token stall a newly
   arrived prompt causes, at the price of its own first token coming a step or two later.

A sequence of max_tokens 0 (scoring a prompt for its prompt logprobs) is scheduled like any
other, samples nothing, and finishes ("length") with the step that completes its prompt.

Termination: the engine refuses a request that could not fit in the whole cache on its own
(add() asserts it), and the first running sequence is never preempted by a later one, so
each step moves the oldest running sequence forward and every request finishes.

Pure Python and O(scheduled sequences) per step: the host runs this between model steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from duoka.serve.blocks import BlockManager
from duoka.serve.logprob_columns import PromptEntries
from duoka.serve.params import SamplingParams


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_NO_BLOCKS = np.zeros(0, dtype=np.int32)  # shared by sequences until their first blocks (never written)


class Sequence:
    """One request's tokens and its place in the cache.

    all_ids is one list (prompt then output) kept in step with output_ids by append_token:
    read or slice it, never rebuild it (a decode step would otherwise copy every token of
    every running sequence). num_computed counts the tokens whose K/V are in the cache; a
    running sequence always has num_computed < num_tokens (its last token is the next input).
    """

    __slots__ = ("request_id", "prompt_ids", "output_ids", "all_ids", "params", "status", "block_table",
                 "block_array", "num_computed", "num_cached_tokens", "arrival", "finish_reason", "num_preemptions",
                 "block_hashes", "num_registered_blocks", "adapter", "after", "generates", "prompt_logprob_rows",
                 "prompt_logprob_entries")

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float | None = None,
                 adapter: int = 0, after: Sequence | None = None):
        assert len(prompt_ids) >= 1, "a request has at least one prompt token"
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.all_ids = list(prompt_ids)
        self.params = params
        self.status = SeqStatus.WAITING
        self.block_table: list[int] = []
        self.block_array = _NO_BLOCKS  # BlockManager's: block_table as int32, with spare room
        self.num_computed = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at the first admission
        self.arrival = time.monotonic() if arrival is None else arrival
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # BlockManager's: hashes of the full blocks of all_ids
        self.num_registered_blocks = 0  # BlockManager's: leading table blocks already cached
        self.adapter = adapter  # the LoRA adapter this request runs with: 0 = the base model
        # A sibling (another choice of the same request, n > 1) whose prompt this one shares: it
        # is admitted only once that prompt is in the cache, to reuse its blocks, not compute them twice.
        self.after = after
        # max_tokens 0 (scoring): the prompt is computed, nothing is sampled, and it finishes then.
        self.generates = params.max_tokens > 0
        # Prompt rows (row p's logits give token p + 1's logprob) whose prompt logprobs are out,
        # computed or read with cached blocks (BlockManager), and their entries (row p's at p):
        # kept across preemption, so a recompute does not repeat them, and the blocks this
        # request registers keep the entries of their tokens for other scoring requests.
        self.prompt_logprob_rows = 0
        self.prompt_logprob_entries = (PromptEntries(len(prompt_ids) - 1, params.prompt_logprobs)
                                       if params.prompt_logprobs is not None else None)

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def owes_prompt_rows(self) -> bool:
        """Whether the request asks for prompt logprobs and some prompt row's are not out yet:
        the prefix cache serves it only blocks whose rows' entries it has or the cache kept."""
        return self.params.prompt_logprobs is not None and self.prompt_logprob_rows < len(self.prompt_ids) - 1

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.all_ids.append(token_id)

    def truncate_output(self, length: int) -> None:
        """Keep the first `length` output tokens of a finished sequence (a stop string ended it
        inside a run of accepted speculative tokens: the tokens after it never happened)."""
        assert self.status is SeqStatus.FINISHED and 0 <= length <= len(self.output_ids), (self, length)
        del self.all_ids[len(self.prompt_ids) + length:]
        del self.output_ids[length:]

    def __repr__(self):
        return (f"Sequence({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed}, blocks={len(self.block_table)})")


def _prompt_pending(seq: Sequence) -> bool:
    """Whether seq, unfinished, has not yet computed its whole prompt (a sibling waits for it)."""
    return seq.status is not SeqStatus.FINISHED and seq.num_computed < seq.num_prompt_tokens


@dataclass(slots=True)
class ScheduledItem:
    """Compute seq.all_ids[start:start + num_new] this step; sample a token after the last one
    when sample (the chunk reaches the end of a sequence that generates: not max_tokens 0).
    lookahead: cache slots held past those for up to that many speculative tokens (a decode
    only; the engine's proposer fills none, some or all of them)."""
    seq: Sequence
    start: int
    num_new: int
    sample: bool
    lookahead: int = 0


@dataclass
class ScheduledBatch:
    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Speculation is on but this step decodes plainly: too many requests are running.
    speculation_off: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new for item in self.items)


class Scheduler:
    """num_lookahead: speculative tokens per decode (K; 0: no speculation), in steps that start
    with at most speculate_max_running running sequences. max_prefill_beside_decodes: prompt
    tokens a step holding a decode computes at most (0: only the step's budget bounds them)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_ids: frozenset[int], num_lookahead: int = 0,
                 speculate_max_running: int = 0, max_prefill_beside_decodes: int = 0):
        assert max_num_seqs >= 1 and max_num_batched_tokens >= 1 and max_model_len >= 2
        assert max_prefill_beside_decodes >= 0
        self.max_prefill_beside_decodes = max_prefill_beside_decodes
        self.num_lookahead = num_lookahead
        self.speculate_max_running = speculate_max_running
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: preemption takes from the end
        self.requests: dict[str, Sequence] = {}  # unfinished ones, for abort

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, seq: Sequence) -> None:
        assert seq.status is SeqStatus.WAITING and not seq.block_table, seq
        assert seq.request_id not in self.requests, f"request id {seq.request_id!r} is already in flight"
        # The engine refuses what breaks these (DuokaError at add_request). They make
        # preemption terminate: a sequence alone in the cache always gets its blocks. A prompt
        # that generates nothing (max_tokens 0) may fill the whole context.
        assert seq.num_prompt_tokens + seq.generates <= self.max_model_len, (seq.num_prompt_tokens, self.max_model_len)
        longest = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        assert longest <= capacity, f"{seq.request_id}: {longest} tokens cannot fit in a cache of {capacity}"
        self.block_manager.hash_prompt(seq)
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish an unfinished request with "abort", freeing its blocks now. None if there is
        no such request in flight (unknown or already finished)."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish seq (e.g. the engine found a stop string). A sequence that finished already,
        in this same step, only takes the new reason: a stop string in the token that also
        reached max_tokens reports "stop", as vLLM does."""
        if seq.status is SeqStatus.FINISHED:
            seq.finish_reason = reason
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq, reason)

    def _release(self, seq: Sequence, reason: str) -> None:
        self.block_manager.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.request_id]

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        block_size = bm.block_size
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch()
        items = batch.items
        running = self.running
        speculate = self.num_lookahead if len(running) <= self.speculate_max_running else 0
        batch.speculation_off = self.num_lookahead > 0 and not speculate
        prefill = self._prefill_budget(budget)
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            start, num_tokens = seq.num_computed, len(seq.all_ids)
            decode = num_tokens - start == 1
            if not decode and prefill == 0:
                i += 1  # its next chunk waits for a step with prompt budget left
                continue
            end = min(num_tokens, start + (budget if decode else min(budget, prefill)))
            ahead = self._lookahead(seq, speculate, budget) if speculate and decode else 0
            # Blocks are asked for only past the table's end (most decodes fit in their last block).
            if end + ahead > len(seq.block_table) * block_size:
                if ahead and not bm.ensure_slots(seq, end - start + ahead):
                    # No free block for the lookahead: speculate only within the blocks held, never preempt for it.
                    ahead = max(0, len(seq.block_table) * block_size - end)
                if end + ahead > len(seq.block_table) * block_size and not self._make_room(seq, end - start, batch):
                    break  # seq preempted itself: it was the last one running
            items.append(ScheduledItem(seq, start, end - start, end == num_tokens and seq.generates, ahead))
            budget -= end - start + ahead
            if not decode:
                prefill -= end - start
            i += 1
        if batch.preempted:
            # Popped most recent first; pushed to the front one by one, they end up in their
            # original order ahead of everything that arrived later.
            self.waiting.extendleft(batch.preempted)
            return batch
        self._admit(batch, min(budget, prefill))
        return batch

    def _prefill_budget(self, budget: int) -> int:
        """Prompt tokens this step may compute: the cap when a running sequence decodes, else
        the whole budget (an idle server prefills at full speed)."""
        cap = self.max_prefill_beside_decodes
        if cap and any(len(seq.all_ids) - seq.num_computed == 1 for seq in self.running):
            return min(cap, budget)
        return budget

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Admit waiting sequences in arrival order while the budget, max_num_seqs and the free
        blocks last. A scoring request (prompt logprobs owed) whose next blocks a running or
        just admitted one is computing with entries of its k waits for them, a step or a few
        (serve.logprob_cache): the others are admitted past it meanwhile, then it goes back to
        the front."""
        bm, running, waiting = self.block_manager, self.running, self.waiting
        deferred: list[Sequence] = []
        in_flight = None  # block hash -> k of the prompt entries running requests will register
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            seq = waiting[0]
            if seq.after is not None:
                if _prompt_pending(seq.after):
                    break  # FCFS: its sibling's prompt lands in a step or two; then it reuses its blocks
                seq.after = None
            if seq.owes_prompt_rows and bm.enable_prefix_caching:
                in_flight = bm.entries_in_flight(running) if in_flight is None else in_flight
                if bm.waits_for_entries(seq, in_flight):
                    deferred.append(waiting.popleft())
                    continue
            num_new = bm.allocate(seq, budget)
            if num_new == 0:
                break  # FCFS: the head waits for blocks; nobody overtakes it
            waiting.popleft()
            seq.status = SeqStatus.RUNNING
            running.append(seq)
            batch.items.append(ScheduledItem(seq, seq.num_computed, num_new,
                                             seq.num_computed + num_new == seq.num_tokens and seq.generates))
            budget -= num_new
            if in_flight is not None and seq.owes_prompt_rows:
                bm.add_in_flight(seq, in_flight)
        waiting.extendleft(reversed(deferred))

    def _lookahead(self, seq: Sequence, speculate: int, budget: int) -> int:
        """Speculative tokens a decode may verify this step: none past max_tokens or the context
        (a step adds accepted + 1 tokens), none beyond the token budget, none for a constrained
        request (its grammar advances one token at a time)."""
        if seq.params.structured is not None or not seq.generates:
            return 0
        room = min(seq.params.max_tokens - len(seq.output_ids), self.max_model_len - len(seq.all_ids)) - 1
        return max(0, min(speculate, room, budget - 1))

    def _make_room(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Blocks for seq's next num_new tokens, preempting from the end of running while there
        are too few. Victims come from behind seq: sequences already scheduled this step (before
        seq) are never touched, so this step's items stay valid. False if seq itself was taken."""
        while not self.block_manager.ensure_slots(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)  # num_computed = 0, block_table emptied, hashes kept
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1

    def update(self, batch: ScheduledBatch, sampled: dict[str, int],
               accepted: dict[str, list[int]] | None = None) -> list[Sequence]:
        """Account for a finished model step: the items' K/V are in the cache, and sampled holds
        the token drawn for each item with sample=True; accepted, under speculation, the draft
        tokens the verification accepted before it (their K/V were computed too). Returns the
        sequences that got a token (finished ones included, with their finish_reason), and those
        that generate nothing (max_tokens 0) whose prompt this step completed: finished,
        "length", without a token."""
        register = self.block_manager.register_computed
        running = SeqStatus.RUNNING
        got_token = []
        finished = False
        for item in batch.items:
            seq = item.seq
            if seq.status is not running:
                continue  # aborted after schedule(): its blocks are gone, its token is dropped
            assert item.start == seq.num_computed, (item, seq)
            seq.num_computed += item.num_new
            reason = None
            if accepted and seq.request_id in accepted:
                reason = self._append_accepted(seq, accepted[seq.request_id])
            register(seq)
            # A prefill chunk (a decode holds no prompt row) of a request with prompt logprobs:
            # the engine took its rows' logprobs.
            if (item.num_new > 1 or not item.sample) and seq.params.prompt_logprobs is not None:
                seq.prompt_logprob_rows = max(seq.prompt_logprob_rows,
                                              min(seq.num_computed, seq.num_prompt_tokens - 1))
            if not item.sample:
                if not seq.generates and seq.num_computed == seq.num_tokens:
                    got_token.append(seq)
                    self._release(seq, "length")
                    finished = True
                continue
            got_token.append(seq)
            if reason is None:  # a stop among the accepted tokens drops the sampled one
                token = sampled[seq.request_id]
                seq.append_token(token)
                reason = self._stop_reason(seq, token)
                if reason is None:
                    continue
            self._release(seq, reason)
            finished = True
        if finished:  # one pass, not a list.remove per finished sequence
            self.running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        return got_token

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Why seq ends with `token` just appended: "stop" (an eos or stop id), "length", or None."""
        params = seq.params
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= params.max_tokens or len(seq.all_ids) >= self.max_model_len:
            return "length"
        return None

    def _append_accepted(self, seq: Sequence, tokens: list[int]) -> str | None:
        """Append accepted draft tokens one by one, as if each had been sampled in turn; each one's
        K/V is in the cache (the verify pass computed it), so num_computed follows. A stop among
        them ends the sequence there: the tokens after it are dropped, as plain decoding would
        never have made them."""
        for token in tokens:
            seq.append_token(token)
            seq.num_computed += 1
            reason = self._stop_reason(seq, token)
            if reason is not None:
                return reason
        return None
