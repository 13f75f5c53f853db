"""Cross-entropy fused with the output head, chunk by chunk over the tokens.

The plain path materialises bf16 logits [tokens, vocab], an fp32 copy and its gradient:
for Qwen2's 152k vocabulary that is ~1.5 MB per token, 12 GiB at 8 x 2048 tokens. Here the
head's matmul, the log-softmax and both gradients (hidden states and head weight) are done
for one chunk of tokens at a time inside forward, so only one chunk's logits ever exist;
backward only scales the stored gradients. The FLOPs are the unfused path's (no
recomputation), the memory of the logits falls to one chunk. (The same idea as Liger
Kernel's fused linear cross-entropy, Hsu et al. 2024, arXiv:2410.10989, in plain PyTorch.)
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of CE(hidden @ weight.T, labels), labels == IGNORE_INDEX skipped.
    hidden [tokens, dim] in the compute dtype; weight [vocab, dim]; returns an fp32 scalar."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int):
        w = weight.to(hidden.dtype)  # under autocast (DDP) the master weight is fp32
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) \
            if weight.requires_grad else None
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk], labels[start:start + chunk]
            logits = (h @ w.T).float()
            valid = y != IGNORE_INDEX
            target = torch.where(valid, y, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            total += ((lse - picked) * valid).sum()
            # d CE / d logits = softmax - onehot, zero for ignored tokens; reuse the buffer.
            grad = logits.sub_(lse[:, None]).exp_()
            grad[torch.arange(len(y), device=y.device), target] -= 1.0
            grad.mul_(valid[:, None])
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                torch.matmul(grad, w, out=grad_hidden[start:start + chunk])
            if grad_weight is not None:
                grad_weight.add_(grad.T @ h)  # chunk product in the compute dtype, summed in fp32
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        gh = grad_hidden * grad_output.to(grad_hidden.dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_output).to(ctx.weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk: int = 4096) -> torch.Tensor:
    """Summed cross-entropy of the head `weight` applied to `hidden` [..., dim] against
    `labels` [...], without materialising the logits of more than `chunk` tokens."""
    return ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk)
