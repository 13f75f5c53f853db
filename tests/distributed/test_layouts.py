"""Every data-parallel layout computes what one process computes (CPU, gloo, fp32).

Runs the real `duoka train` for 5 steps per layout, same global batch and seed, and
compares the per-step losses (relative difference <= 1e-5) and the final weights.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
COMMON = [f"--training.steps={STEPS}", "--training.seq_len=64", "--training.global_batch_size=8",
          "--training.dtype=fp32", "--optimizer.warmup_steps=2", "--metrics.log_interval=100"]


def train(run_dir: Path, *args: str, env=None):
    proc = subprocess.run([sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run_dir}", *COMMON, *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "hf" / f"step-{STEPS}" / "model.safetensors")


def assert_same_run(run: Path, ref: Path):
    a, b = records(run), records(ref)
    assert len(a) == len(b) == STEPS
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"]), (a, b)
        # Adam is blind to a constant factor on the gradient, so the weights alone would not
        # catch a normalisation error (say, a forgotten x dp_size); the gradient norm does.
        # 1e-4: the norm is a sum of 1.3M squares, reduced in another order per layout
        # (observed up to 1.6e-5 under FSDP2); a scale error would be 50% or more.
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-4 * y["grad_norm"], (a, b)
    wa, wb = weights(run), weights(ref)
    assert wa.keys() == wb.keys()
    # The whole model's relative difference. No per-element or per-tensor bound: where a
    # gradient is zero up to rounding (the k-projection bias: a constant key shift barely
    # moves softmax), Adam rescales that rounding noise to lr-sized steps whose signs
    # depend on the reduction order, so single elements legitimately differ by ~lr.
    diff = sum(((wa[k] - wb[k]) ** 2).sum() for k in wa).sqrt()
    norm = sum((wb[k] ** 2).sum() for k in wb).sqrt()
    assert diff / norm <= 1e-5


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    train(run, "--nproc-per-node=1")
    return run


def test_loss_falls_in_reference(reference):
    ls = losses(reference)
    assert ls[-1] < ls[0]


@pytest.mark.parametrize("layout", [
    ["--nproc-per-node=2", "--parallel.dp_mode=ddp"],
    # All four blocks of the debug model in one FSDP2 unit.
    ["--nproc-per-node=4", "--parallel.dp_mode=fsdp", "--parallel.dp_replicate=2", "--parallel.fsdp_blocks_per_unit=0"],
    # Plain FSDP2 on 2 ranks is this leg without the fused loss and with one block per unit
    # (the default), which the accumulation test's legs use. Here: a unit of three blocks
    # (a list for fully_shard) and one of a single block.
    ["--nproc-per-node=2", "--parallel.dp_mode=fsdp", "--training.fused_loss=true",
     "--parallel.fsdp_blocks_per_unit=3"],
], ids=["ddp2", "hsdp2x2", "fsdp2-fused-loss"])
def test_layout_matches_one_process(reference, tmp_path, layout):
    proc = train(tmp_path / "run", *layout)
    assert_same_run(tmp_path / "run", reference)
    assert "HSDP 2 replicas x 2 shards" in proc.stderr if "--parallel.dp_replicate=2" in layout else True


def test_gradient_accumulation_matches(reference, tmp_path):
    # (DDP accumulation, also with unequal micro-batch counts per rank, is in test_balance.py.)
    train(tmp_path / "acc2", "--nproc-per-node=2", "--parallel.dp_mode=fsdp", "--training.micro_batch_size=1")
    assert_same_run(tmp_path / "acc2", reference)
    # FSDP2 accumulation reducing every micro-batch instead of only the last.
    train(tmp_path / "acc3", "--nproc-per-node=2", "--parallel.dp_mode=fsdp", "--training.micro_batch_size=2",
          "--parallel.reduce_every_microbatch=true")
    assert_same_run(tmp_path / "acc3", reference)


@pytest.fixture(scope="module")
def float8_reference(tmp_path_factory):
    # Micro-batches of 4, as each of two ranks runs them: float8's activation scales are
    # taken per micro-batch, so the split must match for the runs to compare.
    run = tmp_path_factory.mktemp("float8") / "run"
    train(run, "--nproc-per-node=1", "--training.float8=tensorwise", "--training.micro_batch_size=4")
    return run


def test_float8_is_near_full_precision(reference, float8_reference):
    a, b = records(float8_reference), records(reference)
    gaps = [abs(x["loss"] - y["loss"]) / y["loss"] for x, y in zip(a, b)]
    # The float8 matmuls ran: fp32 alone, split into other micro-batches, differs by ~1e-7;
    # float8 by ~4e-5 from the first step.
    assert max(gaps) >= 1e-5, gaps
    assert max(gaps) <= 1e-3, gaps


def test_float8_ddp_matches_one_process(float8_reference, tmp_path):
    train(tmp_path / "run", "--nproc-per-node=2", "--parallel.dp_mode=ddp", "--training.float8=tensorwise",
          "--training.micro_batch_size=4")
    assert_same_run(tmp_path / "run", float8_reference)


def test_float8_fsdp2_follows_one_process(reference, float8_reference, tmp_path):
    """FSDP2 with the weights gathered in float8 and their scales precomputed after each
    step. Not equal to the bit: FSDP2's fp32 gradients differ from one process's in the
    last bits (see assert_same_run), and float8's 3-bit mantissa turns a weight that moved
    by 1e-7 across a rounding boundary into a 6% change of that element. So: near the
    float8 run on one process, and 10x nearer to it than float8 is to full precision
    (observed: 19x)."""
    run = tmp_path / "run"
    train(run, "--nproc-per-node=2", "--parallel.dp_mode=fsdp", "--training.float8=tensorwise",
          "--training.micro_batch_size=4", "--parallel.fsdp_blocks_per_unit=1")
    a, b = records(run), records(float8_reference)
    assert len(a) == len(b) == STEPS
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-4 * y["loss"], (a, b)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 0.05 * y["grad_norm"], (a, b)  # a scale error: 50%+

    def distance(p, q):
        wa, wb = weights(p), weights(q)
        return float(sum(((wa[k] - wb[k]) ** 2).sum() for k in wa).sqrt() / sum((wb[k] ** 2).sum() for k in wb).sqrt())

    assert distance(run, float8_reference) * 10 <= distance(float8_reference, reference)


def test_two_launchers_on_loopback_form_one_job(reference, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "multinode"
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run}", *COMMON, "--nnodes=2",
           "--nproc-per-node=1", f"--rdzv-endpoint=127.0.0.1:{port}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    nodes = [subprocess.Popen(cmd + [f"--node-rank={r}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [n.communicate(timeout=600) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    assert_same_run(run, reference)


def test_sft_masked_loss_is_layout_independent(tmp_path):
    """With prompt tokens masked, ranks hold different numbers of targets; the global
    token normalisation keeps DDP x2 equal to one process."""
    from duoka.hub import bundled_model_dir

    conv = [{"role": "user", "content": "What does sorted() return?"},
            {"role": "assistant", "content": "A new sorted list."},
            {"role": "user", "content": "And list.sort()?"}, {"role": "assistant", "content": "None; it sorts in place."}]
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": c}) for c in [conv, short] * 40) + "\n")
    args = [f"--model.path={bundled_model_dir()}", "--data.mode=sft", f"--data.path={data}",
            "--data.document_masking=true", "--optimizer.lr=1e-4"]
    one = train(tmp_path / "one", "--nproc-per-node=1", *args)
    assert "80 conversations" in one.stderr
    train(tmp_path / "two", "--nproc-per-node=2", *args)
    assert_same_run(tmp_path / "two", tmp_path / "one")
