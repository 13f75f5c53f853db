"""Prompt logprobs (SamplingParams.prompt_logprobs; the API's `echo` with `logprobs`, and
vLLM's `prompt_logprobs`): each prompt token's logprob after the tokens before it, and the
most likely tokens at its place, read from the prefill's own logits.

Row p of a sequence's prefill (the logits after its token p) scores token p + 1, so an n-token
prompt has rows 0..n-2 to read, and they are read as the prefill computes them, chunk by
chunk: no second forward. The forward hands back those rows' final hidden states
(PagedBatch.hidden_indices) and the head runs on them here, max_rows rows at a time: fp32
log-softmax, the prompt token's logprob and rank, the top k (on a GPU one kernel reads each
row once: models.row_logprobs). What comes back to the host is
2 + 2k numbers a row, never a row of the vocabulary, so a 32K-token prompt's answer stays
small; on GPU at most max_rows rows of logits exist at once, as many as the profile step had.

Rows are counted on the Sequence (prompt_logprob_rows, their entries in prompt_logprob_entries,
columns: serve.logprob_columns):
a preempted request's recompute does not repeat them. The prefix cache holds keys and values,
not logits, so it serves such a request a cached block only where the rows it skips are out
already or their entries were kept with the blocks by an earlier scoring request
(serve.logprob_cache, BlockManager._scorable); their rows then come from there, not from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from duoka.models import row_logprobs
from duoka.serve.logprob_columns import EntryRows
from duoka.serve.sampling import HostCopy, to_device
from duoka.serve.scheduler import ScheduledItem, Sequence


@dataclass(frozen=True)
class PromptSpan:
    """Prompt rows first .. first + count - 1 of seq, computed in this step."""
    seq: Sequence
    first: int
    count: int


@dataclass(frozen=True)
class PromptRows:
    """The rows of one step whose prompt logprobs are wanted, span after span."""
    rows: torch.Tensor
    """int64 [P]: indices into the step's tokens (StepInputs.token_ids)."""
    targets: torch.Tensor
    """int64 [P]: the prompt token each row scores."""
    top_k: int
    """The most alternatives any span asks for."""
    spans: tuple[PromptSpan, ...]


def prompt_rows(items: list[ScheduledItem]) -> PromptRows | None:
    """The prompt rows of a step's items (in the order of its tokens: decode_first's), each
    row once over the request's life (seq.prompt_logprob_rows are out already); None when no
    item has any."""
    rows, targets, spans = [], [], []
    offset = 0  # the item's first token among the step's
    for item in items:
        seq = item.seq
        # A one-token item that samples is a decode: its row scores a generated token.
        if (item.num_new > 1 or not item.sample) and seq.params.prompt_logprobs is not None:
            first = max(item.start, seq.prompt_logprob_rows)
            end = min(item.start + item.num_new, seq.num_prompt_tokens - 1)
            if end > first:
                rows.append(np.arange(offset + first - item.start, offset + end - item.start))
                targets.append(np.asarray(seq.prompt_ids[first + 1:end + 1], dtype=np.int64))
                spans.append(PromptSpan(seq, first, end - first))
        offset += item.num_new
    if not spans:
        return None
    return PromptRows(torch.from_numpy(np.concatenate(rows)), torch.from_numpy(np.concatenate(targets)),
                      max(span.seq.params.prompt_logprobs for span in spans), tuple(spans))


class PendingPromptLogprobs:
    """A step's prompt logprobs, computed and copied to the host behind the device's work."""

    def __init__(self, packed: torch.Tensor, prompt: PromptRows):
        self.prompt = prompt
        self.copy = HostCopy(packed)

    def result(self) -> list[tuple[PromptSpan, EntryRows]]:
        """Each span with its rows' entries: the prompt token, its logprob and rank, and the
        span's own k alternatives (views of the step's host copy; no object per row)."""
        host = self.copy.array()  # float64: fp32 values widened, token ids and ranks exact
        prompt, k = self.prompt, self.prompt.top_k
        n = len(prompt.targets)
        assert len(host) == n * (2 + 2 * k), (len(host), n, k)
        logprobs, ranks = host[:n], host[n:2 * n].astype(np.int64)
        values = host[2 * n:2 * n + n * k].reshape(n, k)
        ids = host[2 * n + n * k:].reshape(n, k).astype(np.int64)
        targets = prompt.targets.numpy()
        out, row = [], 0
        for span in prompt.spans:
            want, end = span.seq.params.prompt_logprobs, row + span.count
            out.append((span, EntryRows(targets[row:end], logprobs[row:end], ranks[row:end], ids[row:end, :want],
                                        values[row:end, :want])))
            row = end
        return out


@torch.inference_mode()
def launch_prompt_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, prompt: PromptRows,
                           max_rows: int, fused: bool) -> PendingPromptLogprobs:
    """hidden [P, dim]: the rows' final hidden states; head: hidden -> logits in the model's
    dtype; fused: read each row once in models.row_logprobs' kernel (a GPU with Triton, or its
    interpreter), else torch ops on the fp32 row. Queued on the device without waiting:
    [logprob P][rank P][top values P x k][top ids P x k], as fp64 (token ids are exact in it)."""
    targets = to_device(prompt.targets, hidden.device)
    k = prompt.top_k
    stats = row_logprobs.row_stats if fused else row_logprobs.reference_row_stats
    logprobs, ranks, top_values, top_ids = [], [], [], []
    for start in range(0, len(hidden), max_rows):
        logits = head(hidden[start:start + max_rows])
        norm, target, greater, top_value, top_id = stats(logits, targets[start:start + max_rows])
        logprobs.append(target - norm)
        ranks.append(greater + 1)  # vLLM's rank: 1 + the tokens more likely
        if k == 1:
            top_values.append(top_value - norm)
            top_ids.append(top_id)
        elif k:
            # Sorted, most likely first; bf16 widens to fp32 exactly, so the unwidened row's order is the fp32 row's.
            values, ids = logits.topk(k, dim=-1)
            top_values.append((values.float() - norm[:, None]).flatten())
            top_ids.append(ids.flatten())
        del logits
    packed = torch.cat([torch.cat(part).double() for part in (logprobs, ranks, top_values, top_ids) if part])
    return PendingPromptLogprobs(packed, prompt)
