"""The private Python and PyTorch APIs duoka.runtime relies on are still there: after an
upgrade, a failure here names the API and the duoka function to rework."""

import atexit
import inspect
import signal
import subprocess
import sys
import threading
import time
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


def test_fused_adamw_skips_the_step_on_found_inf():
    assert '"found_inf"' in inspect.getsource(torch.optim.Adam.step), \
        "Adam.step no longer reads the optimizer's found_inf: duoka.runtime.set_found_inf (Health) skips nothing"
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 4))
    opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, fused=True)
    p.grad = torch.randn_like(p)
    opt.step()
    before = {"param": p.detach().clone(), **{k: v.clone() for k, v in opt.state[p].items()}}
    p.grad = torch.full_like(p, float("nan"))
    runtime.set_grad_divisor(opt, torch.tensor(float("nan")))  # clip_to_norm's divisor from a NaN norm
    runtime.set_found_inf(opt, torch.tensor(1.0))
    opt.step()
    after = {"param": p.detach(), **opt.state[p]}
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"fused AdamW changed {changed} on a found_inf step: duoka.runtime.set_found_inf is wrong"
    p.grad = torch.randn_like(p)
    runtime.set_grad_divisor(opt, torch.tensor(1.0))
    runtime.set_found_inf(opt, torch.tensor(0.0))
    opt.step()
    assert int(opt.state[p]["step"]) == 2 and not torch.equal(p.detach(), before["param"])


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


def test_parent_death_signal_ends_an_orphan():
    """duoka.runtime.set_parent_death_signal (prctl, through ctypes): a worker dies with its parent."""
    child = ("import signal, time\n"
             "from duoka import runtime\n"
             "runtime.set_parent_death_signal(signal.SIGKILL)\n"
             "print(runtime.parent_death_signal(), flush=True)\n"
             "time.sleep(60)\n")
    parent = ("import subprocess, sys\n"
              f"child = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True)\n"
              "print(child.pid, child.stdout.readline().strip(), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", parent], cwd=ROOT, capture_output=True, text=True, timeout=60)
    pid, asked = proc.stdout.split()
    assert asked == str(int(signal.SIGKILL)), proc.stderr
    deadline = time.time() + 10
    while time.time() < deadline and _alive(int(pid)):
        time.sleep(0.01)
    assert not _alive(int(pid)), "the child outlived its parent: duoka.runtime.set_parent_death_signal is broken"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_elastic_agent_can_be_hooked():
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    originals = {name: getattr(LocalElasticAgent, name, None) for name in ("_monitor_workers", "_shutdown")}
    for name, method in originals.items():
        assert callable(method), f"LocalElasticAgent.{name} is gone: duoka.runtime.elastic_agent_hooks is broken"
    assert "self._remaining_restarts > 0" in inspect.getsource(SimpleElasticAgent._invoke_run), \
        "the agent no longer restarts by _remaining_restarts: duoka.runtime.elastic_agent_hooks cannot stop one"
    assert "self._pcontext" in inspect.getsource(LocalElasticAgent._shutdown), \
        "LocalElasticAgent keeps no _pcontext: duoka.runtime.elastic_agent_hooks cannot kill the workers"
    with runtime.elastic_agent_hooks(lambda failures: True):
        assert all(getattr(LocalElasticAgent, name) is not method for name, method in originals.items())
    assert all(getattr(LocalElasticAgent, name) is method for name, method in originals.items())


def test_the_rendezvous_store_can_be_renewed_and_bound():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    source = inspect.getsource(DynamicRendezvousHandler.next_rendezvous)
    for name in ("self._bootstrap_store_info", "self._shared_tcp_store_server", "self._create_tcp_store_server("):
        assert name in source, (f"DynamicRendezvousHandler.next_rendezvous no longer uses {name}: "
                                "duoka.runtime.register_rendezvous cannot renew or bind the workers' store")
    store = runtime._bound_store("127.0.0.1", 0, 5)
    assert _listening_on(store.port) == ["0100007F"], "the store does not listen on 127.0.0.1 alone"


def _listening_on(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* write them) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:] if Path(table).exists() else []:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found
