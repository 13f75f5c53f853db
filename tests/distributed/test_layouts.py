"""Every data-parallel layout computes what one process computes (CPU, gloo, fp32).

Runs the real `duoka train` for 5 steps per layout, same global batch and seed, and
compares the per-step losses (relative difference <= 1e-5) and the final weights.
"""

import json
import socket
import subprocess

import pytest
import torch

from duoka.hub import bundled_model_dir


def test_loss_falls_in_reference(reference, records):
    ls = [r["loss"] for r in records(reference)]
    assert ls[-1] < ls[0]


# Each layout, and how the run's banner names its data parallelism. (DDP x2, the default on
# two processes: the run whose compile check fails on one rank, below, trains it eagerly.)
@pytest.mark.parametrize("layout, banner", [
    # All four blocks of the debug model in one FSDP2 unit.
    (["--nproc-per-node=4", "--parallel.dp_mode=fsdp", "--parallel.dp_replicate=2",
      "--parallel.fsdp_blocks_per_unit=0"], "HSDP 2 replicas x 2 shards"),
    # Plain FSDP2 on 2 ranks is this leg without the fused loss and with one block per unit
    # (the default), which the accumulation test's legs use. Here: a unit of three blocks
    # (a list for fully_shard) and one of a single block.
    (["--nproc-per-node=2", "--parallel.dp_mode=fsdp", "--training.fused_loss=true",
      "--parallel.fsdp_blocks_per_unit=3"], "FSDP2 x2"),
], ids=["hsdp2x2", "fsdp2-fused-loss"])
def test_layout_matches_one_process(layout_runs, reference, assert_same_run, tmp_path, layout, banner):
    proc = layout_runs(tmp_path / "run", *layout)
    assert_same_run(tmp_path / "run", reference)
    assert banner in proc.stderr, proc.stderr[-3000:]


def test_a_compiler_failing_on_one_rank_leaves_every_rank_uncompiled(layout_runs, reference, assert_same_run,
                                                                     compile_flags, tmp_path):
    """Rank 1's compile check fails (its compiler raises), rank 0's passes: both train the
    uncompiled model (they would otherwise wait in different collectives), after one
    warning that names the cause, the failing rank and the switch. The run is also the DDP x2
    layout's (the default on two processes): it must compute what one process computes."""
    run = tmp_path / "run"
    proc = layout_runs(run, "--nproc-per-node=2", *compile_flags, "--debug.fail_compile_ranks=1")
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert ("torch.compile failed on rank 1 (RuntimeError: compiler failure injected by debug.fail_compile_ranks; "
            f"whole error in {run / 'compile-error-rank1.txt'})") in warnings[0]
    assert "--training.compile=false" in warnings[0]
    assert "BackendCompilerFailed" in (run / "compile-error-rank1.txt").read_text()
    assert "| compiled |" not in proc.stderr and "step 1: compiling" not in proc.stderr
    assert "DDP x2" in proc.stderr, proc.stderr[-3000:]
    assert_same_run(run, reference)  # the eager DDP run, exactly


def test_gradient_accumulation_matches(layout_runs, reference, fsdp_accumulation_run, assert_same_run, tmp_path):
    # (DDP accumulation, also with unequal micro-batch counts per rank, is in test_balance.py.)
    # FSDP2 on 2 ranks, one sample per micro-batch (a session fixture: test_model_parallel.py
    # resumes its step-3 checkpoint).
    assert_same_run(fsdp_accumulation_run, reference)
    # FSDP2 accumulation reducing every micro-batch instead of only the last.
    layout_runs(tmp_path / "acc3", "--nproc-per-node=2", "--parallel.dp_mode=fsdp", "--training.micro_batch_size=2",
                "--parallel.reduce_every_microbatch=true")
    assert_same_run(tmp_path / "acc3", reference)


# The float8 runs: a two-layer model of width 64 at seq 16 (float8 matmuls run on the CPU's
# reference path, ~30M multiply-adds a second: 4 s a step for the debug flavor) and one
# thread per process. float8 rounds each matmul's fp32 result to a 3-bit mantissa, so a
# last-bit difference from another thread count (another summation order) became ~1e-3 of
# the gradient norm: each of two DDP ranks on 2 cores runs one thread. Three steps of a
# global batch of 4 (two ranks of one micro-batch of 2): the first step checks the gathered
# float8 weights and scales exactly, the next two follow the updates.
FLOAT8_ARGS = ("--training.seq_len=16", "--training.global_batch_size=4", f"--model.tokenizer={bundled_model_dir()}")
FLOAT8_ENV = {"OMP_NUM_THREADS": "1"}
FLOAT8_STEPS = 3


@pytest.fixture(scope="module")
def float8_runs(layout_runs, saved_hf_model):
    model = saved_hf_model(vocab_size=4096, noise=0.02)  # the bundled tokenizer's 4,096 ids
    return layout_runs.variant(FLOAT8_ENV, (*FLOAT8_ARGS, f"--model.path={model}"), steps=FLOAT8_STEPS)


@pytest.fixture(scope="module")
def float8_fp32_reference(float8_runs):
    return float8_runs.once("--nproc-per-node=1")


@pytest.fixture(scope="module")
def float8_reference(float8_runs):
    # Micro-batches of 2, as each of two ranks runs them: float8's activation scales are
    # taken per micro-batch, so the split must match for the runs to compare.
    return float8_runs.once("--nproc-per-node=1", "--training.float8=tensorwise", "--training.micro_batch_size=2")


def test_float8_is_near_full_precision(float8_fp32_reference, float8_reference, records):
    a, b = records(float8_reference), records(float8_fp32_reference)
    gaps = [abs(x["loss"] - y["loss"]) / y["loss"] for x, y in zip(a, b)]
    # The float8 matmuls ran: fp32 alone, split into other micro-batches, differs by ~1e-7;
    # float8 by 2e-4 to 4e-4 (the debug flavor: 4e-5 to 1.1e-3) at this batch of 4 x 16 tokens.
    # A wrong scale moves the loss by whole percents.
    assert max(gaps) >= 1e-5, gaps
    assert max(gaps) <= 3e-3, gaps


def test_float8_ddp_matches_one_process(float8_runs, float8_reference, assert_same_run, tmp_path):
    float8_runs(tmp_path / "run", "--nproc-per-node=2", "--parallel.dp_mode=ddp", "--training.float8=tensorwise",
                "--training.micro_batch_size=2")
    assert_same_run(tmp_path / "run", float8_reference, steps=FLOAT8_STEPS)


# FSDP2 with float8 weights gathered in float8 (torchao's tensor subclass), one block per unit.
FLOAT8_FSDP = ("--nproc-per-node=2", "--parallel.dp_mode=fsdp", "--training.float8=tensorwise",
               "--training.micro_batch_size=2", "--parallel.fsdp_blocks_per_unit=1")


@pytest.fixture(scope="module")
def float8_fsdp_run(float8_runs):
    return float8_runs.once(*FLOAT8_FSDP, "--checkpoint.interval=2")  # step 2's: the resume test's start


def test_float8_fsdp2_follows_one_process(float8_runs, float8_fsdp_run, float8_fp32_reference, float8_reference,
                                          records, weights):
    """FSDP2 with the weights gathered in float8 and their scales precomputed after each
    step. The first step's forward uses the gathered float8 weights and their scales from
    the same initial weights, so its loss equals one process's (a wrong scale would show
    here). After it, not equal to the bit: FSDP2's fp32 gradients differ from one
    process's in the last bits (see assert_same_run), Adam turns a near-zero gradient's
    last bits into an lr-sized step, and float8's 3-bit mantissa turns a weight that moved
    by 1e-7 across a rounding boundary into a 6% change of that element. So later steps
    are near the float8 run on one process, and the final weights 3x nearer to it than
    float8 is to full precision (observed with the debug flavor: 5.4-7.3x on a 2-core Xeon
    without float8 matmuls, 19x on another machine; with this model on the latter, equal
    losses and 1.9e5x)."""
    run = float8_fsdp_run
    a, b = records(run), records(float8_reference)
    assert len(a) == len(b) == float8_runs.steps
    assert abs(a[0]["loss"] - b[0]["loss"]) <= 1e-6 * b[0]["loss"], (a[0], b[0])
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-3 * y["loss"], (a, b)  # float8 against fp32: 2e-4 to 4e-4
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 0.05 * y["grad_norm"], (a, b)  # a scale error: 50%+

    def distance(p, q):
        wa, wb = weights(p, float8_runs.steps), weights(q, float8_runs.steps)
        return float(sum(((wa[k] - wb[k]) ** 2).sum() for k in wa).sqrt() / sum((wb[k] ** 2).sum() for k in wb).sqrt())

    assert distance(run, float8_reference) * 3 <= distance(float8_reference, float8_fp32_reference)


def test_float8_fsdp2_resume_is_exact(float8_runs, float8_fsdp_run, records, weights, tmp_path):
    """The checkpoint saves and restores the float8 weights FSDP2 gathers (torchao's tensor
    subclass), and the run continues bit for bit: resumed from the run's step-2 checkpoint,
    its third step and final weights equal the uninterrupted run's."""
    resumed = tmp_path / "resumed"
    proc = float8_runs(resumed, *FLOAT8_FSDP, f"--checkpoint.resume={float8_fsdp_run / 'checkpoints' / 'step-2'}")
    assert "resumed at step 2" in proc.stderr and "float8 tensorwise" in proc.stderr
    assert [r["loss"] for r in records(float8_fsdp_run)][2:] == [r["loss"] for r in records(resumed)]
    wa, wb = weights(float8_fsdp_run, FLOAT8_STEPS), weights(resumed, FLOAT8_STEPS)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_launchers_on_loopback_form_one_job(duoka, layout_runs, reference, assert_same_run, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "multinode"
    cmd = layout_runs.command(run, "--nnodes=2", "--nproc-per-node=1", f"--rdzv-endpoint=127.0.0.1:{port}")
    # Both "nodes" share this machine's cores: one thread each (a launcher of one process
    # leaves torch its default of a thread per core, and two of them ran 10x slower).
    nodes = [subprocess.Popen(cmd + [f"--node-rank={r}"], cwd=duoka.root, env=duoka.env({"OMP_NUM_THREADS": "1"}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [n.communicate(timeout=600) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    assert_same_run(run, reference)


def test_sft_masked_loss_is_layout_independent(layout_runs, assert_same_run, tmp_path):
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
    one = layout_runs(tmp_path / "one", "--nproc-per-node=1", *args)
    assert "80 conversations" in one.stderr
    layout_runs(tmp_path / "two", "--nproc-per-node=2", *args)
    assert_same_run(tmp_path / "two", tmp_path / "one")
