"""The attention block's speed options compute the same function: fused q/k/v projections
(training.fuse_qkv) and the SDPA kernel the model applies itself (training.attention_kernel)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.attention import SDPBackend

import duoka.models.qwen2.model as model_module
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.model import build_model, fusable, materialize

ARGS = ModelArgs(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96)


def tiny_model(dtype=torch.float64):
    model = materialize(build_model(ARGS), "cpu", dtype)
    model.init_weights(seed=3)
    with torch.no_grad():  # non-zero biases, so their gradients and the fused bias are exercised
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def loss_and_grads(model, tokens):
    loss = model(tokens, labels=tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_fused_qkv_equals_separate_projections(monkeypatch):
    calls = []
    real = model_module.fused_linear
    monkeypatch.setattr(model_module, "fused_linear", lambda *a: calls.append(1) or real(*a))
    tokens = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    results = {}
    for fuse in (True, False):
        model = tiny_model()
        for block in model.layers.values():
            block.attention.fuse_qkv = fuse
        calls.clear()
        results[fuse] = loss_and_grads(model, tokens)
        assert len(calls) == (ARGS.n_layers if fuse else 0)  # the path under test really ran
    (fused_loss, fused_grads), (loss, grads) = results[True], results[False]
    assert torch.allclose(fused_loss, loss, rtol=1e-12, atol=0)
    for name, grad in grads.items():
        assert torch.allclose(fused_grads[name], grad, rtol=1e-10, atol=1e-14), name


def test_fusable_only_for_plain_linear_on_plain_tensors():
    plain = [nn.Linear(8, 8), nn.Linear(8, 4)]
    assert fusable(*plain)

    class OwnMatmul(nn.Linear):  # float8's layers subclass nn.Linear and run their own matmul
        pass

    assert not fusable(plain[0], OwnMatmul(8, 4))
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = nn.Linear(8, 4)
        sharded.weight = nn.Parameter(distribute_tensor(sharded.weight.detach(), mesh, [Shard(0)]))
        assert not fusable(plain[0], sharded)  # a tensor-parallel shard
    finally:
        dist.destroy_process_group()


def test_the_chosen_sdpa_kernel_is_applied_inside_the_forward():
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model = tiny_model(torch.float32)
    with torch.no_grad():
        default = model(tokens)
        model.set_sdpa_backend(SDPBackend.MATH)
        assert torch.allclose(model(tokens), default, atol=1e-5)
        # The memory-efficient kernel has no CPU implementation: if the choice reaches SDPA,
        # there is no kernel left to run.
        model.set_sdpa_backend(SDPBackend.EFFICIENT_ATTENTION)
        with pytest.raises(RuntimeError, match="No viable backend"):
            model(tokens)
