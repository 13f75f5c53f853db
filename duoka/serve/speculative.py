"""Speculative decoding in the engine (`--speculative-model DRAFT` or `--speculative-method
ngram`, with `--num-speculative-tokens K`): a step's decodes each verify up to K proposed
tokens in the same forward as everything else the step computes.

Per step:
1. The scheduler gives each running decode a lookahead of up to K cache slots past its next
   token (serve.scheduler: fewer near max_tokens or the context, none for constrained requests,
   none at all when more than --speculative-disable-by-batch-size requests are running).
2. The proposer (serve.proposers) drafts up to that many tokens per decode.
3. One forward of the model: each drafting sequence's last token and its drafts as decode rows
   (each row attends to its context up to itself: the decode kernel, and a CUDA graph when
   the step holds nothing else), beside the step's other decodes and prefill chunks.
4. The verification (serve.spec_verify) accepts a prefix of each sequence's drafts and adds
   one token after it. The scheduler appends them (a stop or eos among them ends the
   sequence there) and counts their K/V as computed: the rows of rejected drafts lie past
   num_computed, so their slots are written again by the next step, and the prefix cache,
   which registers only blocks full of computed tokens, never holds them.

A step in which no sequence got a draft runs exactly as without speculation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from duoka.serve.config import EngineConfig
from duoka.serve.proposers import DraftRequest, Proposer
from duoka.serve.runner import Piece, StepInputs, pieces_inputs
from duoka.serve.sampling import Sampler, SampleRow, TokenMasks
from duoka.serve.scheduler import ScheduledItem
from duoka.serve.spec_verify import PendingVerify, VerifyResult, VerifyRows, launch_verify
from duoka.serve.worker import Worker

# Builds the speculative proposer from the config and the started Worker (its draft runner):
# serve.proposers.default_proposer, or a benchmark's draft of controlled agreement.
ProposerFactory = Callable[[EngineConfig, Worker], Proposer]


@dataclass(frozen=True)
class SpecStep:
    """One step laid out for verification."""
    inputs: StepInputs
    verify: VerifyRows
    ids: list[str]
    """The sampled requests, in the order of the verification's items."""
    first_rows: list[int]
    """Each sampled request's first logits row (a constrained request's only one: its mask's row)."""


@dataclass
class SpecCounters:
    """Cumulative, as vLLM's spec_decode counters."""
    drafts: int = 0  # sequence-steps that verified at least one draft token
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of which accepted
    steps_off: int = 0  # steps that decoded plainly for the running batch's size


class Speculator:
    """The engine's side of speculative decoding: the proposer, the verification step's layout
    and launch, and the counters. row_of: a request id's sampling row (its output_index set)."""

    def __init__(self, proposer: Proposer, sampler: Sampler, block_size: int,
                 row_of: Callable[[str], SampleRow]):
        self.proposer = proposer
        self.sampler = sampler
        self.block_size = block_size
        self.row_of = row_of
        self.counters = SpecCounters()

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)

    def plan(self, items: list[ScheduledItem]) -> SpecStep | None:
        """The step with drafts for its items that have lookahead, or None when no draft came
        (the step then runs as a plain one)."""
        requests = [DraftRequest(item.seq, item.lookahead, self.row_of(item.seq.request_id))
                    for item in items if item.lookahead]
        if not requests:
            return None
        proposal = self.proposer.propose(requests)
        if not any(proposal.drafts):
            return None
        drafts, offsets, offset = {}, {}, 0
        for request, draft in zip(requests, proposal.drafts):
            drafts[request.seq.request_id] = draft
            offsets[request.seq.request_id] = offset
            offset += len(draft)
        pieces = []
        for item in items:
            seq = item.seq
            draft = drafts.get(seq.request_id, [])
            tokens = seq.all_ids[item.start:item.start + item.num_new]
            pieces.append(Piece(seq, item.start, tokens + draft, bool(draft), len(draft) + 1 if item.sample else 0))
        pieces.sort(key=lambda piece: not piece.decode_rows)  # decode rows first, else in order
        rows, row_drafts, spans, drawn, q_rows, ids, first_rows = [], [], [], [], [], [], []
        for piece in pieces:
            if not piece.logits:
                continue
            rid = piece.seq.request_id
            draft = drafts.get(rid, [])
            first = len(rows)
            rows += self._rows(self.row_of(rid), draft)
            row_drafts += draft + [-1]
            spans.append((first, len(draft) + 1))
            ids.append(rid)
            first_rows.append(first)
            if proposal.probs is not None and draft and not piece.seq.params.greedy:
                drawn += range(first, first + len(draft))
                q_rows += range(offsets[rid], offsets[rid] + len(draft))
        probs = None
        if drawn:
            probs = proposal.probs.index_select(0, torch.tensor(q_rows, device=proposal.probs.device))
        verify = VerifyRows(rows, row_drafts, spans, drawn, probs)
        return SpecStep(pieces_inputs(pieces, self.block_size), verify, ids, first_rows)

    @staticmethod
    def _rows(base: SampleRow, draft: list[int]) -> list[SampleRow]:
        """The request's rows for its last token and each draft: row j at output index
        base.output_index + j, with drafts[:j] counted as output (for the penalties)."""
        rows = [base]
        for j in range(1, len(draft) + 1):
            row = copy.copy(base)  # no __post_init__: the prompt's ids and the biases stay as built
            row.output_index = base.output_index + j
            if base.params.has_penalties:
                row.output_ids = list(base.output_ids) + draft[:j]
            rows.append(row)
        return rows

    def launch(self, logits: torch.Tensor, step: SpecStep, masks: TokenMasks | None) -> PendingVerify:
        return launch_verify(self.sampler, logits, step.verify, masks)

    def count(self, step: SpecStep, result: VerifyResult) -> None:
        counters = self.counters
        for (_, rows), accepted in zip(step.verify.spans, result.accepted):
            if rows > 1:
                counters.drafts += 1
                counters.draft_tokens += rows - 1
                counters.accepted_tokens += accepted
