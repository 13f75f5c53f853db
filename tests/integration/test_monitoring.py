"""A real CPU training run with monitoring on: its Prometheus endpoint is scraped over
HTTP while it trains, and its TensorBoard events are read back with tensorboard's own
EventAccumulator afterwards."""

import json
import subprocess
import time
import urllib.request

from duoka.host.ports import free_port


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("duoka_")}


def test_prometheus_scraped_during_training_and_tensorboard_events(duoka, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    port, run, steps = free_port(), tmp_path / "run", 25
    proc = duoka.popen(
        "train", f"--job.output_dir={run}", f"--training.steps={steps}", "--training.seq_len=32",
        "--training.global_batch_size=4", "--training.dtype=fp32", "--checkpoint.enabled=false",
        "--checkpoint.export_final=false", "--metrics.log_interval=100", f"--metrics.prometheus_port={port}",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen, deadline = [], time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                m = scrape(port)
            except OSError:  # not listening yet
                time.sleep(0.1)
                continue
            if m.get("duoka_step", 0) > 0:
                seen.append(m)
                if len(seen) >= 2 and seen[-1]["duoka_step"] > seen[0]["duoka_step"]:
                    break
            time.sleep(0.05)
        assert len(seen) >= 2, proc.communicate(timeout=120)[1][-3000:]
    finally:
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    live = seen[-1]
    assert 0 < live["duoka_step"] < steps  # scraped while training, not after
    assert live["duoka_tokens_per_second"] > 0 and live["duoka_loss"] > 0
    assert any(k.startswith('duoka_rank_step_seconds{host=') and 'rank="0"' in k for k in live)
    assert f"Prometheus metrics on http://127.0.0.1:{port}/metrics" in err

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, steps + 1))
    assert {"train/tokens_per_s", "train/grad_norm", "phase_s/forward", "rank/loss/0"} <= set(events.Tags()["scalars"])

    # Records are written one step late (the deferred step end), yet every step has one, in
    # order, with the host's side; a step's time runs from the previous step's end, so it
    # holds at least this step's own launch.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert r["host_s"]["launch"] > 0 and r["host_s"]["wait"] >= 0
        assert r["step_time_s"] >= 0.9 * r["host_s"]["launch"], r
