import math

import pytest
import torch

from duoka.config import OptimizerConfig
from duoka.errors import DuokaError
from duoka.models.qwen2.args import FLAVORS
from duoka.models.qwen2.model import build_model, materialize
from duoka.train.batch_plan import plan_batch
from duoka.train.lr_schedule import effective_lr, lr_at
from duoka.train.optimizers import build_optimizer, clip_to_norm


def test_batch_arithmetic():
    p = plan_batch(64, 4, 2)
    assert (p.per_rank, p.accumulation) == (16, 8)
    assert p.micro_batch * p.accumulation * p.dp_size == 64


def test_impossible_batches_show_the_arithmetic():
    with pytest.raises(DuokaError, match=r"global_batch_size=10 does not split over 4 .*10 / 4 = 2.5") as e:
        plan_batch(10, 4, 1)
    assert "8 or 12" in e.value.fix
    with pytest.raises(DuokaError, match=r"micro_batch_size=3 .* 16 / 2 ranks = 8") as e:
        plan_batch(16, 2, 3)
    assert "[1, 2, 4, 8]" in e.value.fix


def test_lr_scaling_rules():
    cfg = OptimizerConfig(lr=1e-3, lr_scaling="linear", reference_batch_size=256)
    assert effective_lr(cfg, 1024) == pytest.approx(4e-3)
    cfg.lr_scaling = "sqrt"
    assert effective_lr(cfg, 1024) == pytest.approx(2e-3)
    cfg.lr_scaling = "none"
    assert effective_lr(cfg, 1024) == 1e-3
    assert effective_lr(OptimizerConfig(lr=1e-3, lr_scaling="linear"), 1024) == 1e-3  # ref 0 = the batch itself


def test_schedules():
    cfg = OptimizerConfig(warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    lrs = [lr_at(s, 100, 1.0, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0
    assert lrs[-1] == pytest.approx(0.1)
    assert lrs[54] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    cfg.schedule = "linear"
    assert lr_at(54, 100, 1.0, cfg) == pytest.approx(1.0 - 0.9 * 45 / 90)
    cfg.schedule = "wsd"
    cfg.decay_fraction = 0.2
    wsd = [lr_at(s, 100, 1.0, cfg) for s in range(100)]
    assert wsd[10:80] == [1.0] * 70 and wsd[-1] == pytest.approx(0.1) and wsd[85] < 1.0
    cfg.schedule = "constant"
    assert lr_at(99, 100, 1.0, cfg) == 1.0


def test_weight_decay_only_on_matrices():
    model = materialize(build_model(FLAVORS["debug"]), "cpu")
    model.init_weights()
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1), 1e-3, "cpu")
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    n_unique = len({id(p) for p in model.parameters()})
    assert len(decayed["params"]) + len(plain["params"]) == n_unique  # the tied head counted once
    assert not any(p is model.output.weight for p in plain["params"])
    assert any(p is model.tok_embeddings.weight for p in decayed["params"])
    assert [torch.optim.AdamW] == [type(part) for part in opt.parts]


def test_clip_folded_into_fused_adamw_equals_a_clip_then_adamw():
    """The GPU path hands the clip to fused AdamW as its grad_scale divisor; it must step as
    clip_grads_with_norm_ followed by AdamW does (fused AdamW runs on CPU too)."""
    torch.manual_seed(0)
    grads = [torch.randn(64, 32) * 10, torch.randn(32) * 10]  # norm ~ 460: the clip to 1 acts
    runs = {}
    for name, fused, max_norm in [("folded", True, 1.0), ("plain", False, 1.0), ("unclipped", False, math.inf)]:
        torch.manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
        opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-3, fused=fused, foreach=None if fused else True)
        for step in range(3):
            for p, g in zip(params, grads):
                p.grad = g * (step + 1)
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            clip_to_norm(opt, params, norm, max_norm)
            opt.step()
            opt.zero_grad()
        runs[name] = torch.cat([p.detach().flatten() for p in params])
    torch.testing.assert_close(runs["folded"], runs["plain"], rtol=0, atol=1e-6)
    # The eps makes the update depend on the gradient's scale, so the clip shows.
    assert (runs["plain"] - runs["unclipped"]).abs().max() > 1e-4
