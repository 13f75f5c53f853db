"""Resumable checkpoints: exact resume, resharding onto other layouts, crash safety, export."""

import os
import signal
import subprocess
import time

import pytest
import torch

# Constant lr after warmup, so a run configured for 4 steps and one for 8 see the same lr
# at each step and "4 steps, then resume to 8" must equal "8 steps" exactly.
COMMON = ["--training.seq_len=32", "--training.global_batch_size=8", "--training.dtype=fp32",
          "--optimizer.warmup_steps=2", "--optimizer.schedule=constant", "--metrics.log_interval=100"]


@pytest.fixture(scope="module")
def straight(duoka, tmp_path_factory):
    """8 steps under FSDP2 on 2 ranks, saved in the background every 2 steps, the last 2 kept:
    the uninterrupted run of the resume test, and the async save's and export's run."""
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = duoka.ok("train", f"--job.output_dir={run}", "--training.steps=8", "--checkpoint.interval=2",
                    "--checkpoint.keep=2", "--checkpoint.async_save=true", "--nproc-per-node=2",
                    "--parallel.dp_mode=fsdp", *COMMON)
    return run, proc


def test_resume_is_exact_and_reshards(duoka, straight, records, weights, tmp_path):
    straight, _ = straight
    # 4 steps under FSDP2 on 2 ranks, then 4 more on the same layout: bit-exact (and equal to
    # the run saved in the background: a save changes no number).
    same = tmp_path / "same"
    duoka.ok("train", f"--job.output_dir={same}", "--training.steps=4", "--nproc-per-node=2",
             "--parallel.dp_mode=fsdp", *COMMON)
    proc = duoka.ok("train", f"--job.output_dir={same}", "--training.steps=8", "--checkpoint.resume=auto",
                    "--nproc-per-node=2", "--parallel.dp_mode=fsdp", *COMMON)
    assert "resumed at step 4" in proc.stderr
    a, b = records(straight), records(same)
    assert [r["step"] for r in b] == list(range(1, 9))  # each step once
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    wa, wb = weights(straight, 8), weights(same, 8)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # Resuming under another layout (DCP resharding) is tested in
    # tests/distributed/test_model_parallel.py (tp=2 -> FSDP2, FSDP2 -> tp2 x pp2).


def test_async_keep_last_k_and_export_round_trip(duoka, straight, tmp_path):
    from transformers import Qwen2ForCausalLM

    from duoka.models.qwen2.hf_adapter import load_hf_model

    run, proc = straight
    assert proc.stderr.count("written in the background: training blocked") == 4  # steps 2, 4, 6 and 8
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-6", "step-8"]
    out = tmp_path / "exported"
    proc = duoka.ok("export", str(run / "checkpoints" / "step-8"), "--out", str(out), "--dtype", "float32",
                    "--max-shard-size", "2MB")
    assert proc.stdout.strip() == str(out)
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    tokens = torch.randint(0, 4096, (2, 16))
    ours, _ = load_hf_model(run / "hf" / "step-8")
    theirs = Qwen2ForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.allclose(theirs(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


def test_kill_during_save_leaves_the_previous_checkpoint(duoka, records, tmp_path):
    """kill -9 the whole job while a checkpoint is being written: the newest complete
    checkpoint still loads and the run continues from it."""
    run = tmp_path / "run"
    job = duoka.popen("train", f"--job.output_dir={run}", "--training.steps=400", "--checkpoint.interval=1",
                      "--checkpoint.keep=3", "--nproc-per-node=2", *COMMON, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    caught = False
    while time.time() < deadline and job.poll() is None:
        partial = list((run / "checkpoints").glob("*.partial")) if (run / "checkpoints").is_dir() else []
        done = [p for p in (run / "checkpoints").glob("step-*") if not p.name.endswith(".partial")] if partial else []
        if partial and done:
            os.killpg(job.pid, signal.SIGKILL)
            caught = True
            break
        time.sleep(0.005)
    job.wait(timeout=60)
    assert caught, "never saw a save in progress"

    from duoka.train.checkpoint_io import complete_checkpoints

    complete = complete_checkpoints(run)
    assert complete and all(not p.name.endswith(".partial") for p in complete)
    last = int(complete[-1].name.split("-")[1])
    proc = duoka.ok("train", f"--job.output_dir={run}", f"--training.steps={last + 2}", "--checkpoint.resume=auto",
                    "--nproc-per-node=2", *COMMON)
    assert f"resumed at step {last}" in proc.stderr
    assert [r["step"] for r in records(run)] == list(range(1, last + 3))


def test_sigterm_saves_then_stops(duoka, records, tmp_path):
    """SIGTERM to the launcher (what a scheduler sends on preemption) reaches the workers
    through the elastic agent; they finish the step, save, and the job exits with 143."""
    run = tmp_path / "run"
    job = duoka.popen("train", f"--job.output_dir={run}", "--training.steps=100000", "--nproc-per-node=2", *COMMON,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and len(records(run)) >= 3):
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 143, err[-2000:]
    assert "stopped by SIGTERM" in err and "--checkpoint.resume=auto" in err, err[-2000:]
    from duoka.train.checkpoint_io import complete_checkpoints

    saved = complete_checkpoints(run)
    assert saved and int(saved[-1].name.split("-")[1]) == records(run)[-1]["step"]
