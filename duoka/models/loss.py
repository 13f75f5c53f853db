"""Cross-entropy fused with the output head, chunk by chunk over the tokens.

The plain path materialises bf16 logits [tokens, vocab], an fp32 copy and its gradient:
for Qwen2's 152k vocabulary that is ~1.5 MB per token, 12 GiB at 8 x 2048 tokens. Here the
head's matmul, the log-softmax and both gradients (hidden states and head weight) are done
for one chunk of tokens at a time inside forward, so only one chunk's logits ever exist;
backward only scales the stored gradients. The FLOPs are the unfused path's (no
recomputation), the memory of the logits falls to one chunk. (The same idea as Liger
Kernel's fused linear cross-entropy, Hsu et al. 2024, arXiv:2410.10989, in plain PyTorch.)

With `compiled=True` the per-chunk softmax and its gradient are one torch.compile'd
function: the bf16 logits are read twice (log-sum-exp, then the gradient) and the fp32
values never reach memory. Eager, the same function runs op by op on smaller chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from duoka.models.compiled_functions import compiled as compiled_fn

IGNORE_INDEX = -100
CHUNK_TOKENS = {True: 4096, False: 1024}  # compiled: no fp32 temporaries; eager: ~4 fp32 [chunk, vocab] live


def loss_and_logit_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For one chunk: the summed fp32 cross-entropy of `logits` [c, vocab] against `labels`
    [c] and d loss / d logits (softmax - one-hot, zero for ignored tokens) in the logits'
    dtype. Written as whole-tensor expressions so the compiler fuses it into two passes."""
    x = logits.float()
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, target[:, None]).squeeze(1)
    loss = ((lse - picked) * valid).sum()
    is_target = torch.arange(x.shape[1], device=x.device)[None, :] == target[:, None]
    grad = (torch.exp(x - lse[:, None]) - is_target.to(x.dtype)) * valid[:, None]
    return loss, grad.to(logits.dtype)


def _chunk_fn(compiled: bool):
    # dynamic=False: the chunk shape is fixed except for a shorter last chunk (one more
    # specialisation), and static shapes give the best kernels.
    return compiled_fn(loss_and_logit_grad, dynamic=False) if compiled else loss_and_logit_grad


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of CE(hidden @ weight.T, labels), labels == IGNORE_INDEX skipped.
    hidden [tokens, dim] in the compute dtype; weight [vocab, dim]; returns an fp32 scalar."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, compiled: bool):
        # Under autocast (DDP) the final norm's output and the master weight are fp32 and
        # the matmuls should run in the autocast dtype: cast once, explicitly, and keep
        # autocast out of the loop so every tensor here has the dtype it says.
        device = hidden.device.type
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        chunk_fn = _chunk_fn(compiled)
        with torch.autocast(device, enabled=False):
            x, w = hidden.to(compute), weight.to(compute)
            total = torch.zeros((), device=hidden.device, dtype=torch.float32)
            grad_hidden = torch.empty_like(x) if hidden.requires_grad else None
            grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) \
                if weight.requires_grad else None
            for start in range(0, x.shape[0], chunk):
                h = x[start:start + chunk]
                loss, grad = chunk_fn(h @ w.T, labels[start:start + chunk])
                total += loss
                if grad_hidden is not None:
                    torch.matmul(grad, w, out=grad_hidden[start:start + chunk])
                if grad_weight is not None:
                    grad_weight.add_(grad.T @ h)  # chunk product in the compute dtype, summed in fp32
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        gh = (grad_hidden * grad_output.to(grad_hidden.dtype)).to(hidden_dtype) if grad_hidden is not None else None
        gw = (grad_weight * grad_output).to(weight_dtype) if grad_weight is not None else None
        return gh, gw, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk: int | None = None, compiled: bool = False) -> torch.Tensor:
    """Summed cross-entropy of the head `weight` applied to `hidden` [..., dim] against
    `labels` [...], without materialising the logits of more than `chunk` tokens."""
    chunk = chunk or CHUNK_TOKENS[compiled]
    return ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk,
                                           compiled)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain path's loss: summed fp32 cross-entropy of materialised logits."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def _cross_entropy_sum_any_batch(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # A code object of its own: torch.compile caches graphs per code object, so compiling
    # cross_entropy_sum itself both ways would make the two variants meet each other's guards.
    return cross_entropy_sum(logits, labels)


def compiled_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, varying_batch: bool = False) -> torch.Tensor:
    """cross_entropy_sum through torch.compile: the fp32 copy of the logits and the fp32
    log-softmax are fused away; backward recomputes the softmax from the bf16 logits.

    `varying_batch` (balanced shares: micro-batches of changing sizes) compiles one graph
    with a dynamic batch dimension, since a static graph would recompile at every new size."""
    if not varying_batch:
        return compiled_fn(cross_entropy_sum, dynamic=False)(logits, labels)
    torch._dynamo.maybe_mark_dynamic(logits, 0)
    torch._dynamo.maybe_mark_dynamic(labels, 0)
    return compiled_fn(_cross_entropy_sum_any_batch, dynamic=None)(logits, labels)
