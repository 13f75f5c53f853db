"""`duoka train` in a scheduler's environment, without the scheduler: the launcher takes the
node figures and the per-job run directory from it, prints where they came from, and refuses
what cannot work with the cause and the fix (the real Slurm: test_slurm.py)."""

import json
import subprocess

# The batch step of a one-node Slurm job, as sbatch sets it (no srun: no SLURM_STEP_ID).
BATCH = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
         "SLURM_JOB_NODELIST": "node01"}
TINY = ("--training.seq_len=32", "--training.global_batch_size=2", "--checkpoint.export_final=false",
        "--checkpoint.resume=auto")


def test_a_slurm_job_trains_and_resumes_in_its_own_run_directory(duoka, tmp_path):
    def train(steps: int) -> subprocess.CompletedProcess:
        proc = subprocess.run(duoka.command("train", *TINY, f"--training.steps={steps}"), cwd=tmp_path,
                              env=duoka.env(BATCH), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    first = train(2)
    assert ("duoka: Slurm job 77: node 0 of 1 (SLURM_JOB_NUM_NODES); no GPU from Slurm; run directory "
            "runs/<model>-slurm-77 unless job.output_dir is set") in first.stderr
    run = tmp_path / "runs" / "debug-slurm-77"
    again = train(3)  # the job, requeued: same id, same command
    assert "duoka: resuming from runs/debug-slurm-77/checkpoints/step-2 (step 2)" in again.stderr
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_scheduler_environments_that_cannot_work_are_refused(in_process, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    proc = in_process("train")
    assert proc.returncode == 2 and "this Slurm job has 2 nodes (SLURM_JOB_NUM_NODES) but duoka train was started " \
        "outside srun" in proc.stderr
    assert "fix: start it on every node with `srun --ntasks-per-node=1 duoka train ...`" in proc.stderr
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    proc = in_process("train")
    assert proc.returncode == 2 and "PET_NNODES=2 but no rendezvous endpoint is set" in proc.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything was written
