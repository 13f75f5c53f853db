"""Speculative decoding on one GPU (issue 42): a random-weight Qwen2-7B (`--load-format dummy`)
with a draft of controlled agreement, against plain decoding.

    PYTHONPATH=$PWD python3 bench/serve_speculative.py --shape 7b --out $OUT/speculative
    PYTHONPATH=$PWD .venv/bin/python bench/serve_speculative.py --shape tiny --out /tmp/spec-bench  # CPU smoke run

Random weights agree with no draft, so the draft here is a stand-in: ControlledDraft runs the
real draft model's forwards (Qwen2-0.5B's shape for the 7B, random weights: what a real 0.5B
draft costs, its cache included) and then, instead of its own token, proposes the 7B's own
next greedy token with probability p, else another token at random. The 7B's greedy tokens
come from the plain part's run of the same requests (greedy decoding is deterministic; where
the speculative run's bf16 rounding makes it diverge from them, acceptance drops, which the
JSON shows: `acceptance_rate` against p, `matches_plain`). It is passed to the engine as its
proposer_factory, the seam LLMEngine has for benchmarks (as runner_factory): nothing of it is
in duoka/, no flag of `duoka serve` reaches it.

Each part runs in a process of its own, so that all of its GPU memory (CUDA graph pools
included) is back before the next one starts:
1. plain: the engine without speculation. Batch 1 (a 128-token prompt, --out-len tokens,
   greedy, ignore_eos: decode tokens/s over the steps after the prefill, median of 3), a batch
   sweep (--batches, 128-token prompts), and the serving peer's workload (--requests prompts of
   --prompt-min..--prompt-max random tokens, --out-len tokens each, all at once). It records
   every request's tokens.
2. spec: the engine with the draft (--num-speculative-tokens = the largest K; a run with a
   smaller K proposes fewer, which costs what that K costs). Batch 1 for each p in --p and K in
   --k; the batch sweep at --sweep-p and --sweep-k (where speculation starts to lose: the
   default of --speculative-disable-by-batch-size); the workload at the same p and K with the
   default switch-off and with speculation always on.

Writes --out/serve_speculative_SHAPE.json: each part's figures (tokens/s, acceptance rate,
mean acceptance length and its expectation (1 - p^(K+1)) / (1 - p) at p), and `speedup`:
batch 1 per (p, K) over plain, the sweep's ratio per batch size, the workload's ratio.
Device kind nvidia-h100-x1 or nvidia-h200; .wheels carried (httpx2, for the prompts).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_models import config_folder, peer_workload  # noqa: E402

from duoka.serve.config import DEFAULT_SPECULATIVE_MAX_BATCH, EngineConfig  # noqa: E402
from duoka.serve.engine import LLMEngine  # noqa: E402
from duoka.serve.params import SamplingParams  # noqa: E402
from duoka.serve.proposers import DraftModelProposer, DraftRequest, Proposal  # noqa: E402

# The draft's shape for each target shape (tiny: the CPU smoke run's, one layer of tiny's).
DRAFTS = {"7b": ("0.5b", {}), "1.5b": ("0.5b", {}), "tiny": ("tiny", {"num_hidden_layers": 1})}


@dataclass
class Agreement:
    """What ControlledDraft proposes in the current run: its tokens agree with the model's greedy
    ones with probability p; at most k per step (0: no speculation, the draft does not run)."""
    p: float = 0.0
    k: int = 0


class ControlledDraft(DraftModelProposer):
    """The real draft's forwards, with the model's own greedy tokens (references: request id ->
    its plain tokens) proposed with probability agreement.p, another token otherwise."""

    def __init__(self, *args, agreement: Agreement, references: dict[str, list[int]], seed: int = 0):
        super().__init__(*args)
        self.agreement, self.references = agreement, references
        self.rng = np.random.default_rng(seed)

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        k = self.agreement.k
        if k == 0:
            return Proposal([[] for _ in requests], None)
        return super().propose([DraftRequest(r.seq, min(r.k, k), r.row) for r in requests])

    def choose(self, q, rows, requests, active, step):
        tokens = []
        for row, i in zip(rows, active):
            reference = self.references.get(requests[i].seq.request_id, [])
            index = row.output_index  # the output index this draft token would take
            right = reference[index] if index < len(reference) else -1
            if right >= 0 and self.rng.random() < self.agreement.p:
                tokens.append(right)
            else:  # any other token, uniformly
                other = int(self.rng.integers(self.vocab - 1))
                tokens.append(other + (other >= right >= 0))
        return torch.tensor(tokens)


def folders(shape: str, root: Path) -> tuple[Path, Path]:
    draft_shape, fields = DRAFTS[shape]
    return config_folder(shape, root / "target"), config_folder(draft_shape, root / "draft", **fields)


def run(engine: LLMEngine, prompts: dict[str, list[int]], out_len: int) -> dict:
    """The requests all at once, greedy: decode tokens/s over the steps after the first two
    (which prefill), the whole run's output tokens/s, and every request's tokens."""
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid in prompts}
    before = engine.stats()
    stamps, counts = [time.perf_counter()], []
    while engine.has_unfinished():
        outs = engine.step()
        stamps.append(time.perf_counter())
        counts.append(sum(len(o.new_token_ids) for o in outs))
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
    after = engine.stats()
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    drafts = after.spec_drafts - before.spec_drafts
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    wall = stamps[-1] - stamps[0]
    return {"requests": len(prompts), "output_tokens": sum(counts), "wall_s": wall,
            "output_tokens_per_s": sum(counts) / wall,
            "decode_tokens_per_s": sum(counts[2:]) / (stamps[-1] - stamps[2]) if len(counts) > 3 else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "steps_off": after.spec_steps_off - before.spec_steps_off, "tokens": tokens}


def workloads(a: argparse.Namespace, vocab: int) -> dict[str, dict[str, list[int]]]:
    """The named request sets, the same in both parts (their ids are the references' keys)."""
    out = {"warm": {f"warm{i}": p for i, p in enumerate(peer_workload(4, 16, 64, vocab, seed=1))},
           "batch1": {"b1": peer_workload(1, 128, 128, vocab, seed=2)[0]}}
    for b in a.batches:
        out[f"sweep{b}"] = {f"s{b}_{i}": p for i, p in enumerate(peer_workload(b, 128, 128, vocab, seed=3))}
    if a.requests:
        out["workload"] = {f"w{i}": p for i, p in
                           enumerate(peer_workload(a.requests, a.prompt_min, a.prompt_max, vocab))}
    return out


def plain_part(a: argparse.Namespace, target: Path, sets: dict, save) -> None:
    engine = LLMEngine(EngineConfig(model=str(target), load_format="dummy", max_model_len=a.max_model_len,
                                    max_num_seqs=a.max_num_seqs, gpu_memory_utilization=a.gpu_memory_utilization,
                                    device=a.device))
    run(engine, sets["warm"], 16)
    batch1 = [run(engine, sets["batch1"], a.out_len) for _ in range(3)]
    save("batch1", {**median(batch1), "runs": [r["decode_tokens_per_s"] for r in batch1]})
    for b in a.batches:
        save(f"sweep{b}", run(engine, sets[f"sweep{b}"], a.sweep_len))
    if a.requests:
        save("workload", run(engine, sets["workload"], a.out_len))


def spec_part(a: argparse.Namespace, target: Path, draft: Path, sets: dict, references: dict, save) -> None:
    agreement = Agreement()

    def factory(config, worker):
        return ControlledDraft(worker.execute_draft, worker.sampler, config.block_size, worker.args.vocab_size,
                               config.max_num_batched_tokens, agreement=agreement, references=references)

    def engine_for(disable: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(target), load_format="dummy", max_model_len=a.max_model_len,
                                      max_num_seqs=a.max_num_seqs, gpu_memory_utilization=a.gpu_memory_utilization,
                                      device=a.device, speculative_model=str(draft),
                                      num_speculative_tokens=max(a.k), speculative_disable_by_batch_size=disable),
                         proposer_factory=factory)

    engine = engine_for(a.max_num_seqs)  # always on: the sweep finds where it loses
    agreement.p, agreement.k = 0.8, max(a.k)
    run(engine, sets["warm"], 16)
    for p in a.p:
        for k in a.k:
            agreement.p, agreement.k = p, k
            runs = [run(engine, sets["batch1"], a.out_len) for _ in range(3)]
            save(f"batch1_p{p}_k{k}", {**median(runs), "p": p, "k": k, "expected_acceptance_length":
                                      (1 - p ** (k + 1)) / (1 - p), "matches_plain": matches(runs[0], references)})
    agreement.p, agreement.k = a.sweep_p, a.sweep_k
    for b in a.batches:
        save(f"sweep{b}", run(engine, sets[f"sweep{b}"], a.sweep_len))
    if a.requests:
        save("workload_always_on", run(engine, sets["workload"], a.out_len))
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        engine = engine_for(DEFAULT_SPECULATIVE_MAX_BATCH)
        run(engine, sets["warm"], 16)
        save("workload_default_switch_off", run(engine, sets["workload"], a.out_len))


def median(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["decode_tokens_per_s"] or 0)[len(runs) // 2]


def matches(result: dict, references: dict) -> float:
    """The share of requests whose speculative tokens equal the plain run's."""
    return float(np.mean([references.get(rid) == tokens for rid, tokens in result["tokens"].items()]))


def part_main(a: argparse.Namespace) -> None:
    """One part, in its own process: its figures (and every request's tokens) in --part-out,
    rewritten after each stage, so a part stopped at its timeout keeps what it finished."""
    target, draft = folders(a.shape, Path(a.root))
    cuda = torch.cuda.is_available() and a.device != "cpu"
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu"}

    def save(name: str, figures: dict) -> None:
        result[name] = figures
        Path(a.part_out).write_text(json.dumps(result))
        print(a.part, name, json.dumps({k: v for k, v in figures.items() if k != "tokens"}), flush=True)

    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    sets = workloads(a, vocab)
    if a.part == "plain":
        plain_part(a, target, sets, save)
    else:
        plain = json.loads(Path(a.references).read_text())
        references = {rid: tokens for figures in plain.values() if isinstance(figures, dict)
                      for rid, tokens in figures.get("tokens", {}).items()}
        spec_part(a, target, draft, sets, references, save)


def ratio(x, y):
    return x / y if x and y else None


def summary(plain: dict, spec: dict, a: argparse.Namespace) -> dict:
    base = (plain.get("batch1") or {}).get("decode_tokens_per_s")
    out = {"batch1": {f"p{p}_k{k}": ratio(spec.get(f"batch1_p{p}_k{k}", {}).get("decode_tokens_per_s"), base)
                      for p in a.p for k in a.k},
           "sweep": {b: ratio(spec.get(f"sweep{b}", {}).get("decode_tokens_per_s"),
                              plain.get(f"sweep{b}", {}).get("decode_tokens_per_s")) for b in a.batches}}
    if a.requests:
        w = plain.get("workload", {}).get("output_tokens_per_s")
        out["workload_always_on"] = ratio(spec.get("workload_always_on", {}).get("output_tokens_per_s"), w)
        out["workload_default_switch_off"] = ratio(
            spec.get("workload_default_switch_off", {}).get("output_tokens_per_s"), w)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="7b", choices=sorted(DRAFTS))
    ap.add_argument("--out", required=True, help="folder for serve_speculative_SHAPE.json")
    ap.add_argument("--root", default="/tmp/duoka-models", help="where the config-only folders are written")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--p", type=float, nargs="+", default=[0.5, 0.8, 0.9], help="agreements of the batch-1 runs")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 6], help="speculative tokens of the batch-1 runs")
    ap.add_argument("--sweep-p", type=float, default=0.8)
    ap.add_argument("--sweep-k", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--sweep-len", type=int, default=128, help="tokens per request of the batch sweep")
    ap.add_argument("--requests", type=int, default=256, help="the peer's workload, all at once (0: none)")
    ap.add_argument("--prompt-min", type=int, default=128)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--part-timeout", type=int, default=900, help="seconds for each part")
    ap.add_argument("--part", choices=("plain", "spec"), help=argparse.SUPPRESS)
    ap.add_argument("--part-out", help=argparse.SUPPRESS)
    ap.add_argument("--references", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.part:
        part_main(a)
        return
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    folders(a.shape, Path(a.root))  # written once here, read by both parts
    result = {"command": " ".join(sys.argv), "shape": a.shape, "draft_shape": DRAFTS[a.shape][0]}
    parts = {}
    for part in ("plain", "spec"):
        part_out = out_dir / f"part_{a.shape}_{part}.json"
        cmd = [sys.executable, __file__, *sys.argv[1:], "--part", part, "--part-out", str(part_out)]
        if part == "spec":
            cmd += ["--references", str(out_dir / f"part_{a.shape}_plain.json")]
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=a.part_timeout, cwd=ROOT, check=False)
            error = None if proc.returncode == 0 else f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {a.part_timeout} s"
        parts[part] = json.loads(part_out.read_text()) if part_out.is_file() else {}
        result[part] = {name: ({k: v for k, v in figures.items() if k != "tokens"} if isinstance(figures, dict)
                               else figures) for name, figures in parts[part].items()}
        result[part]["wall_s"] = time.perf_counter() - t
        if error:
            result[part]["error"] = error
    result["speedup"] = summary(parts["plain"], parts["spec"], a)
    path = out_dir / f"serve_speculative_{a.shape}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["speedup"], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
