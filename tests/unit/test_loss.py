"""The chunked head + cross-entropy equals the plain one, value and gradients."""

import pytest
import torch
import torch.nn.functional as F

from duoka.models.loss import IGNORE_INDEX, chunked_cross_entropy


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_equals_unfused_loss_and_gradients(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 21, 16, generator=g, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, 50, (3, 21), generator=g)
    labels[0, :5] = IGNORE_INDEX  # masked prompt tokens contribute nothing
    ref = F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten(), reduction="sum",
                          ignore_index=IGNORE_INDEX)
    ref.backward(torch.tensor(0.5))
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    out = chunked_cross_entropy(hidden, weight, labels, chunk=chunk)
    out.backward(torch.tensor(0.5))
    assert out.dtype == torch.float32
    assert torch.allclose(out, ref, rtol=1e-6)  # fp32 inside, like the trainer's .float() logits
    assert torch.allclose(hidden.grad, gh, rtol=1e-5, atol=1e-5)
    assert torch.allclose(weight.grad, gw, rtol=1e-5, atol=1e-5)


def test_model_with_labels_returns_the_loss_of_its_logits():
    from duoka.models.qwen2.args import FLAVORS
    from duoka.models.qwen2.model import build_model, materialize

    model = materialize(build_model(FLAVORS["debug"]), "cpu")  # tied embeddings: the head's gradient adds up
    model.init_weights(seed=0)
    tokens = torch.randint(0, 4096, (2, 33), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, dims=1)
    plain = F.cross_entropy(model(tokens).float().flatten(0, 1), labels.flatten(), reduction="sum")
    plain.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    fused = model(tokens, labels=labels)
    fused.backward()
    assert torch.allclose(fused, plain, rtol=1e-6)
    for n, p in model.named_parameters():  # fp32 rounding in another order: relative to each tensor's norm
        assert (p.grad - ref[n]).norm() <= 1e-5 * ref[n].norm(), n


def test_compiled_chunk_equals_eager():
    """The torch.compile'd softmax pass (training.compile with the fused or plain loss)
    gives the eager values: loss, logit gradient, ignored tokens zero."""
    from duoka.models.loss import compiled_cross_entropy_sum, cross_entropy_sum, loss_and_logit_grad

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(37, 50, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[:4] = IGNORE_INDEX
    eager = loss_and_logit_grad(logits, labels)
    compiled = torch.compile(loss_and_logit_grad, dynamic=False)(logits, labels)
    assert torch.allclose(compiled[0], eager[0], rtol=1e-6)
    assert torch.allclose(compiled[1], eager[1], atol=1e-6)
    assert compiled[1][:4].abs().max() == 0
    x = logits[None].clone().requires_grad_()
    plain = cross_entropy_sum(x, labels[None])
    plain.backward()
    assert torch.allclose(eager[0], plain, rtol=1e-6)
    assert torch.allclose(eager[1], x.grad[0], atol=1e-6)  # the hand-written gradient is autograd's
    y = logits[None].clone().requires_grad_()
    fused = compiled_cross_entropy_sum(y, labels[None])
    fused.backward()
    assert torch.allclose(fused, plain, rtol=1e-6)
    assert torch.allclose(y.grad, x.grad, atol=1e-6)


def test_under_bf16_autocast_with_fp32_master_weights():
    """DDP's mixed precision: fp32 hidden states and head weight, matmuls in bf16 under
    autocast. The gradients come back in the inputs' dtypes and match the plain loss's
    within bf16 rounding."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(64, 32, generator=g, requires_grad=True)
    weight = torch.randn(300, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, 300, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum")
    ref.backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_cross_entropy(hidden, weight, labels, chunk=16)
    out.backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    assert torch.allclose(out, ref, rtol=1e-3)
    assert (hidden.grad - gh).norm() <= 2e-2 * gh.norm() and (weight.grad - gw).norm() <= 2e-2 * gw.norm()


# torch.compile's own config patching: monkeypatch's undo left the config module without the key.
@torch._dynamo.config.patch(error_on_recompile=True)
def test_compiled_loss_for_varying_micro_batches_compiles_once():
    """Balanced shares change the micro-batch size; the compiled loss then serves every size
    from one graph (a recompile per size was a 3.9 s step on GPU) and equals the plain loss."""
    from duoka.models.loss import compiled_cross_entropy_sum, cross_entropy_sum

    g = torch.Generator().manual_seed(3)
    for batch in (3, 2, 5):
        logits = torch.randn(batch, 7, 50, generator=g)
        labels = torch.randint(0, 50, (batch, 7), generator=g)
        labels[0, :2] = IGNORE_INDEX
        x, y = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        plain = cross_entropy_sum(x, labels)
        plain.backward()
        compiled = compiled_cross_entropy_sum(y, labels, varying_batch=True)
        compiled.backward()
        assert torch.allclose(compiled, plain, rtol=1e-6)
        assert torch.allclose(y.grad, x.grad, atol=1e-6)
