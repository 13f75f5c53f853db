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
    import duoka.train.trainer as trainer_module

    class QuickTrainer:  # installs its handler as the real trainer does, then has nothing to train
        def __init__(self, spec):
            self.stop_requested = False
            signal.signal(signal.SIGTERM, lambda signum, frame: None)

        def train(self):
            pass

    monkeypatch.setattr(trainer_module, "Trainer", QuickTrainer)
    before = signal.getsignal(signal.SIGTERM)
    spec = trainer_module.WorkerSpec(config={}, run_dir=str(tmp_path), model_args={}, model_dir=None,
                                     token_file=None, tokenizer_files=[])
    trainer_module.worker_main(spec)
    assert signal.getsignal(signal.SIGTERM) is before
