"""The attention block's speed options compute the same function: fused q/k/v projections
(training.fuse_qkv) and the SDPA kernel the model applies itself (training.attention_kernel)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import duoka.models.qwen2.model as model_module
from duoka.models.qwen2.args import ModelArgs, ModelOptions
from duoka.models.qwen2.model import build_model, fusable, materialize

ARGS = ModelArgs(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96)


def tiny_model(dtype=torch.float64, options=ModelOptions()):
    model = materialize(build_model(ARGS, options), "cpu", dtype)
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
        model = tiny_model(options=ModelOptions(fuse_qkv=fuse))
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
    math_model = tiny_model(torch.float32, ModelOptions(sdpa_backend="math"))
    efficient_model = tiny_model(torch.float32, ModelOptions(sdpa_backend="efficient"))
    with torch.no_grad():
        default = model(tokens)
        assert torch.allclose(math_model(tokens), default, atol=1e-5)
        # The memory-efficient kernel has no CPU implementation: if the choice reaches SDPA,
        # there is no kernel left to run.
        with pytest.raises(RuntimeError, match="No viable backend"):
            efficient_model(tokens)


def test_flash_varlen_runs_in_the_autocast_dtype(monkeypatch):
    """Under DDP's autocast q and k leave the rotary embedding in fp32; flash varlen only
    takes fp16/bf16, so duoka casts as autocast does for SDPA (found on an H200)."""
    import torch.nn.attention.varlen as varlen_module

    from duoka.models.qwen2.model import Varlen, _varlen_attention

    seen = []

    def fake_varlen_attn(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return torch.zeros_like(q)

    monkeypatch.setattr(varlen_module, "varlen_attn", fake_varlen_attn)
    q, k, v = (torch.randn(2, h, 8, 16) for h in (4, 2, 2))
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _varlen_attention(q, k, v, Varlen(cu, 8))
    assert seen == [(torch.bfloat16,) * 3] and out.shape == (2, 8, 4, 16)
    _varlen_attention(q, k, v, Varlen(cu, 8))  # no autocast: the inputs' own dtype
    assert seen[-1] == (torch.float32,) * 3


def test_checkpointed_blocks_are_compiled_inside_their_wrapper():
    """Compiling the checkpoint wrapper guarded on each block's name and recompiled per
    block (dynamo's limit of 8 failed a 24-block model on an H200); the block inside it is
    compiled instead, one graph for all blocks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from duoka.config import load_config
    from duoka.parallel.dims import ParallelDims
    from duoka.parallel.parallelize import ParallelOptions, parallelize_qwen2

    cfg = load_config(overrides=["--training.activation_checkpointing=full", "--training.compile=true"])
    model = build_model(ARGS, ModelOptions(compile="block"))
    options = ParallelOptions(compute_dtype=torch.float32, activation_checkpointing=True, float8="none",
                              fsdp_blocks_per_unit=1, reshard_after_forward=True, ddp_bucket_mb=25)
    parallelize_qwen2(model, ParallelDims.from_config(cfg.parallel, 1), None, options)
    for block in model.layers.values():
        assert isinstance(block, CheckpointWrapper)
        assert block._compiled_call_impl is None
        inner = block._checkpoint_wrapped_module
        assert inner._body != inner._block  # the block's own body is the compiled region


# torch.compile's own config patching: monkeypatch's undo left the config module without the key.
@torch._dynamo.config.patch(error_on_recompile=True)
def test_a_compiled_block_body_computes_the_eager_model():
    """ModelOptions(compile="block"): built on meta, materialised and initialised, the model
    keeps its parameter names and gives the eager loss and gradients; one graph serves
    every block (a recompile per block would hit dynamo's limit on deep models)."""
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    eager = tiny_model(torch.float32)
    compiled = tiny_model(torch.float32, ModelOptions(compile="block"))
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no `_orig_mod.` prefixes
    (loss, grads), (compiled_loss, compiled_grads) = (loss_and_grads(m, tokens) for m in (eager, compiled))
    assert torch.allclose(compiled_loss, loss, rtol=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(compiled_grads[name], grad, rtol=1e-4, atol=1e-5), name
