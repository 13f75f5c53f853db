"""Context parallelism (parallel.cp) computes what one process computes (CPU, gloo, fp32),
through the real `duoka train` of the layout configuration: per-step loss and gradient norm,
and the exported weights, under both methods (parallel.cp_method: the all-gather of keys and
values, and Ulysses' all-to-all over heads). The bundled corpus packs documents into each
window, so the default runs check the document mask across cp ranks; some turn it off."""

from __future__ import annotations

import pytest

FSDP = ("--parallel.dp_mode=fsdp",)
NO_DOCUMENTS = ("--data.document_masking=false",)
ALLGATHER = ("--parallel.cp_method=allgather",)
ULYSSES = ("--parallel.cp_method=ulysses",)


def _cp_run(layout_runs, ranks: int, cp: int, *extra: str):
    # A checkpoint at step 3: the resume test continues one under another cp.
    return layout_runs.once(f"--nproc-per-node={ranks}", *FSDP, f"--parallel.cp={cp}", "--checkpoint.interval=3",
                            *extra)


@pytest.mark.parametrize("ranks, cp, extra", [
    (2, 2, ALLGATHER),  # each rank holds 2 of 4 chunks of every window, documents masked across them
    (4, 4, ALLGATHER + NO_DOCUMENTS),  # plain causal attention over 8 chunks
    # Two cp groups of 2 with batches of their own, one sample per micro-batch (accumulation).
    (4, 2, ALLGATHER + ("--training.micro_batch_size=1",)),
    # The debug model's 4 heads and 2 KV heads: 2 and 1 per rank; the whole window's document
    # mask, in sequence order, on each rank.
    (2, 2, ULYSSES),
    # 1 head per rank; the 2 KV heads repeated to 4 before the exchange, causal attention;
    # the loss fused with the head (duoka plan sets it with checkpointing) on each rank's chunks.
    (4, 4, ULYSSES + NO_DOCUMENTS + ("--training.fused_loss=true",)),
], ids=["cp2-documents", "cp4-causal", "cp2-of-4-accumulating", "ulysses-cp2-documents", "ulysses-cp4-causal"])
def test_cp_matches_one_process(layout_runs, assert_same_run, once_stderr, ranks, cp, extra):
    reference = layout_runs.once("--nproc-per-node=1", *(a for a in extra if a in NO_DOCUMENTS))
    run = _cp_run(layout_runs, ranks, cp, *extra)
    method = "ulysses" if ULYSSES[0] in extra else "allgather"
    assert f"FSDP2 x{ranks} | CP x{cp} ({method})" in once_stderr(run)
    assert ("fused chunked loss" in once_stderr(run)) == ("--training.fused_loss=true" in extra)
    assert_same_run(run, reference)


def test_a_checkpoint_resumes_under_another_cp_and_method(layout_runs, reference, resumed_equals):
    """cp 2 by all-gather on 4 ranks saves at step 3; Ulysses at cp 4 continues, documents
    masked (the repeated KV heads with the document mask): steps 4 and 5 and the final weights
    as one process has them (the parameters never depended on cp or its method)."""
    first = _cp_run(layout_runs, 4, 2, *ALLGATHER, "--training.micro_batch_size=1")
    resumed_equals(layout_runs, first, reference, "--nproc-per-node=4", *FSDP, "--parallel.cp=4", *ULYSSES)


@pytest.mark.parametrize("args, message", [
    (("--nproc-per-node=2", "--parallel.dp_mode=ddp", "--parallel.cp=2"), "set parallel.dp_mode=fsdp"),
    (("--nproc-per-node=2", *FSDP, "--parallel.cp=2", "--training.seq_len=66"), "multiple of 4"),
    (("--nproc-per-node=2", *FSDP, "--parallel.cp=2", "--model.flavor=qwen2-moe-tiny"), "load-balancing loss"),
    (("--nproc-per-node=4", *FSDP, "--parallel.cp=2", "--parallel.tp=2"), "does not combine with parallel.tp=2"),
    (("--nproc-per-node=3", *FSDP, "--parallel.cp=3", "--training.seq_len=66", *ULYSSES),
     "use parallel.cp_method=allgather"),  # the debug model's 4 heads do not divide by 3
], ids=["ddp", "seq-len", "moe", "tp", "ulysses-heads"])
def test_cp_refusals_name_the_fix(in_process, tmp_path, args, message):
    proc = in_process("train", f"--job.output_dir={tmp_path / 'run'}", "--training.steps=1", *args)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
