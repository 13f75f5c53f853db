"""A finished `duoka` command leaves: thread pools left by torch.compile do not hold it, and
a one-process training run gives SIGTERM back once it is done."""

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_exit_is_not_held_by_an_idle_thread_pool():
    # A first torch.compile leaves a ThreadPoolExecutor's idle (non-daemon) workers behind;
    # duoka.cli.run() joined them without telling the pool to finish, and waited forever.
    code = ("from concurrent.futures import ThreadPoolExecutor\n"
            "import duoka.cli as cli\n"
            "pool = ThreadPoolExecutor(2)\n"
            "pool.submit(print, 'task ran').result()\n"
            "cli.main = lambda: 0\n"
            "cli.run()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "task ran" in proc.stdout


def test_worker_main_gives_sigterm_back(monkeypatch, tmp_path):
    import torch

    import duoka.train.entrypoint as worker_module
    from duoka.train.spec import RunSpec

    class QuickTrainer:  # training happens while the worker's SIGTERM handler is installed
        def __init__(self, spec, device, stop):
            assert signal.getsignal(signal.SIGTERM) is not before

        def train(self):
            pass

    monkeypatch.setattr(worker_module, "Trainer", QuickTrainer)
    monkeypatch.setattr(worker_module, "init_distributed", lambda *_: torch.device("cpu"))
    before = signal.getsignal(signal.SIGTERM)
    spec = RunSpec(config={}, run_dir=str(tmp_path), model_args={}, world_size=1, model_dir=None, token_file=None,
                   tokenizer_files=(), end_of_text=None, resume_from=None, resume_step=0, micro_batch=1,
                   fsdp_blocks_per_unit=1, stage_layers=None)
    worker_module.worker_main(spec)
    assert signal.getsignal(signal.SIGTERM) is before
