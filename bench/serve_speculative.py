"""Speculative decoding on one GPU (issue 42): a random-weight Qwen2-7B (`--load-format dummy`)
with a draft of controlled agreement, against plain decoding.

    PYTHONPATH=$PWD python3 bench/serve_speculative.py --shape 7b --out $OUT/speculative
    PYTHONPATH=$PWD .venv/bin/python bench/serve_speculative.py --shape tiny --out /tmp/spec-bench \
        --batches 1 8 --requests 16 --prompt-max 256 --out-len 96  # CPU smoke run, 2-4 min

Random weights agree with no draft, so the draft here is a stand-in over a target whose greedy
token is planted: after the dummy load (the runner factory, before the CUDA graphs), each token
row of the 7B's embedding is scaled to RMS EMBED_RMS, so that it dominates the residual stream
(every block reads it RMS-normed: the blocks' outputs keep their size), and lm_head row pi(i) is
set to embedding row i's direction, pi a fixed single-cycle permutation of the ids both models
have. The last hidden state is then ~ embed[last token], and the greedy next token is
pi(last token) with a margin of ~|e|^2 against ~|e|^2 / sqrt(dim) for every other row: no
rounding (the K + 1-row verification against the 1-row CUDA graph) moves it. The shapes, and so
the cost, are the real 7B's. ControlledDraft runs the real draft model's forwards (Qwen2-0.5B's
shape for the 7B, random weights: what a real 0.5B draft costs, its cache included) and then,
instead of its own token, proposes pi(previous token) with probability p, else another id. A
draft of K tokens is then accepted up to its first miss: the mean acceptance length is
(1 - p^(K+1)) / (1 - p), the acceptance rate (accepted over drafted, vLLM's) p (1 - p^K) /
((1 - p) K), both in the JSON beside the measured ones, with `follows_map` (the share of
output tokens that are pi(previous): 1 when the plant holds) and `matches_plain`. The draft is
passed to the engine as its proposer_factory, the seam LLMEngine has for benchmarks (as
runner_factory): nothing of it is in duoka/, no flag of `duoka serve` reaches it. Every id in
play (prompts, pi's range) is below both vocabularies (0.5B: 151,936; 7B: 152,064), and the
head rows past pi's range are zero, so no id ever reaches the draft that its embedding lacks.

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
   default of --speculative-disable-by-batch-size); the workload at the same p and K with
   speculation always on.
3. switch (with --requests): the workload again, with the default switch-off. Its own process:
   an engine deleted inside one process left its memory taken (NOTES 36: the second engine got
   a tenth of the cache, which made the first run of this part meaningless).

Writes --out/serve_speculative_SHAPE.json: each part's figures (tokens/s, acceptance rate,
mean acceptance length and its expectation (1 - p^(K+1)) / (1 - p) at p), and `speedup`:
batch 1 per (p, K) over plain, the sweep's ratio per batch size, the workload's ratio.
Device kind nvidia-h100-x1 or nvidia-h200; .wheels carried (httpx2, for the prompts).
"""

from __future__ import annotations

import argparse
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
from duoka.serve.runner import ModelRunner  # noqa: E402

# The draft's shape for each target shape (tiny: the CPU smoke run's, one layer of tiny's).
DRAFTS = {"7b": ("0.5b", {}), "1.5b": ("0.5b", {}), "tiny": ("tiny", {"num_hidden_layers": 1})}
# The target's head must be its own matrix to hold the permuted rows (Qwen2-7B's already is; a
# tied shape is untied: the same matmul, one more vocab x dim matrix of memory).
TARGET_FIELDS = {"tie_word_embeddings": False}
# Per-component RMS of the target's scaled embedding rows. Each random block (normal(0, 0.02)
# weights, RMS-normed input) adds an output of RMS ~2.5 at the 7B's width, whatever the stream's
# size (measured on CPU); 28 of them add at most ~70 even all aligned, ~13 as random directions:
# at 1024 the embedding keeps the last hidden state within a few degrees of its direction.
EMBED_RMS = 1024.0
PLANT_CHUNK = 16384  # embedding rows planted at a time: no vocab-sized temporary on the device
PI_SEED = 7


def planted_map(vocab: int, seed: int = PI_SEED) -> np.ndarray:
    """pi: a permutation of 0..vocab-1 of one cycle (Sattolo's: no fixed point, so a greedy walk
    never repeats a token before visiting them all), the same in every process for a seed."""
    order = np.random.default_rng(seed).permutation(vocab)
    pi = np.empty(vocab, dtype=np.int64)
    pi[order] = np.roll(order, -1)
    return pi


@torch.no_grad()
def plant_(model, pi: np.ndarray) -> None:
    """Make pi(last token) the target's greedy token by a wide margin (the module's docstring):
    head[pi(i)] = embed[i] as drawn, then embed[i] scaled to RMS EMBED_RMS; head rows past pi's
    range zero, so that no id the draft lacks ever wins. In place, before the runner exists."""
    embed, head = model.tok_embeddings.weight, model.output.weight
    assert embed.data_ptr() != head.data_ptr(), "the target's head is tied to its embedding: untie its config"
    n = len(pi)
    assert n <= min(len(embed), len(head)), (n, embed.shape, head.shape)
    dest = torch.from_numpy(pi).to(embed.device)
    for start in range(0, n, PLANT_CHUNK):  # the copy reads each row before its scaling writes it
        stop = min(start + PLANT_CHUNK, n)  # pi covers the draft's ids, fewer than the target's rows
        rows = embed[start:stop]
        head.index_copy_(0, dest[start:stop], rows)
        rms = rows.float().pow(2).mean(dim=1, keepdim=True).sqrt().clamp_min(1e-12)
        rows.copy_(rows.float() * (EMBED_RMS / rms))
    head[n:].zero_()


def planted_runner(pi: np.ndarray):
    """A runner_factory: the engine's own ModelRunner over the model with pi planted (before the
    runner captures its CUDA graphs; they read the same parameter storage anyway)."""
    def factory(model, *args):
        plant_(model, pi)
        return ModelRunner(model, *args)
    return factory


@dataclass
class Agreement:
    """What ControlledDraft proposes in the current run: its tokens agree with the model's greedy
    ones with probability p; at most k per step (0: no speculation, the draft does not run)."""
    p: float = 0.0
    k: int = 0


class ControlledDraft(DraftModelProposer):
    """The real draft's forwards, then pi(previous token) proposed with probability agreement.p
    (the target's greedy token after a plant_), another id below len(pi) otherwise."""

    def __init__(self, *args, agreement: Agreement, pi: np.ndarray, seed: int = 0):
        super().__init__(*args)
        self.agreement, self.pi = agreement, pi
        self.rng = np.random.default_rng(seed)
        self._previous: dict[int, int] = {}  # request index -> the token it drafted at the last step

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        k = self.agreement.k
        if k == 0:
            return Proposal([[] for _ in requests], None)
        self._previous.clear()
        return super().propose([DraftRequest(r.seq, min(r.k, k), r.row) for r in requests])

    def choose(self, q, rows, requests, active, step):
        """Step 0 follows the context's last token, step j > 0 the request's draft token j - 1
        (choose runs once per step, in order, for the requests still drafting)."""
        tokens, n = [], len(self.pi)
        for i in active:
            last = requests[i].seq.all_ids[-1] if step == 0 else self._previous[i]
            right = int(self.pi[last]) if last < n else -1
            if right >= 0 and self.rng.random() < self.agreement.p:
                token = right
            else:  # any other id the draft has, uniformly
                other = int(self.rng.integers(n - 1))
                token = other + (other >= right >= 0)
            self._previous[i] = token
            tokens.append(token)
        return torch.tensor(tokens)


def expected(p: float, k: int) -> dict:
    """A draft of k tokens each right with probability p (given the ones before): accepted up
    to its first miss."""
    accepted = k if p >= 1 else p * (1 - p ** k) / (1 - p)  # sum of p^j, j = 1..k
    return {"p": p, "k": k, "expected_acceptance_length": 1 + accepted, "expected_acceptance_rate": accepted / k}


def follows(prompts: dict[str, list[int]], tokens: dict[str, list[int]], pi: np.ndarray) -> float | None:
    """The share of output tokens that are pi(previous token): 1 when the plant holds."""
    hits = total = 0
    for rid, out in tokens.items():
        previous = prompts[rid][-1]
        for token in out:
            hits += previous < len(pi) and token == pi[previous]
            total += 1
            previous = token
    return hits / total if total else None


def folders(shape: str, root: Path) -> tuple[Path, Path]:
    draft_shape, fields = DRAFTS[shape]
    return (config_folder(shape, root / "target", **TARGET_FIELDS),
            config_folder(draft_shape, root / "draft", **fields))


def shared_vocab(target: Path, draft: Path) -> int:
    """The ids both models embed: prompts and pi stay below it."""
    return min(json.loads((folder / "config.json").read_text())["vocab_size"] for folder in (target, draft))


def run(engine: LLMEngine, prompts: dict[str, list[int]], out_len: int, pi: np.ndarray) -> dict:
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
            "spec_counts": {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted},
            "steps_off": after.spec_steps_off - before.spec_steps_off, "follows_map": follows(prompts, tokens, pi),
            "tokens": tokens}


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


def plain_part(a: argparse.Namespace, target: Path, sets: dict, pi: np.ndarray, save) -> None:
    engine = LLMEngine(EngineConfig(model=str(target), load_format="dummy", max_model_len=a.max_model_len,
                                    max_num_seqs=a.max_num_seqs, gpu_memory_utilization=a.gpu_memory_utilization,
                                    device=a.device), runner_factory=planted_runner(pi))
    run(engine, sets["warm"], 16, pi)
    batch1 = [run(engine, sets["batch1"], a.out_len, pi) for _ in range(3)]
    save("batch1", {**median(batch1), "runs": [r["decode_tokens_per_s"] for r in batch1]})
    for b in a.batches:
        save(f"sweep{b}", run(engine, sets[f"sweep{b}"], a.sweep_len, pi))
    if a.requests:
        save("workload", run(engine, sets["workload"], a.out_len, pi))


def spec_part(a: argparse.Namespace, target: Path, draft: Path, sets: dict, pi: np.ndarray, references: dict,
              save) -> None:
    agreement = Agreement()

    def factory(config, worker):
        return ControlledDraft(worker.execute_draft, worker.sampler, config.block_size, worker.args.vocab_size,
                               config.max_num_batched_tokens, worker.draft_args.vocab_size, agreement=agreement, pi=pi)

    def engine_for(disable: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(target), load_format="dummy", max_model_len=a.max_model_len,
                                      max_num_seqs=a.max_num_seqs, gpu_memory_utilization=a.gpu_memory_utilization,
                                      device=a.device, speculative_model=str(draft),
                                      num_speculative_tokens=max(a.k), speculative_disable_by_batch_size=disable),
                         runner_factory=planted_runner(pi), proposer_factory=factory)

    def check(name: str, result: dict, p: float, k: int) -> None:
        save(name, {**result, **expected(p, k), "matches_plain": matches(result, references)})

    if a.part == "switch":  # its own process: a deleted engine's GPU memory is not all given back
        engine = engine_for(DEFAULT_SPECULATIVE_MAX_BATCH)
        agreement.p, agreement.k = a.sweep_p, a.sweep_k
        run(engine, sets["warm"], 16, pi)
        check("workload_default_switch_off", run(engine, sets["workload"], a.out_len, pi), a.sweep_p, a.sweep_k)
        return
    engine = engine_for(a.max_num_seqs)  # always on: the sweep finds where it loses
    agreement.p, agreement.k = 0.8, max(a.k)
    run(engine, sets["warm"], 16, pi)
    for p in a.p:
        for k in a.k:
            agreement.p, agreement.k = p, k
            runs = [run(engine, sets["batch1"], a.out_len, pi) for _ in range(3)]
            check(f"batch1_p{p}_k{k}", {**median(runs), **pooled(runs)}, p, k)
    agreement.p, agreement.k = a.sweep_p, a.sweep_k
    for b in a.batches:
        check(f"sweep{b}", run(engine, sets[f"sweep{b}"], a.sweep_len, pi), a.sweep_p, a.sweep_k)
    if a.requests:
        check("workload_always_on", run(engine, sets["workload"], a.out_len, pi), a.sweep_p, a.sweep_k)


def median(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["decode_tokens_per_s"] or 0)[len(runs) // 2]


def pooled(runs: list[dict]) -> dict:
    """The acceptance over all the runs' drafts (one batch-1 run of 256 tokens holds ~100: its
    own rate is within ~0.1 of the expectation, the three's together closer)."""
    total = {key: sum(r["spec_counts"][key] for r in runs) for key in runs[0]["spec_counts"]}
    return {"pooled_acceptance_rate": total["accepted_tokens"] / total["draft_tokens"] if total["drafts"] else None,
            "pooled_mean_acceptance_length": 1 + total["accepted_tokens"] / total["drafts"] if total["drafts"]
            else None}


def matches(result: dict, references: dict) -> float:
    """The share of requests whose speculative tokens equal the plain run's (greedy: all of them)."""
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

    vocab = shared_vocab(target, draft)
    sets, pi = workloads(a, vocab), planted_map(vocab)
    if a.part == "plain":
        plain_part(a, target, sets, pi, save)
    else:
        plain = json.loads(Path(a.references).read_text())
        references = {rid: tokens for figures in plain.values() if isinstance(figures, dict)
                      for rid, tokens in figures.get("tokens", {}).items()}
        spec_part(a, target, draft, sets, pi, references, save)


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
    ap.add_argument("--part", choices=("plain", "spec", "switch"), help=argparse.SUPPRESS)
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
    for part in ("plain", "spec", "switch") if a.requests else ("plain", "spec"):
        part_out = out_dir / f"part_{a.shape}_{part}.json"
        cmd = [sys.executable, __file__, *sys.argv[1:], "--part", part, "--part-out", str(part_out)]
        if part != "plain":
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
    result["speedup"] = summary(parts["plain"], {**parts["spec"], **parts.get("switch", {})}, a)
    path = out_dir / f"serve_speculative_{a.shape}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["speedup"], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
