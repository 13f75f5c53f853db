"""Speculative decoding's verification, on the device: which draft tokens the model accepts,
and the token after them, from the logits of one forward over every sequence's last token and
its drafts (row j of a sequence: the distribution of its token at output index o + j).

Each row is first processed exactly as plain sampling processes it (serve.sampling: masks,
bias, min_tokens, penalties counting the drafts before it as output, then temperature, min-p,
top-k, top-p), and its own draw t_j taken, with plain sampling's noise for that output index.
Then, per row with a draft d_j:

- a point-mass draft (ngram; any greedy request): accept iff d_j == t_j. For greedy rows t_j is
  the argmax: the output is plain greedy decoding's, token for token. For a sampled row this is
  Leviathan et al.'s rule for q = the point mass at d_j: accepted with probability
  min(1, p(d_j) / 1) = p(d_j), and on rejection t_j is a draw from p given t_j != d_j, i.e.
  from norm(max(0, p - q)). It is even plain seeded sampling's own draw.
- a draft model's sampled row (d_j drawn from q_j): Leviathan et al. 2023, accept iff
  u * q_j(d_j) < p_j(d_j), u ~ U(0, 1) from the row's key; on rejection a draw from
  norm(max(0, p_j - q_j)), with the row's noise.

A sequence's emitted tokens are its accepted prefix of drafts and, at the first rejected row
(or the last row, which has no draft), that row's token: the rejection's draw, or t_j. The
host reads all rows' figures in one synchronisation and walks each sequence's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from duoka.serve.params import TokenLogprob
from duoka.serve.sampling import HostCopy, Sampler, SampleRow, TokenMasks, to_device, uniform_noise


@dataclass(frozen=True)
class VerifyRows:
    """The rows of one verification, in the order of the logits' rows."""
    rows: list[SampleRow]
    """One per row: the request's row at the row's output index (drafts before it in output_ids)."""
    drafts: list[int]
    """One per row: the draft token it checks; -1 on each item's last row, which has none."""
    spans: list[tuple[int, int]]
    """Per item (sampled sequence): its first row and its number of rows (its drafts + 1)."""
    drawn: list[int]
    """The rows whose draft was drawn from a distribution (a draft model's, for a sampled
    request): Leviathan's test with draft_probs. Every other draft is a point mass."""
    draft_probs: torch.Tensor | None
    """fp32 [len(drawn), V] on the device: the distributions those drafts were drawn from."""


@dataclass
class VerifyResult:
    token_ids: list[list[int]]
    """Per item: the accepted drafts, then the token after them."""
    accepted: list[int]
    """Per item: how many of its drafts were accepted."""
    logprobs: list[list[TokenLogprob] | None]
    """Per item: each emitted token's logprob (for requests that ask), else None."""


class PendingVerify:
    """A launched verification; result() waits for it (one host synchronisation)."""

    def __init__(self, packed: torch.Tensor, plan: VerifyRows, want: list[int], top_k: int):
        self.plan, self.want, self.top_k = plan, want, top_k
        self.copy = HostCopy(packed)

    def result(self) -> VerifyResult:
        host = self.copy.values()
        plan, R = self.plan, len(self.plan.rows)
        accept, emit = host[:R], host[R:2 * R]
        figures = self._logprob_figures(host[2 * R:])
        tokens, accepted, logprobs = [], [], []
        for first, count in plan.spans:
            a = 0
            while a < count - 1 and accept[first + a]:
                a += 1
            out = plan.drafts[first:first + a] + [int(emit[first + a])]
            tokens.append(out)
            accepted.append(a)
            want = plan.rows[first].params.logprobs
            if want is None:
                logprobs.append(None)
                continue
            entries = []
            for j, token in enumerate(out):
                lp_draft, lp_emit, top = figures[first + j]
                entries.append(TokenLogprob(token, lp_emit if j == a else lp_draft, top[:want]))
            logprobs.append(entries)
        return VerifyResult(tokens, accepted, logprobs)

    def _logprob_figures(self, host: list) -> dict[int, tuple[float, float, list[tuple[int, float]]]]:
        """Row -> (logprob of its draft, of its emitted token, its top alternatives)."""
        n, k = len(self.want), self.top_k
        values, ids = host[2 * n:2 * n + n * k], host[2 * n + n * k:]
        return {row: (host[j], host[n + j], [(int(t), v) for t, v in zip(ids[j * k:(j + 1) * k],
                                                                          values[j * k:(j + 1) * k])])
                for j, row in enumerate(self.want)}


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


@torch.inference_mode()
def launch_verify(sampler: Sampler, logits: torch.Tensor, plan: VerifyRows,
                  masks: TokenMasks | None = None) -> PendingVerify:
    """logits [R, V] fp32, one row per plan row -> the verification, queued on the device
    without waiting. masks: the constrained rows' allowed tokens (row indices of the plan)."""
    if logits.shape[0] != len(plan.rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(plan.rows)} verification rows")
    device = logits.device
    rows = plan.rows
    processed = sampler.processed(logits, rows, masks)
    target = sampler.draw(processed, rows)  # each row's own draw: plain sampling's at its output index
    drafts = _upload(plan.drafts, torch.int64, device)
    accept = drafts == target
    emit = target
    if plan.drawn:
        index = _upload(plan.drawn, torch.int64, device)
        drawn_rows = [rows[i] for i in plan.drawn]
        p = sampler.probabilities(processed.index_select(0, index), drawn_rows)
        q = plan.draft_probs
        d = drafts.index_select(0, index)[:, None]
        u = uniform_noise(sampler.row_keys(drawn_rows, device))
        ok = u * q.gather(1, d)[:, 0] < p.gather(1, d)[:, 0]
        residual = (p - q).clamp_min_(0)
        # A rejection implies p(d) < q(d), so the residual has mass; only rounding could leave
        # none (p == q up to the last bit), where p itself is the same distribution.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
        redraw = sampler.race_log(residual.log(), drawn_rows)
        accept = accept.index_copy(0, index, ok)
        emit = emit.index_copy(0, index, redraw)
    packed = [accept.double(), emit.double()]
    # Logprobs (of the processed logits, before temperature, as plain sampling's): every row of
    # the items that ask, both for its draft and for its own emitted token.
    want = [r for first, count in plan.spans if rows[first].params.logprobs is not None
            for r in range(first, first + count)]
    top_k = max((rows[r].params.logprobs for r in want), default=0)
    if want:
        index = _upload(want, torch.int64, device)
        logprobs = torch.log_softmax(processed.index_select(0, index), dim=-1)
        packed.append(logprobs.gather(1, drafts.index_select(0, index).clamp_min(0)[:, None])[:, 0].double())
        packed.append(logprobs.gather(1, emit.index_select(0, index)[:, None])[:, 0].double())
        if top_k:
            top_values, top_ids = logprobs.topk(top_k, dim=-1)
            packed += [top_values.double().flatten(), top_ids.double().flatten()]
    return PendingVerify(torch.cat(packed), plan, want, top_k)
