"""The hang watchdog's decisions, driven tick by tick with a fake clock, ranks sharing an
in-memory store and a fake process table (tests/integration/test_hang.py runs the real one)."""

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from duoka.config import ReliabilityConfig
from duoka.train import watchdog as wd


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Exited(Exception):
    pass


class Processes(wd.Process):
    """One rank's view of the process table: states by pid, and what it did to them."""

    def __init__(self, pid: int, states: dict[int, str], done: list):
        self.pid, self.states, self.done = pid, states, done

    def dump_stacks(self, path, header):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(header)

    def sibling_state(self, pid):
        return self.states.get(pid)

    def resume(self, pid):
        self.done.append(("resume", pid))
        self.states[pid] = "S"

    def kill(self, pid):
        self.done.append(("kill", pid))

    def exit(self, code):
        raise Exited(code)


class Console:
    def __init__(self):
        self.lines = []

    def print(self, text):
        self.lines.append(text)


@pytest.fixture
def job(tmp_path):
    """job(world, nodes=None): that many watchdogs on one fake clock and store; each has
    .console and .done (its actions)."""
    clock, states = Clock(), {}

    def make(world: int, nodes=None, timeout=10.0):
        store = dist.HashStore() if world > 1 else None
        cfg = ReliabilityConfig(hang_timeout_s=timeout, straggler_factor=5.0)
        dogs = []
        for rank in range(world):
            pid = 100 + rank
            states[pid] = "S"
            done, console = [], Console()
            dog = wd.Watchdog(cfg, tmp_path, rank, world, "cpu", 0, console, store,
                              node=str(nodes[rank]) if nodes else "0", process=Processes(pid, states, done),
                              clock=clock, thread=False)
            dog.done, dog.console, dog.pid = done, console, pid
            dogs.append(dog)
        return dogs

    make.clock, make.states, make.run_dir = clock, states, tmp_path
    return make


def run_steps(job, dogs, first: int, last: int, seconds: float = 1.0):
    """Steps first..last on every rank, `seconds` each, every rank ticking once a step."""
    for step in range(first, last + 1):
        for dog in dogs:
            dog.begin_step(step)
            dog.enter("all_reduce of the token count")
            dog.enter("forward and backward")
        job.clock.now += seconds
        for dog in dogs:
            dog.tick()


def tick_for(job, dogs, seconds: float, every: float = 1.0):
    for _ in range(round(seconds / every)):
        job.clock.now += every
        for dog in dogs:
            dog.tick()


def error_of(job, rank: int) -> dict:
    return json.loads((job.run_dir / f"error-rank{rank}.json").read_text())


def test_a_stopped_rank_ends_the_job_with_its_name_and_every_stack(job):
    r0, r1 = dogs = job(2)
    run_steps(job, dogs, 1, 3)
    r0.begin_step(4)
    r0.enter("all_reduce of the token count")
    r1.begin_step(4)
    r1.tick()
    job.states[r1.pid] = "T"  # SIGSTOP: rank 1 ticks no more
    tick_for(job, [r0], 10.0)
    assert not (job.run_dir / "hang").exists()  # not yet past the timeout
    tick_for(job, [r0], 1.0)  # declared; the stopped rank resumed to write its stacks
    assert (job.run_dir / "hang" / "rank-0.txt").read_text().startswith("rank 0 (pid 100")
    assert r0.done == [("resume", r1.pid)]
    tick_for(job, [r0], 1.0, every=wd.ENDING_POLL_S)  # waiting for them
    job.clock.now += wd.ENDING_POLL_S
    r1.tick()  # back from a long pause: it declares no hang of its own, but writes its stacks
    assert "rank 1 (pid 101" in (job.run_dir / "hang" / "rank-1.txt").read_text()
    r1.enter("all_reduce of the token count")  # and its training thread moves on
    r1.tick()
    with pytest.raises(Exited) as left:
        r0.tick()
    assert left.value.args == (wd.HANG_EXIT_CODE,)
    assert r0.done == [("resume", r1.pid), ("kill", r1.pid)]
    error = error_of(job, 0)
    assert error["cause"].startswith("step 4 hung in the all_reduce of the token count: rank 1 did not arrive "
                                     "within 10 s (rank 1 last seen in the wait for the step's batches of step 4, "
                                     "stopped by SIGSTOP or a debugger);")
    assert error["cause"].endswith(f"every rank's Python stack is in {job.run_dir / 'hang'}")
    assert error["kind"] == "hang" and "reliability.hang_timeout_s" in error["fix"]
    tick_for(job, [r1], 1.0, every=wd.ENDING_POLL_S)  # the peer of the same node waits to be killed
    assert not (job.run_dir / "error-rank1.json").exists()


def test_a_rank_of_another_node_leaves_with_the_same_message(job):
    r0, r1, r2 = dogs = job(3, nodes=[0, 0, 1])
    run_steps(job, dogs, 1, 3)
    for dog in dogs:
        dog.begin_step(4)
        dog.enter("metrics gather")  # every rank arrived; none finishes
        dog.tick()
    job.states[r1.pid] = "D"
    tick_for(job, [r0, r2], 11.0)  # rank 1 hangs in I/O: no heartbeat, no stacks
    assert sorted(p.name for p in (job.run_dir / "hang").iterdir()) == ["rank-0.txt", "rank-2.txt"]
    with pytest.raises(Exited):
        tick_for(job, [r0, r2], wd.ACK_S + 1, every=wd.ENDING_POLL_S)
    assert r0.done == [("kill", r1.pid)]  # of its own node only
    with pytest.raises(Exited):
        r2.tick()  # on another node: leaves by itself
    cause = error_of(job, 0)["cause"]
    assert cause.startswith("step 4 hung in the metrics gather: no rank finished it within 10 s; "
                            "rank 1 did not answer (rank 1 last seen in the metrics gather of step 4, in "
                            "uninterruptible I/O")
    assert cause.endswith(f"every rank's Python stack is in {job.run_dir / 'hang'} (none from rank 1)")
    assert error_of(job, 2)["cause"] == cause


def test_the_first_steps_are_not_timed_and_a_pause_of_the_whole_process_is_no_hang(job, capsys):
    (dog,) = job(1)
    dog.begin_step(1)
    tick_for(job, [dog], 100.0, every=5.0)  # compiling
    dog.begin_step(2)
    tick_for(job, [dog], 100.0, every=5.0)
    dog.begin_step(3)
    dog.enter("forward and backward")
    job.clock.now += 1000.0  # the whole job stopped (Ctrl-Z); the clock restarts at its next heartbeat
    tick_for(job, [dog], 11.0)
    with pytest.raises(Exited):
        tick_for(job, [dog], 1.0)
    err = capsys.readouterr().err  # one process: the message is this process's own
    assert err.startswith("error: step 3 hung in the forward and backward: not finished after 10 s;")
    assert "\n  fix: read the stacks" in err
    assert (job.run_dir / "hang" / "rank-0.txt").exists() and error_of(job, 0)["kind"] == "hang"


@pytest.mark.parametrize("behind, answering, named", [
    (True, True, "rank 1 not yet there (rank 1 last seen in the wait for the step's batches of step 9)"),
    (False, False, ("rank 1 not answering, stopped or frozen? (rank 1 last seen in the all_reduce of the token "
                    "count of step 9)")),
    (False, True, None),  # every rank in one slow phase: nobody to name
])
def test_straggler_alert_once_per_stall(job, behind, answering, named):
    r0, r1 = dogs = job(2, timeout=100.0)
    run_steps(job, dogs, 1, 8)  # 1 s steps
    for dog in dogs:
        dog.begin_step(9)
    r0.enter("all_reduce of the token count")
    if not behind:
        r1.enter("all_reduce of the token count")
    for dog in dogs:
        dog.tick()
    tick_for(job, [r0, r1] if answering else [r0], 5.0)
    assert r0.console.lines == []  # 5x the median not passed yet
    tick_for(job, [r0, r1] if answering else [r0], 10.0)
    alerts = r0.take_alerts()
    if named is None:
        assert alerts == [] and r0.console.lines == []
        return
    assert [a.kind for a in alerts] == ["straggler"] and len(r0.console.lines) == 1
    assert alerts[0].message.startswith("step 9 has stalled ")
    assert "the median step, 1.00 s) in the all_reduce of the token count: " + named in alerts[0].message
    assert r0.take_alerts() == []
    assert r1.take_alerts() == [] and r1.console.lines == []  # rank 0 alone alerts


def test_timeouts():
    cfg = ReliabilityConfig()
    assert wd.hang_timeout_s(cfg, "cuda") == 600 and wd.hang_timeout_s(cfg, "cpu") == 300
    assert wd.process_group_timeout(cfg, "cpu") == timedelta(seconds=300 + wd.PROCESS_GROUP_MARGIN_S)
    assert wd.process_group_timeout(ReliabilityConfig(hang_timeout_s=8), "cuda") == timedelta(seconds=128)


def test_stacks_are_python_frames_of_every_thread(tmp_path):
    path = tmp_path / "hang" / "rank-0.txt"
    wd.Process().dump_stacks(path, "rank 0 header")
    text = path.read_text()
    assert text.startswith("rank 0 header\n\n") and "test_stacks_are_python_frames_of_every_thread" in text
