"""A MoE run's expert load in the monitoring: metrics.jsonl's `expert_load`, the
expert_collapse alert, and `duoka report`'s summary (docs/monitoring.md, "Expert load")."""

from __future__ import annotations

import json
import math

import pytest
import torch

from duoka.monitor.alerts import COLLAPSE_STEPS, ExpertCollapse, collapse_floor
from duoka.monitor.expert_load import summarize
from duoka.monitor.report import render

COMMON = ("--training.steps=4", "--training.seq_len=16", "--training.dtype=fp32", "--data.path=random",
          "--training.global_batch_size=2", "--training.micro_batch_size=1", "--checkpoint.export_final=false",
          "--metrics.log_interval=2")


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_moe_run_records_its_expert_load_and_the_report_shows_it(in_process, tmp_path):
    run = tmp_path / "moe"
    proc = in_process("train", f"--job.output_dir={run}", "--model.flavor=qwen2-moe-tiny", *COMMON)
    assert proc.returncode == 0, proc.stderr
    recs = records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        load = r["expert_load"]
        assert load["layers"] == [1, 2, 3]  # qwen2-moe-tiny: layer 0 is dense (mlp_only_layers)
        assert all(1.0 <= x <= 8 / 2 + 1e-6 for x in load["imbalance"])  # between even and E/k
        assert all(2 - 1e-6 <= x <= 8 + 1e-6 for x in load["effective_experts"])  # between k and E
        assert load["max_imbalance"] == max(load["imbalance"])
        assert load["min_effective_experts"] == min(load["effective_experts"])
    # Full shares only on the reported steps (the first, every log_interval, the last).
    assert ["shares" in r["expert_load"] for r in recs] == [True, True, False, True]
    for row in recs[1]["expert_load"]["shares"]:
        assert len(row) == 8 and abs(sum(row) - 1) < 1e-3 and min(row) >= 0
    page = render(run)
    assert "Expert load over 3 MoE layers: final step 4" in page and "worst step" in page


def test_the_counts_of_a_step_sum_its_forwards_and_start_again():
    from duoka.models.qwen2 import FLAVORS
    from duoka.models.qwen2.model import build_model, materialize

    args = FLAVORS["qwen2-moe-tiny"].replace(vocab_size=256)
    model = materialize(build_model(args), "cpu")
    model.init_weights(seed=0)
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens)
        model(tokens)
    counts = model.take_expert_counts()
    assert counts.shape == (3, 8) and torch.equal(counts.sum(dim=1), torch.full((3,), 2 * 16 * 2.0))  # 2 x tokens x k
    assert torch.equal(counts.sum(dim=1), model.take_expert_counts().sum(dim=1) + 64)  # taken: zeros until a forward


def test_a_dense_run_writes_no_expert_load(in_process, tmp_path):
    run = tmp_path / "dense"
    proc = in_process("train", f"--job.output_dir={run}", *COMMON)
    assert proc.returncode == 0, proc.stderr
    assert not any("expert_load" in r for r in records(run))
    assert "Expert load" not in render(run)


def test_the_summary_of_even_and_collapsed_counts():
    even = summarize(torch.full((2, 8), 10.0), (1, 3), shares=True)
    assert even["imbalance"] == [1.0, 1.0] and even["effective_experts"] == [8.0, 8.0]
    assert even["shares"][0] == [0.125] * 8
    # Every token to the same 2 of 8 experts (k=2): imbalance E/k, effective experts k.
    collapsed = summarize(torch.tensor([[50.0, 50.0] + [0.0] * 6]), (1,))
    assert collapsed["max_imbalance"] == 4.0 and math.isclose(collapsed["min_effective_experts"], 2.0)
    assert "shares" not in collapsed
    assert summarize(torch.zeros(1, 8), (1,))["imbalance"] == [1.0]  # nothing recorded: no alarm


def load_record(step, effective, imbalance):
    return {"step": step, "expert_load": {"layers": [1, 2], "imbalance": [1.1, imbalance],
                                          "effective_experts": [7.5, effective]}}


@pytest.mark.parametrize("aux_on", [True, False])
def test_the_collapse_alert_fires_after_consecutive_collapsed_steps_only(aux_on):
    assert collapse_floor(8, 2) == 4 and collapse_floor(64, 8) == 16 and collapse_floor(60, 4) == 15
    watch = ExpertCollapse(8, 2, 0.001, aux_on)
    for step in range(1, COLLAPSE_STEPS):
        assert watch.check(load_record(step, 2.2, 3.9)) == []
    [alert] = watch.check(load_record(COLLAPSE_STEPS, 2.2, 3.9))
    assert alert.kind == "expert_collapse" and "layer(s) [2]" in alert.message
    assert "router_aux_loss_coef" in alert.message and "optimizer.lr" in alert.message
    assert ("output_router_logits" in alert.message) != aux_on
    assert watch.check(load_record(COLLAPSE_STEPS + 1, 7.9, 1.1)) == []  # an even step resets the count


def test_the_collapse_alert_stays_silent_on_an_even_load_and_on_dense_records():
    watch = ExpertCollapse(8, 2, 0.001, True, steps=2)
    for step in range(1, 10):
        assert watch.check(load_record(step, 7.0, 1.3)) == []
        assert watch.check({"step": step}) == []
    # A hot expert alone (effective experts above the floor) also counts as a collapse.
    assert watch.check(load_record(10, 5.0, 3.5)) == [] and watch.check(load_record(11, 5.0, 3.5))


def test_prometheus_and_tensorboard_show_the_expert_load(tmp_path):
    from duoka.monitor.sinks import PrometheusSink, TensorBoardSink

    record = {"step": 1, "loss": 2.5, "expert_load": summarize(torch.tensor([[3.0, 1.0], [2.0, 2.0]]), (1, 3), True)}
    sink = PrometheusSink("127.0.0.1", 0, [0])
    try:
        sink.write(record)
        value = sink.registry.get_sample_value
        assert value("duoka_expert_imbalance_ratio", {"layer": "1"}) == 1.5
        assert value("duoka_expert_effective_experts", {"layer": "3"}) == 2.0
    finally:
        sink.close()
    board = TensorBoardSink(tmp_path / "tb")
    board.write(record)  # scalars and a histogram per layer
    board.close()
    assert list((tmp_path / "tb").iterdir())
