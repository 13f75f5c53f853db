"""`duoka bench`: the real training run, summarised; the peer side against a stand-in
script (the transformers peer needs a Qwen2 shape too big for a CPU test)."""

import json

import pytest

from duoka.bench.training import layout_overrides, run_peer, shares, summarize
from duoka.errors import DuokaError


def test_bench_runs_training_and_reports_the_contract_fields(duoka, tmp_path):
    out = tmp_path / "bench.json"
    proc = duoka("bench", "--model", "debug", "--layout", "fsdp", "--seq", "64", "--micro-batch", "2", "--steps", "3",
                 "--warmup", "1", "--nproc-per-node", "2", "--profile", "--set", "optimizer.weight_decay=0.0",
                 "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for field in ("model", "layout", "seq", "micro_batch", "tokens_per_s_per_gpu", "mfu", "peak_mem_gib"):
        assert field in r
    assert (r["model"], r["layout"], r["seq"], r["micro_batch"], r["gpus"]) == ("debug", "fsdp", 64, 2, 2)
    assert r["tokens_per_s_per_gpu"] > 0 and r["mfu"] is None  # no MFU on CPU
    assert {"forward", "backward", "optimizer", "data", "other"} <= set(r["breakdown_s"])
    assert r["breakdown_s"]["backward"] > 0
    assert "tokens/s/process" in proc.stderr and "2 CPU processes" in proc.stderr and "GPU(s)" not in proc.stderr
    assert r["device"] == "cpu" and "step time (mean of 3 timed steps" in proc.stderr
    # A progress line per step as it lands, before the result.
    steps = [line for line in proc.stderr.splitlines() if line.startswith("duoka bench: step ")]
    assert [line.split()[3] for line in steps] == ["1/4", "2/4", "3/4", "4/4"], proc.stderr
    assert "(warm-up)" in steps[0] and "(timed 3/3)" in steps[-1]
    assert sum(r["breakdown_s"].values()) == pytest.approx(r["mean_step_time_s"])
    assert r["settings"] == ["optimizer.weight_decay=0.0"]
    # The profiled warm-up step: operators by self time (CPU), the matmuls among them.
    names = [k["name"] for k in r["profile"]["kernels"]]
    assert r["profile"]["device"] == "cpu" and any("mm" in n for n in names), names
    assert "top kernels" in proc.stderr


def test_summary_weighs_steps_by_time_and_skips_warmup():
    recs = [{"step_time_s": 9.0, "tokens_per_s": 1.0, "mfu": 0.1, "loss": 5.0, "phase_s": {"forward": 9.0}},
            {"step_time_s": 1.0, "tokens_per_s": 1000.0, "mfu": 0.4, "loss": 4.0, "phase_s": {"forward": 0.5}},
            {"step_time_s": 3.0, "tokens_per_s": 1000.0, "mfu": 0.2, "loss": 3.0, "phase_s": {"forward": 1.5}}]
    s = summarize(recs, warmup=1, world=2)
    assert s["tokens_per_s_per_gpu"] == pytest.approx(4000 / 4 / 2)  # total tokens / total time / GPUs
    assert s["mfu"] == pytest.approx((0.4 * 1 + 0.2 * 3) / 4)
    assert s["breakdown_s"] == {"forward": 1.0, "other": 1.0}  # means: the step's 2.0 s, 1.0 s of it forward


def test_the_breakdown_adds_up_to_the_step_and_its_shares_to_100():
    """The parts are means over the timed steps, so they add up to the mean step, whatever
    the spread of each; data fetched on the host while the device ran the previous step (GPU)
    lies outside the step and is reported apart, never in the sum."""
    slow, fast = {"forward": 0.9, "backward": 1.5, "optimizer": 0.3, "data": 0.01}, {"forward": 0.1, "backward": 0.2,
                                                                                    "optimizer": 0.05, "data": 0.01}
    recs = [{"step_time_s": t, "tokens_per_s": 1.0, "mfu": None, "loss": 1.0, "phase_s": dict(p, other=0.0)}
            for t, p in [(9.0, slow), (0.4, fast), (0.4, fast), (2.8, slow)]]
    s = summarize(recs, warmup=1, world=1)
    parts = s["breakdown_s"]
    assert sum(parts.values()) == pytest.approx((0.4 + 0.4 + 2.8) / 3) and parts["other"] > 0
    assert sum(shares(parts).values()) == 100
    overlapped = [{"step_time_s": 0.3, "tokens_per_s": 1.0, "mfu": 0.5, "loss": 1.0,
                   "phase_s": {"forward": 0.1, "backward": 0.15, "optimizer": 0.04, "data": 0.05, "other": 0.0}}] * 2
    parts = summarize(overlapped, warmup=0, world=1)["breakdown_s"]
    assert parts["data_overlapped"] == pytest.approx(0.05) and "data" not in parts
    assert sum(v for k, v in parts.items() if k != "data_overlapped") == pytest.approx(0.3)
    assert sum(shares(parts).values()) == 100 and "data_overlapped" not in shares(parts)


def test_layout_parts_and_errors():
    flags, info = layout_overrides("fsdp+tp2+ac")
    assert info == {"dp_mode": "fsdp", "tp": 2, "pp": 1, "ac": True, "compile": False, "fused": False}
    assert "--parallel.tp=2" in flags and "--training.activation_checkpointing=full" in flags
    assert "--parallel.dp_replicate=2" in layout_overrides("hsdp2")[0]
    with pytest.raises(DuokaError, match="ddp \\| fsdp"):
        layout_overrides("zero3")


def test_peer_side_reads_the_peer_result_line(tmp_path):
    fake = tmp_path / "peer.py"
    fake.write_text('import sys, json\nargs = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)\n'
                    'print("RESULT " + json.dumps({"tok_s_gpu": 1000, "mfu_pct": 25.0, "peak_mem_gib": 3.0, '
                    '"step_s": 0.5, "mode": args["--mode"]}))\n')
    r = run_peer(fake, "qwen2-0.5b", {"dp_mode": "fsdp", "tp": 1, "pp": 1, "ac": False, "compile": False},
                 seq=64, micro_batch=2, steps=2, warmup=1, nproc=1, timeout=120)
    assert r["mode"] == "fsdp2" and r["tokens_per_s_per_gpu"] == 1000 and r["mfu"] == 0.25
    with pytest.raises(DuokaError, match="no configuration for debug"):
        run_peer(fake, "debug", {"dp_mode": "ddp", "tp": 1, "pp": 1, "ac": False, "compile": False},
                 64, 2, 2, 1, 1, 120)
