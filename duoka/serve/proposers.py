"""Speculative decoding's proposers: what each speculating sequence's next tokens may be.

A proposer is asked, once per step, for up to k draft tokens for each of some running
sequences (each with its sampling row); the model then verifies them all in one forward
(serve.speculative, serve.spec_verify). Two proposers:

- NgramProposer (prompt lookup, `--speculative-method ngram`): the k tokens that followed the
  latest earlier occurrence of the sequence's last n tokens, n from prompt_lookup_max down to
  prompt_lookup_min. Its drafts are point masses: nothing is sampled.
- DraftModelProposer (`--speculative-model`): a small model of the same tokenizer run k times,
  each draft token drawn from q, the draft's distribution processed exactly as the request's
  own sampling processes the model's (penalties, temperature, min-p, top-k, top-p; greedy:
  the argmax), with noise of its own seed. Its cache lives block for block beside the
  model's (the same block tables), its K/V computed lazily: the first proposal for a sequence
  computes its whole context, later ones only what the model accepted since. The two
  vocabularies may differ (Qwen2-7B 152,064 rows, Qwen2-0.5B 151,936): the draft reads a
  context id past its own vocabulary as DRAFT_STAND_IN, and proposes only ids both have.

Neither decides what is emitted: the verification does, so a proposer's only effect on the
output is its speed (and, for a draft model's sampled requests, which draws are taken).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from duoka.data.tokenizer import Tokenizer, load_tokenizer
from duoka.errors import DuokaError
from duoka.serve.config import EngineConfig
from duoka.serve.runner import Piece, StepInputs, pieces_inputs
from duoka.serve.sampling import Sampler, SampleRow, mix64
from duoka.serve.scheduler import Sequence
from duoka.serve.worker import Worker

# The draft's noise comes from the request's seed mixed with this, so it is independent of the
# model's noise at the same output index (which the verification draws with).
DRAFT_SEED_SALT = 0x5EC_D7AF7
# A draft catch-up of at most this many tokens runs as decode rows, each with its logits: such a
# step (the usual one, 1 or 2 tokens per sequence) replays a CUDA graph. Longer ones run as a
# prefill chunk, whose attention reads the context once rather than once per token.
FLAT_CATCH_UP = 2
# What the draft reads in place of a context id past its vocabulary (the model sampled one of its
# extra rows, or a client sent it in a token-id prompt): any valid id, so the draft's embedding
# lookup stays in bounds. The verification decides the output: this only lowers the acceptance there.
DRAFT_STAND_IN = 0


@dataclass(frozen=True)
class DraftRequest:
    """Propose up to k tokens after seq's last token; row: the request's sampling row, its
    output_index the number of tokens generated so far."""
    seq: Sequence
    k: int
    row: SampleRow


@dataclass
class Proposal:
    drafts: list[list[int]]
    """Per request, at most its k tokens (none: nothing to propose this step)."""
    probs: torch.Tensor | None
    """fp32 [sum of the drafts' lengths, V], request-major: the distribution each draft token was
    drawn from (the model's vocabulary); None: every draft is a point mass (ngram)."""


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> Proposal: ...

    def forget(self, request_id: str) -> None:
        """The request has ended: drop what is kept for it."""


def ngram_proposal(ids: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens of `ids`,
    the longest n in [n_min, n_max] that occurs; [] when none does. An occurrence may overlap the
    suffix itself, but it ends before the last token, so at least one token follows it."""
    length = len(ids)
    if k < 1 or length < n_min + 1:
        return []
    # Candidate occurrence ends: earlier positions holding the last token (ascending).
    ends = np.flatnonzero(ids[:length - 1] == ids[-1])
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        valid = ends[ends >= n - 1]
        if not len(valid):
            continue
        windows = ids[valid[:, None] - np.arange(n - 1, -1, -1)[None, :]]
        match = np.flatnonzero((windows == ids[length - n:]).all(axis=1))
        if len(match):
            follow = int(valid[match[-1]]) + 1
            return ids[follow:follow + k].tolist()
    return []


class NgramProposer:
    """Prompt lookup over each sequence's tokens (prompt and output), kept as a growing int64
    array per request so that a step appends only its new tokens."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self._ids: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        return Proposal([ngram_proposal(self._array(r.seq), self.n_min, self.n_max, r.k) for r in requests], None)

    def _array(self, seq: Sequence) -> np.ndarray:
        buffer, length = self._ids.get(seq.request_id, (np.zeros(0, dtype=np.int64), 0))
        total = seq.num_tokens
        if total > len(buffer):  # doubling: appending stays amortised O(1) per token
            grown = np.zeros(max(total, 2 * len(buffer), 64), dtype=np.int64)
            grown[:length] = buffer[:length]
            buffer = grown
        buffer[length:total] = seq.all_ids[length:total]
        self._ids[seq.request_id] = (buffer, total)
        return buffer[:total]

    def forget(self, request_id: str) -> None:
        self._ids.pop(request_id, None)


@dataclass
class _DraftState:
    """What the draft's cache holds for a sequence: K/V of its first `computed` tokens, and at
    positions `pending_at`.. those of `pending` (the last proposal's drafts past the first),
    valid as far as the model accepted them, which the next proposal finds in seq.all_ids."""
    computed: int
    preemptions: int  # seq.num_preemptions then: a preemption gives the sequence new blocks
    pending_at: int = 0
    pending: tuple[int, ...] = ()


class DraftModelProposer:
    """execute: runs the draft model on StepInputs of its own and returns its logits [S, draft
    vocab] (Worker.execute_draft). vocab: the model's vocabulary, which the draft's logits are cut
    or padded to (Qwen2-0.5B has 151,936 rows, Qwen2-7B 152,064: both past the tokenizer's
    151,646 ids, so the extra rows are never real tokens). catch_up_budget: tokens of draft
    context computed per step at most (the model's token budget, so no draft step is larger
    than the profiled one); a sequence still catching up proposes nothing that step.
    draft_vocab: the draft's vocabulary (its embedding's rows), which its input ids must stay below."""

    def __init__(self, execute: Callable[[StepInputs], torch.Tensor], sampler: Sampler, block_size: int, vocab: int,
                 catch_up_budget: int, draft_vocab: int):
        self.execute = execute
        self.sampler = sampler
        self.block_size = block_size
        self.vocab = vocab
        self.catch_up_budget = catch_up_budget
        self.draft_vocab = draft_vocab
        self._state: dict[str, _DraftState] = {}

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        active, logits = self._first_step(requests)  # the requests whose context is caught up, their logits
        probs, where = [], {}  # each step's q, and (request, step) -> its row among all of them
        step_rows = self._rows(requests, active, drafts)
        self._take(self._q(logits, step_rows), step_rows, requests, active, drafts, probs, where, step=0)
        for step in range(1, max((requests[i].k for i in active), default=0)):
            active = [i for i in active if requests[i].k > step]
            pieces = [Piece(requests[i].seq, requests[i].seq.num_tokens + step - 1, [drafts[i][-1]], True, 1)
                      for i in active]
            step_rows = self._rows(requests, active, drafts)
            q = self._q(self._run(pieces), step_rows)
            self._take(q, step_rows, requests, active, drafts, probs, where, step)
        for i, r in enumerate(requests):
            if drafts[i]:  # positions n .. n + k - 2 now hold the draft K/V of all drafts but the last
                state = self._state[r.seq.request_id]
                state.pending_at, state.pending = r.seq.num_tokens, tuple(drafts[i][:-1])
        order = [where[i, j] for i in range(len(requests)) for j in range(len(drafts[i]))]
        if not order:
            return Proposal(drafts, None)
        stacked = torch.cat(probs)
        return Proposal(drafts, stacked.index_select(0, torch.tensor(order, device=stacked.device)))

    def choose(self, q: torch.Tensor, rows: list[SampleRow], requests: list[DraftRequest], active: list[int],
               step: int) -> torch.Tensor:
        """The draft tokens of one step, one per active request, drawn from q (a benchmark's
        stand-in overrides this to pick its own and report them as point masses)."""
        return self.sampler.race_log(q.log(), rows)

    def _first_step(self, requests: list[DraftRequest]) -> tuple[list[int], torch.Tensor | None]:
        """The draft's catch-up on each sequence's context, up to and including its last token,
        within the budget: the requests caught up (indices) and their last rows' logits."""
        pieces, proposing, budget = [], [], self.catch_up_budget
        for i, r in enumerate(requests):
            seq = r.seq
            start = self._computed(seq)
            count = min(seq.num_tokens - start, budget)
            if count <= 0:
                continue
            budget -= count
            done = start + count == seq.num_tokens
            pieces.append(Piece(seq, start, seq.all_ids[start:start + count], count <= FLAT_CATCH_UP,
                                (count if count <= FLAT_CATCH_UP else 1) if done else 0))
            # Its K/V up to the last token are in once this step runs; a proposal adds pending ones.
            self._state[seq.request_id] = _DraftState(start + count, seq.num_preemptions)
            if done:
                proposing.append(i)
        if not proposing:
            if pieces:  # catch-up only: no logits wanted
                self._run(sorted(pieces, key=lambda piece: not piece.decode_rows))
            return [], None
        pieces.sort(key=lambda piece: not piece.decode_rows)  # decode rows first (stable)
        logits = self._run(pieces)
        # Each proposing piece's last logits row, in the pieces' order; back to the requests' order.
        ends, row = {}, 0
        for piece in pieces:
            row += piece.logits
            if piece.logits:
                ends[piece.seq.request_id] = row - 1
        index = torch.tensor([ends[requests[i].seq.request_id] for i in proposing], device=logits.device)
        return proposing, logits.index_select(0, index)

    def _run(self, pieces: list[Piece]) -> torch.Tensor:
        """The draft's logits for pieces (decode-row pieces first), its K/V written to the slots
        of the pieces' positions: the cache stays block for block the model's."""
        inputs = pieces_inputs(pieces, self.block_size)
        # Only the draft's input changes, never the sequence: ids past the draft's vocabulary read
        # DRAFT_STAND_IN (in place: pieces_inputs built the tensor for this step alone).
        inputs.token_ids.masked_fill_(inputs.token_ids >= self.draft_vocab, DRAFT_STAND_IN)
        return self.execute(inputs)

    def _computed(self, seq: Sequence) -> int:
        """How many leading tokens of seq have their draft K/V in the cache."""
        state = self._state.get(seq.request_id)
        if state is None or state.preemptions != seq.num_preemptions:
            return 0
        computed = state.computed
        if state.pending:
            # The model accepted a prefix of the pending drafts: their K/V are the draft's own.
            ahead = seq.all_ids[state.pending_at:state.pending_at + len(state.pending)]
            computed = state.pending_at + next((j for j, (a, b) in enumerate(zip(ahead, state.pending)) if a != b),
                                               min(len(ahead), len(state.pending)))
        assert computed <= seq.num_computed, (seq, computed)
        return computed

    def _rows(self, requests: list[DraftRequest], active: list[int], drafts: list[list[int]]) -> list[SampleRow]:
        """Each active request's row for its next draft token: the request's own processing, at
        the output index that token would take, counting the drafts before it as output (for the
        penalties), with the draft's seed."""
        rows = []
        for i in active:
            base = requests[i].row
            row = copy.copy(base)  # no __post_init__: the prompt's ids and the biases stay as built
            row.seed = mix64(base.seed ^ DRAFT_SEED_SALT)
            row.output_index = base.output_index + len(drafts[i])
            if drafts[i] and base.params.has_penalties:
                row.output_ids = list(base.output_ids) + drafts[i]
            rows.append(row)
        return rows

    def _q(self, logits: torch.Tensor | None, rows: list[SampleRow]) -> torch.Tensor | None:
        """The draft's processed distributions over the model's vocabulary, zero past the first
        min(draft vocab, model vocab) ids: the draft proposes only ids both models have, and q is
        the distribution its tokens are drawn from (Leviathan's test and residual read it)."""
        if logits is None or not rows:
            return None
        width = logits.shape[1]
        if width > self.vocab:  # ids the model does not have are never proposed (nor verified)
            logits = logits[:, :self.vocab]
        elif width < self.vocab:  # nor the model's extra ids, which the draft has no logits for
            logits = torch.cat([logits, logits.new_full((len(logits), self.vocab - width), float("-inf"))], dim=1)
        return self.sampler.probabilities(self.sampler.processed(logits, rows), rows)

    def _take(self, q: torch.Tensor | None, rows: list[SampleRow], requests: list[DraftRequest], active: list[int],
              drafts: list[list[int]], probs: list[torch.Tensor], where: dict, step: int) -> None:
        """Draw the step's tokens from q and append them to the active requests' drafts."""
        if q is None:
            return
        tokens = self.choose(q, rows, requests, active, step).tolist()  # the step's one host synchronisation
        base = sum(len(p) for p in probs)
        probs.append(q)
        for j, (i, token) in enumerate(zip(active, tokens)):
            drafts[i].append(int(token))
            where[i, step] = base + j


def check_draft_tokenizer(tokenizer: Tokenizer, draft_folder, model_folder) -> None:
    """Refuse a draft whose tokenizer is not the model's: its token ids would mean other text, and
    its proposals would all be rejected (or worse, accepted as other words)."""
    try:
        draft = load_tokenizer(draft_folder)
    except DuokaError as e:
        raise DuokaError(f"the speculative draft {draft_folder} has no usable tokenizer ({e.cause})",
                         f"copy the tokenizer files of {model_folder} into it if it is of the same family, "
                         "or use a draft that shares the model's tokenizer") from None
    if draft.vocabulary() != tokenizer.vocabulary():
        raise DuokaError(f"the speculative draft {draft_folder} has another tokenizer than {model_folder} "
                         f"({draft.vocab_size} tokens against {tokenizer.vocab_size}, or the same ids for other "
                         "tokens)", "use a draft of the same family that shares the model's tokenizer (e.g. "
                         "Qwen2-0.5B-Instruct for Qwen2-7B-Instruct), or --speculative-method ngram")


def default_proposer(config: EngineConfig, worker: Worker) -> Proposer:
    """The proposer of config's speculative method (LLMEngine's default proposer_factory)."""
    if config.speculation == "ngram":
        return NgramProposer(*config.prompt_lookup)
    return DraftModelProposer(worker.execute_draft, worker.sampler, config.block_size, worker.args.vocab_size,
                              config.max_num_batched_tokens, worker.draft_args.vocab_size)
