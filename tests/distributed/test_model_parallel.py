"""Tensor and pipeline parallelism, alone and combined with data parallelism, compute what
one process computes (CPU, gloo, fp32): the real `duoka train` for 5 steps, compared step
by step (loss, gradient norm) and in the final weights with a single-process run. The
debug model has tied embeddings, so every pipeline case also checks the tied weight
shared between the first and last stage.

Checkpoints written under one layout resume under another.
"""

import json
import shutil

import pytest

PP = ["--parallel.pp=2", "--training.micro_batch_size=2"]  # 4 micro-batches through the pipeline
TP2 = ["--nproc-per-node=2", "--parallel.tp=2"]
FSDP2 = ["--nproc-per-node=2", "--parallel.dp_mode=fsdp"]


@pytest.fixture(scope="module")
def tp2_run(layout_runs):
    """A tp=2 run with a checkpoint at step 3: checked against one process, and resumed
    under another layout."""
    return layout_runs.once("--checkpoint.interval=3", *TP2)


def test_tensor_parallel_matches_one_process(reference, tp2_run, assert_same_run):
    assert_same_run(tp2_run, reference)


# Each schedule runs with pp=2: gpipe (layers split by measured cost) and 1f1b (an
# explicit uneven split) alone, zero bubble next to data parallelism, interleaved 1F1B in
# the 8-process dp x tp x pp mesh.
@pytest.mark.parametrize("layout", [
    ["--nproc-per-node=2", *PP, "--parallel.pp_schedule=gpipe", "--parallel.pp_layers=measured"],
    ["--nproc-per-node=2", *PP, "--parallel.pp_schedule=1f1b", "--parallel.pp_layers=1,3"],
    ["--nproc-per-node=4", "--parallel.dp_mode=fsdp", "--parallel.tp=2"],
    ["--nproc-per-node=4", "--parallel.dp_mode=ddp", *PP, "--parallel.pp_schedule=zero_bubble",
     "--parallel.pp_stages_per_rank=2"],
    ["--nproc-per-node=8", "--parallel.dp_mode=fsdp", "--parallel.tp=2", *PP,
     "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_stages_per_rank=2"],
], ids=["pp2-gpipe", "pp2-1f1b-uneven", "fsdp2xtp2", "dp2xpp2-zero-bubble", "fsdp2xtp2xpp2-interleaved"])
def test_model_parallel_layout_matches_one_process(layout_runs, reference, assert_same_run, tmp_path, layout):
    layout_runs(tmp_path / "run", *layout)
    assert_same_run(tmp_path / "run", reference)


# Compiled: under tp each block's attention and MLP bodies (the plan's hooks stay eager),
# under pp each stage's whole blocks; against the eager single process.
@pytest.mark.parametrize("layout", [TP2, ["--nproc-per-node=2", *PP, "--parallel.pp_schedule=1f1b"]],
                         ids=["tp2", "pp2-1f1b"])
def test_compiled_model_parallel_matches_one_process(layout_runs, reference, assert_compiled_run, compile_flags,
                                                     tmp_path, layout):
    proc = layout_runs(tmp_path / "run", *compile_flags, *layout)
    assert "| compiled |" in proc.stderr and "step 1 compiled in" in proc.stderr, proc.stderr[-3000:]
    assert_compiled_run(tmp_path / "run", reference)


@pytest.fixture
def resume_matches(layout_runs, reference, records, assert_same_run, tmp_path):
    """resume_matches(first, target_layout): continue from the step-3 checkpoint of run
    `first` under another layout: steps 4 and 5 and the final weights equal the
    uninterrupted single-process run."""

    def check(first, target_layout):
        second = tmp_path / "second"
        layout_runs(second, f"--checkpoint.resume={first / 'checkpoints' / 'step-3'}", *target_layout)
        ref = records(reference)
        got = records(second)
        assert [r["step"] for r in got] == [4, 5]
        # assert_same_run reads whole runs: give the resumed run the first three records.
        full = tmp_path / "full"
        shutil.copytree(second, full)
        (full / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ref[:3] + got))
        assert_same_run(full, reference)

    return check


def test_checkpoint_from_tensor_parallel_resumes_under_fsdp(resume_matches, tp2_run):
    resume_matches(tp2_run, FSDP2)


def test_checkpoint_from_fsdp_resumes_under_tensor_and_pipeline_parallel(resume_matches, fsdp_accumulation_run):
    """The pipeline's last stage holds its own copy of the tied embedding: it must find
    its weight and optimizer state under the single model's names. The FSDP2 run (2 ranks,
    a checkpoint at step 3) is also a layout of test_layouts.py, trained once for both."""
    resume_matches(fsdp_accumulation_run, ["--nproc-per-node=4", "--parallel.tp=2", *PP])


def test_impossible_layout_is_refused_before_workers_start(duoka, layout_runs, tmp_path):
    proc = duoka("train", f"--job.output_dir={tmp_path / 'run'}", *layout_runs.common, "--nproc-per-node=3",
                 "--parallel.tp=3", timeout=120)
    assert proc.returncode != 0
    assert "4 attention heads and 2 KV heads" in proc.stderr and "use parallel.tp in [1, 2]" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "process(es)" not in proc.stderr  # nothing was launched
