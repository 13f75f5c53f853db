"""Single serving steps of chosen compositions, timed on the engine's own runner: what a step
holding a prefill chunk beside decodes costs against its FLOPs (bench/NOTES.md 27: capping the
prompt tokens beside decodes at 512 made TTFT and ITL worse on an H100, so a step holding a
512-token chunk costs far more than its ~7 TFLOP).

    PYTHONPATH=$PWD python3 bench/serve_mixed_step.py --shape 7b --out $OUT/mixed_step_7b.json
    PYTHONPATH=$PWD .venv/bin/python bench/serve_mixed_step.py --shape tiny --out /tmp/mixed_step_tiny.json \\
        --repeats 3  # CPU smoke run

The model is a random one of the shape (`--load-format dummy`, config-only folder of
bench/serve_models.py), served as `duoka serve --max-model-len 4096` serves it: a Worker (the
engine's model side: compiled blocks, paged cache, CUDA graphs, sampler). Each composition is
a list of ScheduledItems over sequences whose block tables are set here (disjoint blocks of
the worker's cache; the cached tokens' K/V are whatever the cache holds, which attention's
cost does not depend on), turned into StepInputs by the engine's prepare_inputs, run by
Worker.execute (a decode-only step replays its decode graph, a step with a chunk of up to
2,048 tokens in all its mixed-step graph, a larger one runs eagerly, as in the engine) and
sampled greedily by Worker.sample.

For each composition, after --warmup untimed steps (the first one's time kept: a compile or
recompile shows there): the whole step (prepare, execute, sample; synchronised at its end)
and execute alone, medians of --repeats; the model's FLOPs (matmuls and causal attention) and
the TFLOP/s they make of execute's time; the kernels of one profiled step (torch.profiler:
the top ones, their sum against the step's wall time, the sum by name pattern); dynamo's
graph count before and after (recompiles). Writes --out (JSON), rewritten after each one.
Device kind nvidia-h100-x1; sized for under 4 minutes on an H100, load and compile included (9
compositions x ~25 steps of at most ~60 ms; the start-up is most of it). On CPU the runner's
reference attention runs (dense, masked), and the profile lists operators by self time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_table import kernel_table  # noqa: E402
from serve_models import CONFIGS, config_folder  # noqa: E402

from duoka.serve.config import EngineConfig  # noqa: E402
from duoka.serve.params import SamplingParams  # noqa: E402
from duoka.serve.runner import decode_first, prepare_inputs  # noqa: E402
from duoka.serve.sampling import SampleRow  # noqa: E402
from duoka.serve.scheduler import ScheduledItem, Sequence  # noqa: E402
from duoka.serve.worker import Worker  # noqa: E402


@dataclass(frozen=True)
class Composition:
    """decodes one-token decodes (each after --decode-context tokens), beside one chunk of
    `chunk` prompt tokens after `cached` tokens already in the cache, of a prompt of
    prompt_len tokens: the chunk samples a token only when it ends the prompt."""
    name: str
    decodes: int
    chunk: int = 0
    cached: int = 0
    prompt_len: int = 0


def compositions(d: int) -> list[Composition]:
    """The steps the 4 req/s run of 1,024-token prompts is made of, with and without the cap."""
    return [
        Composition(f"decode{d}", d),
        Composition("prompt1024", 0, 1024, 0, 1024),
        Composition(f"prompt1024_decode{d}", d, 1024, 0, 1024),
        # The cap of 512: a prompt's first chunk (no context, samples nothing), then its second
        # (after 512 cached tokens, samples the first token).
        Composition(f"chunk512_first_decode{d}", d, 512, 0, 1024),
        Composition(f"chunk512_after512_decode{d}", d, 512, 512, 1024),
        Composition("chunk512_after512", 0, 512, 512, 1024),
        Composition("prompt512", 0, 512, 0, 512),
        Composition(f"prompt256_decode{d}", d, 256, 0, 256),
        Composition(f"prompt2048_decode{d}", d, 2048, 0, 2048),
    ]


class Blocks:
    """Hands out consecutive blocks of the worker's cache; reset between compositions (a step
    only needs its own sequences' blocks to be disjoint)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size, self.next = num_blocks, block_size, 0

    def sequence(self, rid: str, tokens: int, rng: np.random.Generator, vocab: int) -> Sequence:
        seq = Sequence(rid, rng.integers(1, vocab, tokens).tolist(), SamplingParams(max_tokens=1, temperature=0))
        count = -(-tokens // self.block_size)
        assert self.next + count <= self.num_blocks, "the cache is too small for this composition"
        seq.block_table = list(range(self.next, self.next + count))
        seq.block_array = np.array(seq.block_table, dtype=np.int32)
        self.next += count
        return seq


def step_items(c: Composition, blocks: Blocks, decode_context: int, vocab: int) -> list[ScheduledItem]:
    """The composition's items, decodes first (the engine's decode_first order)."""
    blocks.next = 0
    rng = np.random.default_rng(0)
    items = []
    for i in range(c.decodes):
        seq = blocks.sequence(f"d{i}", decode_context, rng, vocab)
        seq.num_computed = decode_context - 1
        items.append(ScheduledItem(seq, decode_context - 1, 1, True))
    if c.chunk:
        seq = blocks.sequence("p", c.prompt_len, rng, vocab)
        seq.num_computed = c.cached
        items.append(ScheduledItem(seq, c.cached, c.chunk, c.cached + c.chunk == c.prompt_len))
    return decode_first(items)


def model_flops(shape: dict, c: Composition, decode_context: int) -> float:
    """Multiply-adds x 2 of the step's forward: every token through the projections, the
    sampled rows through the head, each new token's causal attention over its context."""
    dim, hidden, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * dim // shape["num_attention_heads"]
    per_token = layers * (dim * (dim + 2 * kv) + dim * dim + 3 * dim * hidden)
    tokens = c.decodes + c.chunk
    sampled = c.decodes + (c.chunk > 0 and c.cached + c.chunk == c.prompt_len)
    # Keys read per query: a decode its whole context; chunk token j (1-based) cached + j.
    keys = c.decodes * decode_context + c.chunk * c.cached + c.chunk * (c.chunk + 1) // 2
    attention = layers * 2 * dim * keys  # q.k and p.v over all heads, per key
    return 2 * (tokens * per_token + sampled * dim * shape["vocab_size"] + attention)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(worker: Worker, items: list[ScheduledItem], repeats: int, warmup: int) -> dict:
    """Whole steps (prepare, execute, sample), then execute alone on prepared inputs: medians."""
    device, block_size = worker.device, worker.shape.block_size
    rows = [SampleRow(item.seq.params, 0, 0, [], item.seq.prompt_ids) for item in items if item.sample]

    def whole() -> None:
        inputs = prepare_inputs(items, block_size)
        logits = worker.execute(inputs)
        worker.sample(logits, rows).result()

    def timed(fn, n: int) -> list[float]:
        out = []
        for _ in range(n):
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            out.append((time.perf_counter() - t) * 1000)
        return out

    first = timed(whole, 1)[0]
    timed(whole, max(0, warmup - 1))
    steps = timed(whole, repeats)
    inputs = prepare_inputs(items, block_size)
    executes = timed(lambda: worker.execute(inputs), repeats)
    return {"first_step_ms": first, "step_ms": float(np.median(steps)), "step_ms_all": steps,
            "execute_ms": float(np.median(executes)), "execute_ms_min": min(executes),
            "prepare_ms": _prepare_ms(items, block_size)}


def _prepare_ms(items: list[ScheduledItem], block_size: int, n: int = 5) -> float:
    t = time.perf_counter()
    for _ in range(n):
        prepare_inputs(items, block_size)
    return (time.perf_counter() - t) * 1000 / n


def kernel_breakdown(worker: Worker, items: list[ScheduledItem], top: int = 12) -> dict:
    """One whole step under torch.profiler: on CUDA the kernels (device time per name, the top
    ones, their sum against the profiled step's wall time: the rest is the host's launch gap),
    on CPU the operators by self time."""
    device, block_size = worker.device, worker.shape.block_size
    rows = [SampleRow(item.seq.params, 0, 0, [], item.seq.prompt_ids) for item in items if item.sample]
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        sync(device)
        t = time.perf_counter()
        worker.sample(worker.execute(prepare_inputs(items, block_size)), rows).result()
        sync(device)
        wall = (time.perf_counter() - t) * 1000
    # The host's side on CUDA: operators and runtime calls by self CPU time (a cudaStreamSynchronize
    # or a pageable cudaMemcpy here is a wait for the device inside the step).
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top] if cuda else []
    return {"profiled_wall_ms": wall, **kernel_table(prof, 1, top, cuda),
            "host_top": [{"name": e.key[:100], "self_cpu_ms": e.self_cpu_time_total / 1000, "calls": e.count}
                         for e in host]}


def graph_count() -> int:
    """Graphs dynamo has compiled in this process so far (a rise during a composition: it compiled anew)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def start_worker(a: argparse.Namespace) -> tuple[Worker, float]:
    folder = config_folder(a.shape, a.root)
    config = EngineConfig(model=str(folder), load_format="dummy", max_model_len=a.max_model_len,
                          max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                          gpu_memory_utilization=a.gpu_memory_utilization, device=a.device)
    t = time.perf_counter()
    worker = Worker(config)
    worker.start()
    sync(worker.device)
    return worker, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="7b", choices=sorted(CONFIGS))
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--root", default="/tmp/duoka-models", help="where the config-only folder is written")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--decodes", type=int, default=8, help="decodes beside each chunk")
    ap.add_argument("--decode-context", type=int, default=1152,
                    help="each decode's context (a 1,024-token prompt and some output)")
    ap.add_argument("--only", nargs="+", help="run these compositions only (by name)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true", help="skip the kernel breakdown")
    ap.add_argument("--max-model-len", type=int, default=4096, help="as the latency run served it")
    ap.add_argument("--max-num-seqs", type=int, default=16,
                    help="CUDA graph buckets up to this (fewer than the server's 256: a shorter capture; the "
                         "decode batch's own graph is the same)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    a = ap.parse_args()
    worker, load_s = start_worker(a)
    shape = CONFIGS[a.shape]
    cuda = worker.device.type == "cuda"
    result = {"command": " ".join(sys.argv), "shape": a.shape, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(worker.device) if cuda else "cpu",
              "dtype": str(worker.dtype).removeprefix("torch."), "load_s": load_s,
              "cuda_graph_buckets": sorted(getattr(worker.runner, "graphs", {})),
              "mixed_graph_tokens": sorted(getattr(worker.runner, "mixed_graphs", {})),
              "decode_context": a.decode_context, "compositions": {}}
    blocks = Blocks(worker.shape.num_blocks, worker.shape.block_size)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for c in compositions(a.decodes):
        if a.only and c.name not in a.only:
            continue
        items = step_items(c, blocks, a.decode_context, shape["vocab_size"])
        graphs = graph_count()
        figures = {"decodes": c.decodes, "chunk": c.chunk, "cached": c.cached, "prompt_len": c.prompt_len,
                   "tokens": c.decodes + c.chunk, **time_step(worker, items, a.repeats, a.warmup)}
        figures["new_graphs"] = graph_count() - graphs
        figures["model_gflop"] = model_flops(shape, c, a.decode_context) / 1e9
        figures["execute_tflop_per_s"] = figures["model_gflop"] / figures["execute_ms"]  # GFLOP/ms = TFLOP/s
        if not a.no_profile:
            figures["profile"] = kernel_breakdown(worker, items)
        result["compositions"][c.name] = figures
        out.write_text(json.dumps(result, indent=1))
        print(c.name, json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in figures.items()
                                  if k not in ("profile", "step_ms_all")}), flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
