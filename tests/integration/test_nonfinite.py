"""Non-finite values end to end, on 2 processes: a NaN step is skipped and the run goes on;
a diverged run stops, naming the last good checkpoint, which retention kept."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

TINY = ["--model.flavor=debug", "--training.seq_len=32", "--training.global_batch_size=4", "--training.dtype=fp32",
        "--nproc-per-node=2", "--checkpoint.interval=1"]


def strict_records(run: Path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"metrics.jsonl holds {name}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoint_state(folder: Path, tmp: Path) -> dict:
    """A DCP checkpoint's model and optimizer state, flattened to name -> value."""
    out = tmp / f"{folder.name}.pt"
    dcp_to_torch_save(folder, out)

    def flat(d, prefix=""):
        items = {}
        for k, v in d.items():
            items.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return items

    return flat(torch.load(out, weights_only=False))


def healthy(folder: Path) -> bool:
    return json.loads((folder / "train_state.json").read_text())["healthy"]


@pytest.fixture(scope="module")
def injected(duoka, tmp_path_factory):
    run = tmp_path_factory.mktemp("nan") / "run"
    proc = duoka("train", f"--job.output_dir={run}", *TINY, "--training.steps=5", "--checkpoint.keep=5",
                 "--debug.inject_nan_step=3")
    return run, proc


@pytest.fixture(scope="module")
def diverged(duoka, tmp_path_factory):
    """A run whose loss is NaN from step 4 on. (An lr of 1e6 diverged after healthy steps on the
    machines before and at step 2 on another, leaving no healthy checkpoint to name: injected, every
    machine agrees.)"""
    run = tmp_path_factory.mktemp("diverged") / "run"
    proc = duoka("train", f"--job.output_dir={run}", *TINY, "--training.steps=8", "--checkpoint.keep=1",
                 "--debug.inject_nan_step=4", "--debug.inject_nan_count=8")
    return run, proc


def test_an_injected_nan_step_is_skipped_and_the_run_finishes(injected, tmp_path):
    run, proc = injected
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "alert (nonfinite): step 3: loss nan, gradient norm nan" in proc.stderr
    records = strict_records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[2]["loss"] is None and records[2]["grad_norm"] is None  # null, not NaN
    assert [r["health"]["skipped"] for r in records] == [False, False, True, False, False]
    assert records[-1]["health"]["skipped_steps"] == 1
    assert [r["tokens"] for r in records] == [128 * n for n in range(1, 6)]  # step 3's data was consumed

    # No update at step 3: weights and optimizer state (AdamW's step count too) are step 2's,
    # so what follows is the run in which step 3 had no update (resuming is exact).
    checkpoints = run / "checkpoints"
    two, three, four = (checkpoint_state(checkpoints / f"step-{n}", tmp_path) for n in (2, 3, 4))
    tensors = [k for k, v in two.items() if torch.is_tensor(v)]
    assert any(".step" in k for k in tensors) and any(k.startswith("model.") for k in tensors)
    assert all(torch.equal(two[k], three[k]) for k in tensors)
    assert not all(torch.equal(three[k], four[k]) for k in tensors)
    assert [healthy(checkpoints / f"step-{n}") for n in range(1, 6)] == [True, True, False, True, True]
    final = load_file(run / "hf" / "step-5" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in final.values())


def test_a_diverged_run_stops_naming_the_last_good_checkpoint(diverged):
    run, proc = diverged
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("error: ") == 1
    records = strict_records(run)
    first_bad = next(r["step"] for r in records if r["health"]["nonfinite_in_row"])
    assert [r["health"]["nonfinite_in_row"] for r in records[first_bad - 1:]] == [1, 2, 3]  # the default, 3
    # Named: the newest checkpoint followed by a normal step. The one saved at first_bad - 1
    # is healthy too, but its next step was the first bad one: resumed, it fails again.
    good = run / "checkpoints" / f"step-{first_bad - 2}"
    assert f"3 steps in a row (steps {first_bad} to {first_bad + 2}" in proc.stderr
    assert f"last good checkpoint {good}" in proc.stderr
    # checkpoint.keep=1, but retention waits for a normal step after the newest save: the
    # trouble came first, so every checkpoint since the last normal step is still there.
    kept = sorted((run / "checkpoints").iterdir(), key=lambda p: int(p.name.split("-")[1]))
    assert kept[0] == good and [healthy(p) for p in kept[:2]] == [True, True] and not any(map(healthy, kept[2:]))
    assert not (run / "hf").exists()  # no export
