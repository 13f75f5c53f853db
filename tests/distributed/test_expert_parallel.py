"""Expert parallelism (parallel.ep) computes what one process computes (CPU, gloo, fp32), on
the tiny MoE flavor, through the real `duoka train`: per-step loss and gradient norm, and the
exported weights.

One process runs the same micro-batches as the ranks do: the router's load-balancing loss is
a function of each micro-batch's routing (its experts' token shares times their mean
probabilities), so it differs with the micro-batch, not with the layout. (With one process
at a micro-batch of 8 against four ranks at 2 each, plain FSDP2 and ep alike were 9e-4 apart
in their weights after one step, all of it from the router's auxiliary gradient.)
"""

from __future__ import annotations

import pytest

MOE = ("--model.flavor=qwen2-moe-tiny",)
FSDP = ("--parallel.dp_mode=fsdp",)


@pytest.fixture(scope="module")
def moe_runs(layout_runs):
    return layout_runs.variant({}, common=MOE)


def _ep_run(moe_runs, ranks: int, micro: int, ep: int):
    # A checkpoint at step 3 (the resume test continues ep 4's under another layout).
    return moe_runs.once(f"--nproc-per-node={ranks}", *FSDP, f"--parallel.ep={ep}",
                         f"--training.micro_batch_size={micro}", "--checkpoint.interval=3")


@pytest.mark.parametrize("ranks, micro, ep", [
    (2, 4, 2),  # each rank holds 4 of the 8 experts of every MoE layer
    (4, 2, 4),  # 2 experts per rank
    # Two ep groups of 2 (the experts also FSDP2-sharded over the groups), one sample per
    # micro-batch: gradient accumulation across the all-to-alls.
    (4, 1, 2),
], ids=["ep2", "ep4", "ep2-of-4-accumulating"])
def test_ep_matches_one_process(moe_runs, assert_same_run, once_stderr, ranks, micro, ep):
    reference = moe_runs.once("--nproc-per-node=1", f"--training.micro_batch_size={micro}")
    run = _ep_run(moe_runs, ranks, micro, ep)
    assert f"FSDP2 x{ranks} | EP x{ep}" in once_stderr(run)
    assert_same_run(run, reference)


def test_an_ep_checkpoint_resumes_without_ep(moe_runs, resumed_equals):
    """ep 4's step-3 checkpoint (each rank saved its experts) continued by plain FSDP2 on two
    ranks: steps 4 and 5 and the final weights as one process has them."""
    first = _ep_run(moe_runs, 4, 2, 4)
    reference = moe_runs.once("--nproc-per-node=1", "--training.micro_batch_size=2")
    resumed_equals(moe_runs, first, reference, "--nproc-per-node=2", *FSDP, "--training.micro_batch_size=2")


def test_ep_needs_fsdp_and_dividing_sizes(in_process, tmp_path):
    """Refused before any worker starts, naming the fix."""
    proc = in_process("train", f"--job.output_dir={tmp_path / 'a'}", *MOE, "--nproc-per-node=2",
                     "--parallel.dp_mode=ddp", "--parallel.ep=2")
    assert proc.returncode != 0 and "set parallel.dp_mode=fsdp" in proc.stderr, proc.stderr[-2000:]
    proc = in_process("train", f"--job.output_dir={tmp_path / 'b'}", *MOE, "--nproc-per-node=2", *FSDP,
                     "--parallel.ep=2", "--training.compile=true")
    assert proc.returncode != 0 and "parallel.ep=2" in proc.stderr and "compile" in proc.stderr, proc.stderr[-2000:]
    proc = in_process("train", f"--job.output_dir={tmp_path / 'c'}", "--nproc-per-node=2", *FSDP, "--parallel.ep=2")
    assert proc.returncode != 0 and "expert parallelism is for mixture-of-experts" in proc.stderr, proc.stderr[-2000:]
