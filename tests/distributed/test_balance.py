"""Load balancing (parallel.balance) on CPU with gloo, fp32: rank 1 slowed to half speed
by debug.slow_ranks. The shares follow the speed, and the run still computes what one
process computes on the whole batch (losses, gradient norms, final weights), under DDP
(ranks run different numbers of micro-batches) and FSDP2 (same count, different sizes),
also when resumed between a decision and the step it takes effect."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
COMMON = [f"--training.steps={STEPS}", "--training.seq_len=32", "--training.global_batch_size=12",
          "--training.micro_batch_size=2", "--training.dtype=fp32", "--optimizer.warmup_steps=2",
          "--optimizer.schedule=constant", "--metrics.log_interval=100", "--parallel.balance_window=3"]
SLOW = ["--nproc-per-node=2", "--parallel.balance=auto", "--debug.slow_ranks=1:0.5"]


def train(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run_dir}", *COMMON, *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_as(run: Path, ref: Path, from_step: int = 1):
    a = [r for r in records(run) if r["step"] >= from_step]
    b = [r for r in records(ref) if r["step"] >= from_step]
    assert [r["step"] for r in a] == [r["step"] for r in b] and a
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"]), (x, y)
        # 1e-3: twelve Adam steps amplify summation-order differences (1.4e-4 seen under
        # FSDP2 at step 12); a normalisation error from uneven shares would be tens of percent.
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-3 * y["grad_norm"], (x, y)
    wa = load_file(run / "hf" / f"step-{STEPS}" / "model.safetensors")
    wb = load_file(ref / "hf" / f"step-{STEPS}" / "model.safetensors")
    diff = sum(((wa[k] - wb[k]) ** 2).sum() for k in wa).sqrt()
    assert diff / sum((wb[k] ** 2).sum() for k in wb).sqrt() <= 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    train(run, "--nproc-per-node=1")
    return run


def assert_shares_follow_the_slow_rank(run: Path, proc: subprocess.CompletedProcess):
    recs = records(run)
    assert recs[0]["balance"]["shares"] == [6, 6]
    final = recs[-1]["balance"]["shares"]
    # Half speed: the ideal is 8 : 4 of 12. CPU timing is noisy (two processes on two
    # cores), so one sample either way; what matters is that the slow rank got less.
    assert sum(final) == 12 and 3 <= final[1] <= 5, [r["balance"] for r in recs]
    assert "balance: shares [6, 6] ->" in proc.stderr + proc.stdout


def test_fsdp_shares_follow_the_slow_rank_and_the_gradient_stays_exact(reference, tmp_path):
    """FSDP2: the same number of micro-batches on both ranks, of different sizes; no hang."""
    proc = train(tmp_path / "run", *SLOW, "--parallel.dp_mode=fsdp")
    assert_shares_follow_the_slow_rank(tmp_path / "run", proc)
    sizes = {r["balance"]["shares"][1] for r in records(tmp_path / "run")}
    assert len(sizes) > 1  # the shares did change during the run
    assert_same_as(tmp_path / "run", reference)


def test_ddp_shares_follow_and_resume_between_a_decision_and_its_step(reference, tmp_path):
    """DDP: ranks run different numbers of micro-batches. A checkpoint written after the
    shares were decided but before they apply: the resumed run applies the same shares at
    the same step, and both runs equal one process."""
    whole = tmp_path / "whole"
    proc = train(whole, *SLOW, "--checkpoint.interval=6")
    assert_shares_follow_the_slow_rank(whole, proc)
    assert_same_as(whole, reference)
    schedule = json.loads((whole / "checkpoints" / "step-6" / "train_state.json").read_text())["balance"]["schedule"]
    changes = [first for first, _ in schedule if first > 0]
    assert changes and changes[0] >= 6, schedule  # decided by step 6, effective later: the case this test wants
    resumed = tmp_path / "resumed"
    train(resumed, *SLOW, f"--checkpoint.resume={whole / 'checkpoints' / 'step-6'}")
    shares = {r["step"]: r["balance"]["shares"] for r in records(resumed)}
    expected = {r["step"]: r["balance"]["shares"] for r in records(whole) if r["step"] > 6}
    assert shares == expected
    assert_same_as(resumed, reference, from_step=7)


# The refusal of model-parallel layouts (checked by the launcher before any worker starts)
# is tested on the check itself in tests/unit/test_balance_shares.py.
