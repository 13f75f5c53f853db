"""BlockTimer's debug slowdown (debug.slow_ranks) on CPU: what it learns from which steps,
and how it sizes the untimed per-sample work and the optimizer. The host's sleeps are
recorded instead of slept."""

import pytest
import torch

from duoka.parallel import balance
from duoka.parallel.balance import BlockTimer


@pytest.fixture
def timer(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(balance.time, "sleep", slept.append)
    timer = BlockTimer(torch.device("cpu"), slow_factor=0.5)
    layer = torch.nn.Linear(4, 4)
    layer.forward = timer.wrap(layer.forward)
    timer.attach(layer)

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
    assert after[1] == pytest.approx(0.02)
    assert after[0] == pytest.approx(before[0], rel=0.5)
