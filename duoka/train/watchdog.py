"""Hang watchdog. A step or collective that has not finished after reliability.hang_timeout_s
ends the job with one message naming the step, the collective and the ranks that did not
arrive, and every rank's Python stack in <run>/hang/rank-R.txt. Rank 0 raises a straggler
alert when it has waited straggler_factor x the median step in one phase because of ranks
that are behind or do not answer.

The training thread only records where it is (`begin_step`, `enter`: one tuple assignment,
no device sync, no I/O). A daemon thread per rank does the rest, once a second:
  - it publishes that position and a heartbeat count to the launcher's rendezvous store
    (served by the elastic agent, the store answers while every collective is stuck);
  - when its own position has not moved for the timeout, enforced from the third step of
    the process on (the first ones compile), the job ends:
      1. the first rank to notice declares the hang in the store (`add` picks exactly one);
      2. every rank that still answers writes its stacks to <run>/hang/ and says so;
      3. the declaring rank resumes (SIGCONT) the stopped workers of its node, so that they
         write their stacks too, and waits a moment for them;
      4. it writes the message as its error (the launcher shows it), kills the other
         workers of its node (their stacks are written; a stuck one may never run a signal
         handler) and leaves with HANG_EXIT_CODE; ranks of other nodes leave on reading it.
Each of these decisions ends the job; none changes which collective a rank runs next.
"""

from __future__ import annotations

import collections
import faulthandler
import itertools
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple, NoReturn

import torch.distributed as dist

from duoka import runtime
from duoka.config import ReliabilityConfig
from duoka.monitor.alerts import Alert
from duoka.train.run_files import write_error_report

# sysexits.h EX_TEMPFAIL: a hang is often transient (a node, a link, a file system), so a
# scheduler may requeue; distinct from 1 (a crash), 2 (a user error) and 143 (SIGTERM).
HANG_EXIT_CODE = 75
DEFAULT_TIMEOUT_S = {"cuda": 600.0, "cpu": 300.0}  # reliability.hang_timeout_s = 0
UNENFORCED_STEPS = 2  # the first steps of a process compile and fill caches: not timed
# The process group's own timeout (gloo 30 min, NCCL 10 min by default) is a backstop for
# what the watchdog does not time (set-up, the first steps); it must fire after the
# watchdog has ended the job with its message.
PROCESS_GROUP_MARGIN_S = 120.0
POLL_S = 1.0  # the heartbeat: one store set and one check a second (~0.1 ms together, off the training thread)
ENDING_POLL_S = 0.1  # while the job ends
ACK_S = 3.0  # how long the declaring rank waits for every rank's stacks
# A gap this long between two heartbeats (half the timeout if less, 3 heartbeats at least)
# means this whole process was stopped (Ctrl-Z, a suspended machine): its clock restarts
# rather than count the pause as a hang.
SUSPENDED_S = 10 * POLL_S
SILENCE_S = 2.5 * POLL_S  # a rank whose heartbeat count has not moved in this long does not answer
# A rank that did not declare the hang leaves by itself this long after, in case the
# declaring rank died before ending the job.
PEER_DEADLINE_S = 3 * ACK_S + 10 * POLL_S
STEP_HISTORY = 50  # step times in the straggler median
MIN_STEPS_FOR_MEDIAN = 3  # timed steps before their median is trusted
# The watchdog's own store connection: an operation fails after this rather than block the
# watchdog (it reads only keys that exist, so only a store that stopped answering takes it).
STORE_TIMEOUT = timedelta(seconds=30)

HANG_KEY, EXIT_KEY, DECLARED_KEY, DUMPED_KEY = "hang", "exit", "declared", "dumped"
STATES = {"T": "stopped by SIGSTOP or a debugger", "t": "stopped by a debugger",
          "D": "in uninterruptible I/O, a hung file system or driver", "Z": "dead"}


def hang_timeout_s(cfg: ReliabilityConfig, device_type: str) -> float:
    return cfg.hang_timeout_s or DEFAULT_TIMEOUT_S.get(device_type, DEFAULT_TIMEOUT_S["cpu"])


def process_group_timeout(cfg: ReliabilityConfig, device_type: str) -> timedelta:
    """For init_process_group: a stuck rank waits no longer than the watchdog's timeout
    plus a margin, rather than gloo's 30 or NCCL's 10 minutes."""
    return timedelta(seconds=hang_timeout_s(cfg, device_type) + PROCESS_GROUP_MARGIN_S)


class Position(NamedTuple):
    """Where the training thread is: its seq-th phase. Every rank runs the same phases in
    the same order (the same collectives), so a rank with a lower seq is behind."""

    seq: int
    step: int
    phase: str
    since: float  # the watchdog's clock when the phase began
    enforced: bool  # this phase is timed (from the third step of the process on)


class Peer(NamedTuple):
    """A rank's position as published in the store, with its heartbeat count."""

    seq: int
    step: int
    phase: str
    node: str
    pid: int
    beat: int


class Process:
    """What the watchdog does to processes (tests record these calls instead)."""

    def __init__(self):
        self.pid = os.getpid()

    def dump_stacks(self, path: Path, header: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(header + "\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)

    def sibling_state(self, pid: int) -> str | None:
        """The state letter (/proc) of a worker that shares this one's parent (the launcher's
        worker server), or None: a pid read from the store never names another process."""
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return fields[0] if int(fields[1]) == os.getppid() else None

    def resume(self, pid: int) -> None:
        os.kill(pid, signal.SIGCONT)

    def kill(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def exit(self, code: int) -> NoReturn:
        runtime.hard_exit(code)


class Watchdog:
    def __init__(self, cfg: ReliabilityConfig, run_dir: Path, rank: int, world: int, device_type: str,
                 start_step: int, console, store=None, node: str = "0", process: Process | None = None,
                 clock=time.monotonic, thread: bool = True):
        """`store`: shared by the ranks (None: one rank alone); `node`: this rank's node (the
        declaring rank resumes and kills workers of its own node only); `thread`: False to
        drive `tick` by hand (tests)."""
        self.timeout = hang_timeout_s(cfg, device_type)
        self.factor = cfg.straggler_factor
        self.run_dir, self.rank, self.world, self.start_step = Path(run_dir), rank, world, start_step
        self.console, self.store, self.node = console, store, node
        self.process, self.clock = process or Process(), clock
        self.position = Position(0, start_step, "set-up", clock(), False)
        self._step = start_step
        self._starts: collections.deque[float] = collections.deque(maxlen=STEP_HISTORY + 1)
        self._suspended_s = max(3 * POLL_S, min(SUSPENDED_S, self.timeout / 2))
        self._last_tick = self._resumed_at = clock()
        self._beat = 0
        self._earlier: tuple[int, float, list[Peer]] | None = None  # rank 0: (seq, time, peers) of a stall
        self._alerted_seq = -1
        self._alerts: collections.deque[Alert] = collections.deque()  # appended by one thread, taken by the other
        self._ending: str | None = None  # "declared" (this rank declared the hang) | "peer"
        self._ending_since = 0.0
        self._declared: list[Peer] = []  # every rank's position when the hang was declared
        self._why: dict[int, str] = {}  # rank -> its process state, where it is worth telling
        self._closed = threading.Event()
        if store is not None:
            self._publish()  # every rank's key exists before any rank is timed
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self._run, name="duoka-watchdog", daemon=True)
            self._thread.start()

    @classmethod
    def start(cls, cfg: ReliabilityConfig, run_dir: Path, rank: int, world: int, device_type: str,
              start_step: int, console) -> Watchdog:
        """The watchdog of a worker started by the launcher: its own client of the agent's
        store (MASTER_ADDR:MASTER_PORT), with keys apart for each start of the group."""
        store = None
        if world > 1 and "MASTER_ADDR" in os.environ:
            client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=STORE_TIMEOUT)
            store = dist.PrefixStore(f"duoka-watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)
        return cls(cfg, run_dir, rank, world, device_type, start_step, console, store,
                   node=os.environ.get("GROUP_RANK", "0"))

    # ------------------------------------------------------------ the training thread

    def begin_step(self, step: int) -> None:
        """Step `step` (1-based, as in metrics.jsonl) begins: its batches come first."""
        now = self.clock()
        enforced = self.position.enforced or step > self.start_step + UNENFORCED_STEPS
        if enforced:
            self._starts.append(now)
        self._step = step
        self.position = Position(self.position.seq + 1, step, "wait for the step's batches", now, enforced)

    def enter(self, phase: str, step: int | None = None) -> None:
        """The training thread enters `phase` (of `step`, by default the current one)."""
        p = self.position
        self.position = Position(p.seq + 1, self._step if step is None else step, phase, self.clock(), p.enforced)

    def take_alerts(self) -> list[Alert]:
        """Straggler alerts raised since the last call (rank 0), for the next metrics record."""
        return [self._alerts.popleft() for _ in range(len(self._alerts))]

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_S)

    # ------------------------------------------------------------ the watchdog thread

    def _run(self) -> None:
        while not self._closed.wait(ENDING_POLL_S if self._ending else POLL_S):
            try:
                self.tick()
            except (RuntimeError, OSError, ValueError):  # the store is gone (the launcher died)
                self.store = None  # time this rank alone from now on
                if self._ending:
                    self._finish()

    def tick(self) -> None:
        now = self.clock()
        if now - self._last_tick > self._suspended_s:
            self._resumed_at = now
        self._last_tick = now
        if self.store is not None:
            self._publish()
        if self._ending == "peer":
            return self._peer_tick(now)
        if self._ending:
            return self._declarer_tick(now)
        if self.store is not None and self.store.check([HANG_KEY]):
            return self._join(now)
        pos = self.position
        waited = now - max(pos.since, self._resumed_at)
        if pos.enforced and waited > self.timeout:
            return self._declare(now)
        if self.rank == 0 and self.store is not None:
            self._check_straggler(pos, waited, now)

    def _publish(self) -> None:
        p = self.position
        self._beat += 1
        value = [p.seq, p.step, p.phase, self.node, self.process.pid, self._beat]
        self.store.set(f"pos/{self.rank}", json.dumps(value))

    def _peers(self) -> list[Peer]:
        return [Peer(*json.loads(v)) for v in self.store.multi_get([f"pos/{r}" for r in range(self.world)])]

    # ------------------------------------------------------------ stragglers (rank 0)

    def _median_step(self) -> float | None:
        starts = tuple(self._starts)
        if len(starts) <= MIN_STEPS_FOR_MEDIAN:
            return None
        return statistics.median(b - a for a, b in itertools.pairwise(starts))

    def _check_straggler(self, pos: Position, waited: float, now: float) -> None:
        median = self._median_step()
        if median is None or waited <= self.factor * median or pos.seq == self._alerted_seq:
            return
        if self._earlier is None or self._earlier[0] != pos.seq:
            self._earlier = (pos.seq, now, self._peers())  # looked at again once every heartbeat could move
            return
        if now - self._earlier[1] < SILENCE_S:
            return
        peers, before = self._peers(), self._earlier[2]
        self._alerted_seq = pos.seq  # once per stall
        ahead = max(p.seq for p in peers)
        silent = [r for r, p in enumerate(peers) if p.beat == before[r].beat]
        behind = [r for r, p in enumerate(peers) if p.seq < ahead and r not in silent]
        if not behind and not silent:
            return  # every rank in one slow phase (a save, the file system): no rank to name
        waiting = next(p for p in peers if p.seq == ahead)
        named = [f"{_rank_list(behind)} not yet there ({_whereabouts(behind, peers)})"] if behind else []
        if silent:
            named.append(f"{_rank_list(silent)} not answering, stopped or frozen? ({_whereabouts(silent, peers)})")
        alert = Alert("straggler", f"step {waiting.step} has stalled {waited:.0f} s ({waited / median:.0f}x the median "
                                   f"step, {median:.2f} s) in the {waiting.phase}: {'; '.join(named)}; check that "
                                   "host and its GPU (duoka monitor --gpus, dmesg)")
        self.console.print(f"[bold yellow]alert (straggler)[/]: {alert.message}")
        self._alerts.append(alert)

    # ------------------------------------------------------------ ending the job

    def _declare(self, now: float) -> None:
        if self.store is None:
            self._dump()
            return self._finish()
        if self.store.add(DECLARED_KEY, 1) > 1:  # another rank got there first
            return self._join(now)
        self._declared = self._peers()
        self.store.set(HANG_KEY, json.dumps({"rank": self.rank, "node": self.node}))
        self._dump()
        # A stopped worker of this node is resumed, so that its own watchdog writes its stacks.
        for r, p in enumerate(self._declared):
            state = self.process.sibling_state(p.pid) if r != self.rank and p.node == self.node else None
            if state in ("T", "t"):
                self._why[r] = STATES[state]
                self.process.resume(p.pid)
        self._ending, self._ending_since = "declared", now

    def _join(self, now: float) -> None:
        self._dump()
        self._ending, self._ending_since = "peer", now

    def _dump(self) -> None:
        pos = self.position
        self.process.dump_stacks(self.run_dir / "hang" / f"rank-{self.rank}.txt",
                                 f"rank {self.rank} (pid {self.process.pid} on {socket.gethostname()}) at step "
                                 f"{pos.step}, in the {pos.phase}")
        if self.store is not None:
            self.store.set(f"{DUMPED_KEY}/{self.rank}", json.dumps(pos))
            self.store.add(DUMPED_KEY, 1)

    def _not_dumped(self) -> list[int]:
        return [r for r in range(self.world) if not self.store.check([f"{DUMPED_KEY}/{r}"])]

    def _declarer_tick(self, now: float) -> None:
        if self.store.add(DUMPED_KEY, 0) < self.world and now - self._ending_since < ACK_S:
            return
        missing = self._not_dumped()
        for r in self._why:  # a resumed rank's heartbeat was up to a beat old: where it wrote its stacks instead
            if r not in missing:
                seq, step, phase, *_ = json.loads(self.store.get(f"{DUMPED_KEY}/{r}"))
                self._declared[r] = self._declared[r]._replace(seq=seq, step=step, phase=phase)
        for r in missing:  # why the ranks without stacks gave none, where it can be told
            p = self._declared[r]
            state = self.process.sibling_state(p.pid) if p.node == self.node else None
            self._why.setdefault(r, "on another node" if p.node != self.node else
                                 "gone" if state is None else STATES.get(state, "frozen"))
        self._finish()

    def _peer_tick(self, now: float) -> None:
        declared = json.loads(self.store.get(HANG_KEY))
        # The declaring rank kills the workers of its own node once their stacks are written.
        if declared["node"] != self.node and self.store.check([EXIT_KEY]):
            self._leave(*json.loads(self.store.get(EXIT_KEY)))
        if now - self._ending_since > PEER_DEADLINE_S:
            self._leave(f"the job hung; rank {declared['rank']} noticed it but did not end the job (its message is "
                        "lost)", _FIX.format(stacks=self.run_dir / "hang"))

    def _finish(self) -> NoReturn:
        cause, fix = self._message()
        write_error(self.run_dir, self.rank, cause, fix)
        if self.world == 1:  # the launcher runs in this very process and cannot report it
            print(f"error: {cause}\n  fix: {fix}", file=sys.stderr, flush=True)
        if self.store is not None:
            self.store.set(EXIT_KEY, json.dumps([cause, fix]))
            doomed = [p.pid for r, p in enumerate(self._peers())
                      if r != self.rank and p.node == self.node and self.process.sibling_state(p.pid) is not None]
            # Kills, then exit, with no I/O in between: this rank's training thread, woken by a
            # peer's death, gets no chance to report that death as the cause instead.
            for pid in doomed:
                self.process.kill(pid)
        self.process.exit(HANG_EXIT_CODE)

    def _leave(self, cause: str, fix: str) -> NoReturn:
        write_error(self.run_dir, self.rank, cause, fix)
        self.process.exit(HANG_EXIT_CODE)

    def _message(self) -> tuple[str, str]:
        """(cause, fix): the step and the phase the most advanced ranks are in, the ranks
        that did not arrive there and what they were doing, and where the stacks are."""
        pos, stacks = self.position, self.run_dir / "hang"
        fix = _FIX.format(stacks=stacks)
        if self.store is None:
            cause = f"step {pos.step} hung in the {pos.phase}: not finished after {self.timeout:g} s"
            return f"{cause}; the Python stacks are in {stacks}", fix
        peers = self._declared  # as they were: resumed ranks may have moved on since
        ahead = max(p.seq for p in peers)
        waiting = next(p for p in peers if p.seq == ahead)
        behind = [r for r, p in enumerate(peers) if p.seq < ahead]
        if behind:
            what = (f"{_rank_list(behind)} did not arrive within {self.timeout:g} s "
                    f"({_whereabouts(behind, peers, self._why)})")
        else:
            what = f"no rank finished it within {self.timeout:g} s"
        silent = sorted(r for r in self._why if r not in behind)
        if silent:
            what += f"; {_rank_list(silent)} did not answer ({_whereabouts(silent, peers, self._why)})"
        no_stacks = self._not_dumped()
        where = f"every rank's Python stack is in {stacks}" + (f" (none from {_rank_list(no_stacks)})"
                                                              if no_stacks else "")
        return f"step {waiting.step} hung in the {waiting.phase}: {what}; {where}", fix


_FIX = ("read the stacks of the ranks named ({stacks}): a stuck data read or file system, a dead GPU or network "
        "link (nvidia-smi, dmesg); continue with --checkpoint.resume=auto; if a step is legitimately this slow, "
        "raise reliability.hang_timeout_s")


def _rank_list(ranks: list[int], shown: int = 8) -> str:
    names = ", ".join(str(r) for r in ranks[:shown]) + (f" and {len(ranks) - shown} more" if len(ranks) > shown else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + names


def _whereabouts(ranks: list[int], peers: list[Peer], why: dict[int, str] | None = None, shown: int = 8) -> str:
    """Where each of `ranks` was last seen (a heartbeat ago at most), and its state if known."""
    parts = []
    for r in ranks[:shown]:
        state = (why or {}).get(r)
        where = f"the {peers[r].phase} of step {peers[r].step}" if peers[r].seq else "the set-up, before any step"
        parts.append(f"rank {r} last seen in {where}" + (f", {state}" if state else ""))
    return "; ".join(parts)


def write_error(run_dir: Path, rank: int, cause: str, fix: str) -> None:
    """The error file the launcher reads, marked as a hang."""
    write_error_report(run_dir, rank, cause, fix, kind="hang", exit_code=HANG_EXIT_CODE)
