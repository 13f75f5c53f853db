"""One pass over each row of logits for prompt logprobs (GPU only; serve.prompt_logprobs):
the row's log-sum-exp in fp32, a target token's logit and rank, and the row's largest logit
and its index.

Scoring a prompt reads every position's row of the vocabulary (152,064 logits a row for
Qwen2). Done with torch ops the row is widened to fp32 (a copy), then read again for the
log-sum-exp (two kernels), the rank's comparison and sum, and a radix top-k: ~48 ms of a
~235 ms step of 8,000 prompt tokens of a 7B on an H100 (bench/NOTES.md 44). Here one program
reads one row once, in the logits' own dtype (bf16 widens to fp32 exactly), with the online
log-sum-exp (running maximum, rescaled sum). Top-1 falls out of the same pass; a larger k
asks torch.topk on the unwidened row, which orders it as the fp32 row would.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch builds carry no Triton
    triton = None

# 4,096 logits of bf16 are 8 KB a load; Qwen2's 151,936-152,064 vocabularies take ~38 of them.
BLOCK_V = 4096


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _row_kernel(LOGITS, TARGETS, LSE, TARGET_LOGIT, GREATER, TOP_VALUE, TOP_ID, vocab, stride_row,
                    BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        base = LOGITS + row.to(tl.int64) * stride_row
        target_id = tl.load(TARGETS + row)
        t = tl.load(base + target_id).to(tl.float32)
        running_max = tl.full([], float("-inf"), tl.float32)
        running_sum = tl.zeros([], dtype=tl.float32)
        greater = tl.zeros([], dtype=tl.int64)
        top_value = tl.full([], float("-inf"), tl.float32)
        top_id = tl.zeros([], dtype=tl.int64)
        for v0 in range(0, vocab, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(base + v, mask=v < vocab, other=float("-inf")).to(tl.float32)
            block_max = tl.max(x, axis=0)
            new_max = tl.maximum(running_max, block_max)
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
            greater += tl.sum((x > t).to(tl.int64), axis=0)
            block_id = v0 + tl.argmax(x, axis=0).to(tl.int64)
            better = block_max > top_value  # strict: the first index of the largest value wins
            top_id = tl.where(better, block_id, top_id)
            top_value = tl.where(better, block_max, top_value)
        tl.store(LSE + row, running_max + tl.log(running_sum))
        tl.store(TARGET_LOGIT + row, t)
        tl.store(GREATER + row, greater)
        tl.store(TOP_VALUE + row, top_value)
        tl.store(TOP_ID + row, top_id)


def row_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """logits [R, V] (any float dtype, rows contiguous), targets [R] int64 -> (log-sum-exp fp32,
    target logit fp32, count of logits above the target's int64, top value fp32, top id
    int64), each [R]."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("row_stats reads rows of contiguous logits")
    out = [torch.empty(rows, device=logits.device, dtype=dt)
           for dt in (torch.float32, torch.float32, torch.int64, torch.float32, torch.int64)]
    if rows:
        _row_kernel[(rows,)](logits, targets.contiguous(), *out, vocab, logits.stride(0), BLOCK_V=BLOCK_V)
    return tuple(out)


def reference_row_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """row_stats by torch ops on the fp32 row (the CPU's path, and the kernel's reference)."""
    x = logits.float()
    t = x.gather(1, targets[:, None])
    top_value, top_id = x.max(dim=-1)
    return torch.logsumexp(x, dim=-1), t[:, 0], (x > t).sum(dim=-1), top_value, top_id
