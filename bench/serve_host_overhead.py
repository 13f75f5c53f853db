"""The serving engine's host work per step, without a model (issue 24: the host's time per step).

    flock /tmp/serve/cpu.lock python bench/serve_host_overhead.py [--rounds 3] [--json OUT]

An LLMEngine on the bundled tiny model, on CPU, whose runner (through the engine's
runner_factory) returns ready-made random fp32 logits instead of running a forward: what is
left of a step is the host's part, which on a GPU is time the GPU waits unless it overlaps.

Workloads, greedy with ignore_eos (the peer's sampling):
- 256 requests of 512-1,000 random prompt tokens, each running to the end of the 1,024-token
  context; the token budget admits every prompt in the first step, so the steps that follow
  are 256-way decodes until the shortest output ends. Only those steps are measured.
- the same with the default token budget (8,192): the steps that carry a prefill chunk
  beside the decodes of the requests admitted before (mixed_8192).
- one request (512 prompt tokens, 500 output tokens): the batch-1 decode step.

Each measured step (one call of LLMEngine.step, a one-deep pipeline) is split by timestamps at
the engine's calls (taken by the fake runner and by wrappers this script puts on its engine's
Scheduler instance): land (up to the end of Scheduler.update: waiting for the step in flight,
appending its tokens), schedule (Scheduler.schedule), prepare (up to runner.execute: decode
order, prepare_inputs), execute (the fake's copy of the logits), then sample+outputs (the
sampling rows, Sampler.launch, whose greedy argmax on CPU is device work on a GPU, and the
previous step's detokenizing, stop strings and RequestOutputs: on a GPU this part overlaps
the step just launched); host is the step less execute.
Medians over the measured steps. The digest covers every
output's ids, text and finish reason, so runs of two versions of the engine that print the
same digest produced the same outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from duoka.serve.engine import LLMEngine  # noqa: E402
from duoka.serve.params import SamplingParams  # noqa: E402

PHASES = ("land", "schedule", "prepare", "execute", "sample+outputs")
COLUMNS = (*PHASES, "step", "host")  # host: the step less execute
CONTEXT = 1024  # the bundled model's context
BATCH = 256
LOGITS_POOL = 16  # distinct logits tensors cycled through, so the sampled text varies step to step


class Clock:
    """Timestamps of one step at the engine's calls, in step order."""

    def __init__(self):
        self.marks: dict[str, float] = {}

    def wrap(self, fn, before: str | None, after: str | None):
        def timed(*args, **kwargs):
            if before:
                self.marks[before] = time.perf_counter()
            out = fn(*args, **kwargs)
            if after:
                self.marks[after] = time.perf_counter()
            return out
        return timed


class LogitsRunner:
    """Stands in for ModelRunner: execute returns random logits (no model, no cache). They are
    copied out of a pool, so that the sampler reads them from the cache as it would a real
    runner's fresh output; the copy is the execute phase's time, outside the host's."""

    def __init__(self, vocab: int, clock: Clock, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(LOGITS_POOL, BATCH, vocab, generator=g)
        self.calls = 0
        self.clock = clock
        self.last_shape = (0, 0)  # (sequences, decodes) of the latest step

    def execute(self, inputs):
        self.clock.marks["execute"] = time.perf_counter()
        rows = len(inputs.logits_indices)
        self.last_shape = (len(inputs.context_lens), inputs.num_decodes)
        logits = self.pool[self.calls % LOGITS_POOL, :rows].clone()
        self.calls += 1
        self.clock.marks["executed"] = time.perf_counter()
        return logits


def build_engine(max_num_batched_tokens: int) -> tuple[LLMEngine, LogitsRunner, Clock]:
    clock = Clock()
    made = []

    def factory(model, shape, device, max_model_len, max_num_seqs, cuda_graphs):
        made.append(LogitsRunner(model.args.vocab_size, clock))
        return made[0]

    engine = LLMEngine(device="cpu", max_num_seqs=BATCH, max_num_batched_tokens=max_num_batched_tokens,
                       num_kv_blocks=BATCH * CONTEXT // 16, runner_factory=factory, log=lambda _: None)
    sched = engine.scheduler
    sched.schedule = clock.wrap(sched.schedule, None, "scheduled")
    sched.update = clock.wrap(sched.update, "update", "updated")
    return engine, made[0], clock


def run(engine: LLMEngine, runner: LogitsRunner, clock: Clock, prompts: list[list[int]], max_tokens: list[int],
        measure) -> tuple[list[dict[str, float]], str]:
    """Runs the requests to the end; returns the split of each step `measure(runner)` accepts
    (ms per phase) and a digest of every output."""
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    digest = hashlib.sha256()
    steps = []
    while engine.has_unfinished():
        clock.marks.clear()
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        for out in outputs:
            digest.update(repr((out.request_id, out.new_token_ids, out.new_text, out.finish_reason)).encode())
        if "execute" not in clock.marks or "updated" not in clock.marks or not measure(runner):
            continue
        m = clock.marks
        bounds = [t0, m["updated"], m["scheduled"], m["execute"], m["executed"], t1]
        split = {name: (b - a) * 1e3 for name, a, b in zip(PHASES, bounds, bounds[1:])}
        split["step"] = (t1 - t0) * 1e3
        split["host"] = split["step"] - split["execute"]
        steps.append(split)
    return steps, digest.hexdigest()[:16]


def summarise(steps: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(s[name] for s in steps) for name in COLUMNS}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="times the 256-request workload runs")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    rng = random.Random(0)
    result = {}

    # The budget admits all 256 prompts (at most 256,000 tokens) in one step.
    engine, runner, clock = build_engine(BATCH * CONTEXT)
    vocab = engine.vocab_size
    steps, digests = [], []
    for _ in range(a.rounds):
        prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(512, 1000))] for _ in range(BATCH)]
        s, d = run(engine, runner, clock, prompts, [CONTEXT - len(p) for p in prompts],
                   lambda r: r.last_shape == (BATCH, BATCH))
        steps += s
        digests.append(d)
    result["decode_256"] = dict(summarise(steps), steps=len(steps), digest="-".join(digests))

    # The default budget: prompts enter 8,192 tokens a step, beside the decodes of those before.
    engine, runner, clock = build_engine(8192)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(512, 1000))] for _ in range(BATCH)]
    s, d = run(engine, runner, clock, prompts, [CONTEXT - len(p) for p in prompts],
               lambda r: r.last_shape[1] < r.last_shape[0])
    result["mixed_8192"] = dict(summarise(s), steps=len(s), digest=d)

    prompt = [rng.randrange(1, vocab) for _ in range(512)]  # the same engine, empty again
    s, d = run(engine, runner, clock, [prompt], [500], lambda r: r.last_shape == (1, 1))
    result["decode_1"] = dict(summarise(s), steps=len(s), digest=d)

    print(f"{'ms per step (median)':<22}" + "".join(f"{c:>15}" for c in COLUMNS) + "   steps  digest")
    for name, r in result.items():
        print(f"{name:<22}" + "".join(f"{r[c]:>15.3f}" for c in COLUMNS) + f"{r['steps']:>8}  {r['digest']}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
