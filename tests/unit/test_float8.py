"""training.float8: which layers turn float8, what is refused, and that the float8 path
computes a loss near the plain one (torchao's float8 matmuls run on CPU too). Its layouts
against one process: tests/distributed/test_layouts.py."""

import dataclasses

import pytest
import torch
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from duoka.errors import DuokaError
from duoka.models.qwen2.args import FLAVORS
from duoka.models.qwen2.model import build_model, materialize
from duoka.parallel.parallelize import check_float8, convert_to_float8


def test_only_the_blocks_linear_layers_turn_float8():
    model = build_model(FLAVORS["debug"])
    convert_to_float8(model, "tensorwise", fsdp=False)
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    linear = {name for name, m in model.named_modules() if type(m) is nn.Linear}
    assert linear == {"output"}  # the head stays bf16 (the fused loss reads its weight directly)
    assert len(converted) == 7 * FLAVORS["debug"].n_layers
    assert {n.split(".", 2)[2] for n in converted} == {"attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                                       "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}
    # Parameter names stay those of the plain model: checkpoints and exports do not change.
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in build_model(FLAVORS["debug"]).named_parameters()]


# One block of the debug flavor's width at 2 x 32 tokens: CPU float8 matmuls are slow (the
# whole flavor at 2 x 64 took 18-22 s a recipe). Measured here: the loss 2.8e-4 (rowwise) and
# 4.6e-4 (tensorwise) from the plain one, gradient cosines 0.995-0.996; a wrong scale moves the
# loss by whole percents.
FLOAT8_ARGS = dataclasses.replace(FLAVORS["debug"], n_layers=1)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_loss_is_near_the_plain_loss(recipe):
    plain = materialize(build_model(FLOAT8_ARGS), "cpu")
    plain.init_weights()
    fp8 = materialize(build_model(FLOAT8_ARGS), "cpu")
    convert_to_float8(fp8, recipe, fsdp=False)
    fp8.load_state_dict(plain.state_dict())
    fp8.tie_weights()
    tokens = torch.randint(0, FLOAT8_ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for model in (plain, fp8):
        loss = model(tokens, labels=tokens)
        loss.backward()
        losses.append(loss.item())
        grads.append(model.layers["0"].feed_forward.w1.weight.grad)
    assert losses[0] != losses[1]  # float8 matmuls ran
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    assert torch.nn.functional.cosine_similarity(grads[0].flatten(), grads[1].flatten(), dim=0) > 0.99


def test_float8_refusals(monkeypatch):
    check_float8("none", tp=2)  # off: nothing to refuse
    with pytest.raises(DuokaError, match="tensor parallelism") as e:
        check_float8("tensorwise", tp=2)
    assert "parallel.tp=1" in e.value.fix
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(DuokaError, match="needs torchao") as e:
        check_float8("rowwise", tp=1, device=torch.device("cpu"))
    assert "pip install 'duoka[quant]'" in e.value.fix


def test_a_shape_float8_cannot_run_is_refused_not_half_converted():
    odd = dataclasses.replace(FLAVORS["debug"], intermediate_size=200)  # not a multiple of 16
    with pytest.raises(DuokaError, match=r"multiples of 16.*feed_forward\.w1 \(128 x 200\)") as e:
        convert_to_float8(build_model(odd), "tensorwise", fsdp=False)
    assert "training.float8=none" in e.value.fix
