"""Tensor and pipeline parallelism, alone and combined with data parallelism, compute what
one process computes (CPU, gloo, fp32): the real `duoka train` for 5 steps, compared step
by step (loss, gradient norm) and in the final weights with a single-process run. The
debug model has tied embeddings, so every pipeline case also checks the tied weight
shared between the first and last stage.

Checkpoints written under one layout resume under another.
"""

import re

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
PP2_1F1B = ["--nproc-per-node=2", *PP, "--parallel.pp_schedule=1f1b"]


@pytest.mark.parametrize("layout", [TP2, PP2_1F1B], ids=["tp2", "pp2-1f1b"])
def test_compiled_model_parallel_matches_one_process(layout_runs, reference, assert_compiled_run, compile_cache,
                                                     compile_flags, once_stderr, layout):
    run = layout_runs.once(*compile_flags, *layout)
    stderr = once_stderr(run)
    assert "| compiled |" in stderr, stderr[-3000:]
    assert f"step 1: compiling (artefacts cached in {compile_cache} for the next launch) ..." in stderr
    assert re.search(r"\nstep 1 compiled in \d+\.\d s\n", stderr), stderr[-3000:]
    assert_compiled_run(run, reference)


# pp2 rather than tp2: a second tp2 launch still writes new entries (13 s against 34 s cold;
# not yet explained, bench/NOTES.md 21).
def test_a_second_launch_finds_every_compiled_graph(layout_runs, compile_cache, compile_flags, tmp_path):
    """The compiled pp2 run wrote its graphs to the compile cache: the same configuration
    launched again finds every one (it writes no new entry) and skips the compile check. (The
    folder's default under the user's cache directory: tests/unit/test_compiling.py.)"""

    def entries():  # Inductor's compiled graphs and AOTAutograd's forward/backward pairs
        return sorted(p.relative_to(compile_cache) for kind in ("fxgraph", "aotautograd")
                      for p in (compile_cache / kind).rglob("*") if p.is_file())

    layout_runs.once(*compile_flags, *PP2_1F1B)  # the first launch, if no test made it yet
    made = entries()
    assert {path.parts[0] for path in made} == {"fxgraph", "aotautograd"}
    second = layout_runs(tmp_path / "second", *compile_flags, *PP2_1F1B)
    assert re.search(r"\nstep 1 compiled in \d+\.\d s\n", second.stderr), second.stderr[-3000:]
    assert "compile check: passed before with this configuration, skipped" in second.stderr
    assert entries() == made


@pytest.fixture
def resume_matches(layout_runs, reference, resumed_equals):
    """resume_matches(first, target_layout): continue from the step-3 checkpoint of run
    `first` under another layout: steps 4 and 5 and the final weights equal the
    uninterrupted single-process run."""
    return lambda first, target_layout: resumed_equals(layout_runs, first, reference, *target_layout)


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
