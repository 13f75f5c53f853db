"""Non-finite steps and loss spikes (duoka.train.health), and how the sinks show a NaN."""

import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from duoka.config import ReliabilityConfig
from duoka.errors import DuokaError
from duoka.monitor.alerts import health_alerts
from duoka.monitor.sinks import MetricsFile, PrometheusSink
from duoka.train.health import Health

NAN, INF = math.nan, math.inf


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    """Health's collectives (the spike's loss, the weights' check) on a group of one."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.body(x))


def make(tmp_path, model=None, inject_nan_step=0, **reliability) -> Health:
    return Health(ReliabilityConfig(**reliability), inject_nan_step, model or Tiny(), tmp_path, torch.device("cpu"),
                  counted=True, start_step=0)


def step(health: Health, optimizer, n: int, loss: float, norm: float, tokens: float = 10.0) -> dict:
    """Step n (1-based) as the trainer runs it: gradients, the decision, the update, the end."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.full_like(p, norm if not math.isfinite(norm) else 0.5)
    if health.allow_update(n - 1, optimizer, torch.tensor(norm), torch.tensor(loss * tokens), torch.tensor(tokens)):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    record = {"step": n, "loss": loss, "grad_norm": norm}
    health.end_step(record)
    return record


@pytest.mark.parametrize("fused", [True, False])
def test_a_nonfinite_step_leaves_weights_and_optimizer_as_they_were(tmp_path, fused):
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused, foreach=None if fused else True)
    health = make(tmp_path, model)

    def state():
        return [p.detach().clone() for p in model.parameters()] + [
            v.clone() for s in optimizer.state.values() for v in s.values()]

    changed = []
    for n, norm in enumerate([1.0, NAN, INF, 1.0], start=1):
        before = state()
        record = step(health, optimizer, n, 2.0, norm)
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, state())))
        assert record["health"]["skipped"] == (not math.isfinite(norm))
    assert changed == [True, False, False, True]
    assert int(next(iter(optimizer.state.values()))["step"]) == 2  # skipped steps are not counted by AdamW
    assert record["health"]["skipped_steps"] == 2 and health.healthy


def test_stops_after_k_in_a_row_naming_the_last_healthy_checkpoint(tmp_path):
    for n, healthy in [(2, True), (3, True), (5, False)]:
        folder = tmp_path / "checkpoints" / f"step-{n}"
        folder.mkdir(parents=True)
        (folder / ".metadata").write_bytes(b"")
        (folder / "train_state.json").write_text(json.dumps({"step": n, "healthy": healthy}))
    optimizer = torch.optim.AdamW(Tiny().parameters(), lr=0.1, foreach=True)
    health = make(tmp_path, max_nonfinite_steps=3)
    losses = [(2.0, 1.0), (NAN, NAN), (2.0, 1.0), (2.0, NAN), (NAN, NAN)]  # a NaN loss or norm counts alike
    in_row = []
    for n, (loss, norm) in enumerate(losses, start=1):
        in_row.append(step(health, optimizer, n, loss, norm)["health"]["nonfinite_in_row"])
        health.raise_if_failing()
    assert in_row == [0, 1, 0, 1, 2] and not health.healthy
    step(health, optimizer, 6, INF, INF)
    with pytest.raises(DuokaError) as e:
        health.raise_if_failing()
    # step-3 is healthy but its next step was the first of the failing stretch: resumed, it
    # would diverge again at once. step-2 was followed by a normal step (3).
    good = tmp_path / "checkpoints" / "step-2"
    assert "3 steps in a row (steps 4 to 6" in e.value.cause
    assert f"last good checkpoint {good}" in e.value.fix and f"--checkpoint.resume={good}" in e.value.fix

    empty = make(tmp_path / "none", max_nonfinite_steps=1)
    step(empty, optimizer, 1, NAN, NAN)
    with pytest.raises(DuokaError, match="no healthy checkpoint was written"):
        empty.raise_if_failing()


def test_the_named_checkpoint_predates_the_spikes_that_led_to_the_blow_up(tmp_path):
    """A blow-up often starts as loss spikes before the first NaN: a checkpoint written during
    them (healthy: its losses were finite) holds weights already on their way out."""
    for n in (10, 12, 13):
        folder = tmp_path / "checkpoints" / f"step-{n}"
        folder.mkdir(parents=True)
        (folder / ".metadata").write_bytes(b"")
        (folder / "train_state.json").write_text(json.dumps({"step": n, "healthy": True}))
    optimizer = torch.optim.AdamW(Tiny().parameters(), lr=0.1, foreach=True)
    health = make(tmp_path, max_nonfinite_steps=2, spike_window=5, spike_zscore=3.0)
    losses = [2.0 + 0.01 * (n % 3) for n in range(1, 13)] + [40.0, 900.0, NAN, NAN]  # spikes at 13, 14
    for n, loss in enumerate(losses, start=1):
        record = step(health, optimizer, n, loss, 1.0 if math.isfinite(loss) else NAN)
    assert record["health"]["nonfinite_in_row"] == 2 and health.trouble_start == 13
    with pytest.raises(DuokaError) as e:
        health.raise_if_failing()
    assert f"--checkpoint.resume={tmp_path / 'checkpoints' / 'step-10'}" in e.value.fix  # not 12 nor 13


def test_loss_spikes_alert_and_skip_and_a_resumed_run_decides_alike(tmp_path):
    """A z-score over the window ending two steps back; a lasting rise stops counting after
    a few steps. The state saved in a checkpoint gives a resumed run the same decisions."""
    losses = [2.0, 2.1, 1.9, 2.0, 2.1, 2.0, 1.95, 9.0, 9.0, 9.0, 9.1]
    runs = {}
    for skip in (False, True):
        model = Tiny()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        health = make(tmp_path, model, spike_window=5, spike_zscore=3.0, skip_spikes=skip)
        records = []
        for n, loss in enumerate(losses, start=1):
            records.append(step(health, optimizer, n, loss, 1.0))
            if n == 8:
                saved = json.loads(json.dumps(health.state_dict()))  # through train_state.json
        runs[skip] = records
        resumed = Health(ReliabilityConfig(spike_window=5, spike_zscore=3.0, skip_spikes=skip), 0, model, tmp_path,
                         torch.device("cpu"), counted=True, start_step=8)
        resumed.load_state_dict(saved)
        tail = [step(resumed, optimizer, n, loss, 1.0) for n, loss in enumerate(losses[8:], start=9)]
        assert [r["health"] for r in tail] == [r["health"] for r in records[8:]]
    spikes = [r["health"]["spike"] for r in runs[False]]
    assert spikes == [False] * 7 + [True, True, False, False]
    assert [r["health"]["skipped"] for r in runs[False]] == [False] * 11
    assert [r["health"]["skipped"] for r in runs[True]] == spikes
    alerts = health_alerts(runs[True][7])
    assert [a.kind for a in alerts] == ["loss_spike"] and "the update was skipped" in alerts[0].message
    assert runs[False][7]["health"]["loss_zscore"] > 3.0
    nonfinite = health_alerts({"step": 3, "loss": NAN, "grad_norm": NAN, "health": {
        "skipped": True, "nonfinite_in_row": 1, "skipped_steps": 1, "loss_zscore": None, "spike": False}})
    assert [a.kind for a in nonfinite] == ["nonfinite"] and "step 3" in nonfinite[0].message


def test_weights_with_a_nan_are_never_saved(tmp_path):
    model = Tiny()
    health = make(tmp_path, model)
    health.check_weights(list(model.parameters()), 4)
    with torch.no_grad():
        model.body.weight[1, 2] = INF
    with pytest.raises(DuokaError, match="weights hold NaN or infinite values after step 4"):
        health.check_weights(list(model.parameters()), 4)


def test_injected_nan_hits_exactly_the_named_step(tmp_path):
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, foreach=True)
    health = make(tmp_path, model, inject_nan_step=2)
    finite = []
    for n in (1, 2, 3):
        out = model(torch.ones(2, 4))
        finite.append(bool(torch.isfinite(out).all()))
        step(health, optimizer, n, 2.0, 1.0)
    assert finite == [True, False, True]


def test_metrics_file_is_strict_json(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = MetricsFile(path)
    sink.write({"step": 1, "loss": 2.5, "per_rank": {"loss": [2.5, None]}})
    sink.write({"step": 2, "loss": NAN, "grad_norm": INF, "per_rank": {"loss": [-INF, 2.0]}, "alerts": []})
    sink.close()

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    first, second = [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]
    assert first == {"step": 1, "loss": 2.5, "per_rank": {"loss": [2.5, None]}}
    assert second == {"step": 2, "loss": None, "grad_norm": None, "per_rank": {"loss": [None, 2.0]}, "alerts": []}


def test_prometheus_shows_nan_as_nan(tmp_path):
    sink = PrometheusSink("127.0.0.1", 0, [0])
    try:
        sink.write({"step": 1, "loss": 2.5, "grad_norm": 1.0, "mfu": None, "per_rank": {"loss": [2.5]}})
        sink.write({"step": 2, "loss": NAN, "grad_norm": NAN, "mfu": None, "per_rank": {"loss": [NAN]},
                    "health": {"skipped_steps": 1}})
        value = sink.registry.get_sample_value
        assert math.isnan(value("duoka_loss")) and math.isnan(value("duoka_grad_norm"))
        assert math.isnan(value("duoka_rank_loss", {"rank": "0", "host": sink.host}))
        assert value("duoka_skipped_steps") == 1
        assert value("duoka_mfu_ratio") == 0.0  # None (not measured) leaves the gauge alone
    finally:
        sink.close()
