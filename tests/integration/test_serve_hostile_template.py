"""`duoka serve` with a hostile chat template (a model folder is untrusted input): each attack
answers 400 quickly, naming the template, while /health answers in under 0.5 s and the
server's memory stays bounded; a render stops when its client leaves, and the server exits
within --grace after SIGTERM even while a render runs. A template that does not compile, or
fails on a plain conversation, is refused at start.

One server for the module: the bundled tiny model with a template that renders ChatML for an
ordinary conversation (so it passes the check at start) and attacks when the last message
names one. The last test stops it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from duoka.host.ports import free_port
from duoka.hub import bundled_model_dir

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 3
START_TIMEOUT_S = 90

ATTACKS = {
    "repeat": "{{ 'x' * 10**9 }}",
    "range": "{{ range(10**9)|list|length }}",
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                 "{{ ns.s }}"),
    # ~1 M iterations of 100 kB each: tens of seconds of work, within the iteration limit
    "slow": ("{% for i in range(1000) %}{% for j in range(990) %}{% set s = ('y' * 100000)|length %}{% endfor %}"
             "{% endfor %}"),
}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def hostile_template() -> str:
    branches = "".join(f"{{% elif last == '{name}' %}}{body}" for name, body in ATTACKS.items())
    return "{% set last = messages[-1]['content'] %}{% if false %}" + branches + "{% else %}" + CHATML + "{% endif %}"


def model_with_template(folder: Path, template: str) -> Path:
    shutil.copytree(bundled_model_dir(), folder)
    (folder / "chat_template.jinja").write_text(template)
    return folder


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path, folder: Path):
        self.proc, self.port, self.log, self.folder = proc, port, log, folder
        self.url = f"http://127.0.0.1:{port}"

    def chat(self, content: str, timeout: float = 30) -> httpx.Response:
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=timeout)

    def status(self, key: str) -> int:
        """A /proc/PID/status figure in kB (VmRSS, VmHWM)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = model_with_template(tmp_path_factory.mktemp("hostile") / "model", hostile_template())
    port = free_port()
    log = folder.parent / "server.log"
    cmd = [sys.executable, "-m", "duoka.cli", "serve", str(folder), "--served-model-name", "tiny",
           "--device", "cpu", "--port", str(port), "--max-model-len", "256", "--num-kv-blocks", "24",
           "--grace", str(GRACE_S)]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    s = Server(proc, port, log, folder)
    deadline = time.monotonic() + START_TIMEOUT_S
    while "serving " not in s.stderr():
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{s.stderr()}"
        assert time.monotonic() < deadline, f"the server did not start in {START_TIMEOUT_S} s:\n{s.stderr()}"
        time.sleep(0.1)
    yield s
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# Probes GET /health every 20 ms until a line arrives on stdin; prints each probe's seconds.
# A process of its own: this one's GIL would otherwise delay the probes, whatever the server does.
HEALTH_PROBE = """
import http.client, select, sys, time
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=10)
print("ready", flush=True)
times = []
while not select.select([sys.stdin], [], [], 0.02)[0]:
    t = time.monotonic()
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
    except OSError:
        conn.close()
    times.append(time.monotonic() - t)
print(" ".join(map(str, times)))
"""


def test_an_ordinary_conversation_renders_and_generates(server):
    r = server.chat("Hello there")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 3


def test_each_attack_is_a_quick_400_naming_the_template_while_health_answers(server):
    server.chat("warm up")
    rss_before = server.status("VmHWM")
    probe = subprocess.Popen([sys.executable, "-c", HEALTH_PROBE, str(server.port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert probe.stdout.readline().strip() == "ready"
    answers = {}

    def attack(name):
        start = time.monotonic()
        r = server.chat(name)
        answers[name] = (r, time.monotonic() - start)

    threads = [threading.Thread(target=attack, args=(name,)) for name in ("repeat", "range", "loops", "doubling")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    out, _ = probe.communicate("stop\n", timeout=30)
    health = [float(x) for x in out.split()]
    template = str(server.folder / "chat_template.jinja")
    for name, (r, took) in answers.items():
        assert r.status_code == 400, (name, r.status_code, r.text)
        message = r.json()["error"]["message"]
        assert f"the chat template in {template} " in message and "broken or hostile" in message, message
        assert "roles" not in message, message
        assert took < 5, f"{name}: answered after {took:.1f} s"
    assert health and max(health) < 0.5, f"/health took up to {max(health):.3f} s"
    grew_mb = (server.status("VmHWM") - rss_before) / 1024
    assert grew_mb < 300, f"the server's peak memory grew by {grew_mb:.0f} MB"
    assert server.chat("Hello again").status_code == 200  # and it serves on


def test_a_render_stops_when_its_client_leaves(server):
    """A client that gives up on a request whose template is still rendering: the render
    stops at once (its thread would otherwise burn a core for the render's 5 s limit)."""
    # CPU rates, not amounts: beside other load the render gets a share of a core (0.16 s in
    # 0.8 s on a loaded 2-core machine), the same share before and after the client leaves.
    before, start = server.cpu_s(), time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        server.chat("slow", timeout=0.8)
    busy = (server.cpu_s() - before) / (time.monotonic() - start)
    assert busy > 0.1, f"the render used {busy:.2f} of a core: it was not running"  # the test measures something
    time.sleep(0.3)
    before, start = server.cpu_s(), time.monotonic()
    time.sleep(1.0)
    idle = (server.cpu_s() - before) / (time.monotonic() - start)
    assert idle < busy / 3, f"{idle:.2f} of a core in the second after the client left ({busy:.2f} before): " \
                            "the render went on"


def test_sigterm_while_a_template_renders_exits_within_the_grace_period(server):
    """Runs last: it stops the module's server."""
    answer = []
    slow = threading.Thread(target=lambda: answer.append(server.chat("slow")))
    slow.start()
    time.sleep(0.5)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(GRACE_S + 5) == 0, server.stderr()
    took = time.monotonic() - start
    slow.join(10)
    # The answer's text shows the render stopped at SIGTERM (not at its 5 s limit); the exit
    # itself (threads joined, the engine's process ended) took 3.5 s on a loaded 2-core
    # machine beside a second test worker, ~1 s alone.
    assert took < 2 * GRACE_S, f"the server took {took:.1f} s to exit"
    assert answer and "the render was stopped (the server is stopping)" in answer[0].text, answer
    assert "Traceback" not in server.stderr()


@pytest.mark.parametrize("template, said", [
    ("{% for m in messages %}{{ m.content }", "does not compile"),
    ("{{ raise_exception('no conversation suits me') }}", "rejected these messages: no conversation suits me"),
    ("{% for m in messages %}{{ m.content * 10**9 }}{% endfor %}", "was stopped: a repeated string"),
], ids=["syntax", "refuses everything", "hostile on every conversation"])
def test_serve_refuses_at_start_a_template_that_fails_a_plain_conversation(tmp_path, in_process, template, said):
    folder = model_with_template(tmp_path / "model", template)
    proc = in_process("serve", str(folder), "--device", "cpu", "--port", str(free_port()))
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1, proc.stderr
    assert said in proc.stderr and str(folder / "chat_template.jinja") in proc.stderr, proc.stderr
    assert "serving" not in proc.stderr and "loaded" not in proc.stderr  # refused before the model loads
