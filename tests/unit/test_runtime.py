"""The private Python and PyTorch APIs duoka.runtime relies on are still there: after an
upgrade, a failure here names the API and the duoka function to rework."""

import atexit
import inspect
import subprocess
import sys
import threading
from multiprocessing import forkserver
from pathlib import Path

import torch

from duoka import runtime

ROOT = Path(__file__).resolve().parents[2]


def test_thread_pool_exit_hooks_exist():
    assert isinstance(getattr(threading, "_threading_atexits", None), list), \
        "threading._threading_atexits is gone: duoka.runtime.exit_now can no longer tell thread pools to finish"


def test_exit_handlers_can_be_run_early():
    assert callable(getattr(atexit, "_run_exitfuncs", None)), \
        "atexit._run_exitfuncs is gone: duoka.runtime.exit_now can no longer run the exit handlers before os._exit"


def test_forkserver_can_be_stopped():
    server = getattr(forkserver, "_forkserver", None)
    assert isinstance(server, forkserver.ForkServer), \
        "multiprocessing.forkserver._forkserver is gone: duoka.runtime.stop_forkserver cannot find the server"
    assert hasattr(server, "_forkserver_pid") and callable(getattr(server, "_stop", None)), \
        "ForkServer._forkserver_pid or ForkServer._stop is gone: duoka.runtime.stop_forkserver cannot end the server"


def test_device_sleep_exists():
    assert callable(getattr(torch.cuda, "_sleep", None)), \
        "torch.cuda._sleep is gone: duoka.runtime.device_sleep (BlockTimer's debug slowdown) has no device spin"


def test_fused_adamw_divides_gradients_by_grad_scale():
    assert '"grad_scale"' in inspect.getsource(torch.optim.Adam.step), \
        "Adam.step no longer reads the optimizer's grad_scale: duoka.runtime.set_grad_divisor (clip_to_norm) is ignored"
    steps = {}
    for name, fused, grad_scale in [("divided", True, 4.0), ("reference", False, None)]:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8, 4))
        opt = torch.optim.AdamW([p], lr=1e-2, eps=1.0, fused=fused)  # eps this large: the scale shows
        for _ in range(2):
            p.grad = torch.full_like(p, 2.0) if grad_scale else torch.full_like(p, 0.5)
            if grad_scale:
                runtime.set_grad_divisor(opt, torch.tensor(grad_scale))
            opt.step()
        steps[name] = p.detach().clone()
    assert torch.allclose(steps["divided"], steps["reference"], atol=1e-6), \
        "fused AdamW no longer divides gradients by grad_scale: duoka.runtime.set_grad_divisor (clip_to_norm) is wrong"


def test_exit_now_runs_exit_handlers_and_keeps_the_code():
    code = ("import atexit\n"
            "from duoka import runtime\n"
            "atexit.register(print, 'handler ran')\n"
            "runtime.exit_now(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "handler ran\n"


def test_runtime_imports_no_torch():
    """`duoka` commands and the launcher import runtime before torch is needed."""
    code = "import sys, duoka.runtime\nassert 'torch' not in sys.modules\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
