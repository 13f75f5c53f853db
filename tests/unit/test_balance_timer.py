"""BlockTimer's debug slowdown (debug.slow_ranks) on CPU: what it learns from which steps,
and how it sizes the untimed per-sample work and the optimizer. The host's sleeps are
recorded instead of slept, and in the fixture's steps the clock advances one tick per reading:
the timed layer's own seconds are then the same every step, whatever else runs on the machine
(on the wall clock a loaded machine stretched one step's backward of microseconds to 5x its
forward, and the backward-to-forward proportion sizes the untimed slowdown)."""

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from duoka import timing
from duoka.train import block_timer
from duoka.train.block_timer import BlockTimer

TICK_S = 1e-6  # the fixture's clock: seconds per reading


@pytest.fixture
def timer(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(block_timer.time, "sleep", slept.append)
    ticks = itertools.count()
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * TICK_S))
    timer = BlockTimer(torch.device("cpu"), slow_factor=0.5)
    layer = torch.nn.Linear(4, 4)
    timer.before_shard([layer])
    timer.after_shard([layer])

    def step(forward_s: float, optimizer_s: float, samples: int = 2) -> None:
        layer(torch.randn(samples, 4, requires_grad=True)).sum().backward()
        timer.step_seconds()
        timer.account_step(forward_s, optimizer_s, samples)

    timer.run_step, timer.slept = step, slept
    return timer


def slowdowns(timer, samples: int) -> tuple[float, float]:
    """The sleeps asked for by one micro-batch's untimed work and by the optimizer."""
    timer.slept.clear()
    timer.slow_untimed(samples)
    untimed = sum(timer.slept)
    timer.slept.clear()
    timer.slow_optimizer()
    return untimed, sum(timer.slept)


def test_the_first_step_compiles_and_sizes_nothing(timer):
    timer.run_step(forward_s=30.0, optimizer_s=5.0)
    assert slowdowns(timer, 2) == (0.0, 0.0)


def test_untimed_work_is_per_sample_and_the_optimizer_per_step(timer):
    timer.run_step(forward_s=30.0, optimizer_s=5.0)  # compiling: ignored
    timer.run_step(forward_s=0.1, optimizer_s=0.02)
    untimed_2, optimizer = slowdowns(timer, 2)
    untimed_4, _ = slowdowns(timer, 4)
    # At half speed the extra equals the work: the optimizer's seconds, and the forward
    # phase's rest (0.1 s for 2 samples, the timed layer's microseconds aside) with its
    # backward added in the layer's own backward-to-forward proportion.
    assert optimizer == pytest.approx(0.02)
    assert untimed_2 > 0.099
    assert untimed_4 == pytest.approx(2 * untimed_2)


def test_one_stalled_step_does_not_size_the_next_slowdowns(timer):
    timer.run_step(forward_s=30.0, optimizer_s=5.0)
    timer.run_step(forward_s=0.1, optimizer_s=0.02)
    before = slowdowns(timer, 2)
    timer.run_step(forward_s=0.1, optimizer_s=0.02)
    timer.run_step(forward_s=20.0, optimizer_s=4.0)  # e.g. compiling for a new micro-batch size
    after = slowdowns(timer, 2)
    # The medians of the steps after the compiling one: the stall is the largest of three,
    # so the slowdowns are the normal steps' (equal on the fixture's clock), not 200 times more.
    assert before[0] > 0.099 and after == pytest.approx(before, rel=1e-9)


def test_every_module_is_timed_forward_and_backward():
    timer = BlockTimer(torch.device("cpu"))
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    timer.before_shard(layers)
    timer.after_shard(layers)
    x = torch.randn(3, 4, requires_grad=True)
    layers[1](layers[0](x)).sum().backward()
    assert [iv.key for iv in timer.intervals] == [(0, "forward"), (1, "forward"), (1, "backward"), (0, "backward")]
    assert all(iv.batch == 3 for iv in timer.intervals)
    total = sum(iv.end.seconds_since(iv.start) for iv in timer.intervals)
    assert timer.step_seconds() == pytest.approx(total) and total > 0
    assert timer.intervals == []


def test_the_hooks_sit_inside_fsdp2s():
    """The forward's start follows FSDP2's pre-forward hook (its all-gather wait) and its end
    precedes FSDP2's post-forward hook; the backward's start hook is added after FSDP2's."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        timer = BlockTimer(torch.device("cpu"))
        layer = torch.nn.Linear(4, 4)
        timer.before_shard([layer])
        fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
        timer.after_shard([layer])
        pre = [getattr(h, "func", h).__name__ for h in layer._forward_pre_hooks.values()]
        post = [getattr(h, "func", h).__name__ for h in layer._forward_hooks.values()]
        assert pre == ["_pre_forward", "_forward_start"]
        assert post == ["_forward_end", "_post_forward", "_register_backward_start"]
        layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
        assert [iv.key for iv in timer.intervals] == [(0, "forward"), (0, "backward")]
    finally:
        dist.destroy_process_group()
