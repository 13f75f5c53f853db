"""GPU checks of the serving engine's fast path (one device call).

    python bench/serve_gpu_check.py --out $OUT/serve_gpu_check.json [--shape 0.5b]

1. The cuda attention backend (Triton cache write, decode and merge kernels, flash varlen
   prefill) and the mixed one (paged_mixed's kernel for every row) against the reference
   kernel (outputs; caches to the last bit) on random paged batches of mixed decodes and
   prefill chunks, bf16, for the 7B, 1.5B and 0.5B head layouts and several context splits.
2. Teacher-forced logits of a random Qwen2 of the given shape (bf16): a prefill of B
   prompts, then decode steps of given tokens, run by the ModelRunner as the engine runs
   them (uncompiled eager; compiled blocks eager; compiled blocks + CUDA graphs; the
   tensor-parallel loader with its NCCL all-reduce hooks inside the graphs, one rank),
   against the plain forward over the whole sequences. Random weights give near-uniform
   logits, so greedy tokens would flip on bf16 rounding: logits are compared instead.
3. For information: the serving peer's workload (256 requests) and batch-1 decode.

Cited by docs/serving.md (the kernels the GPU path is checked against) and
docs/performance.md "Serving" (the 0.5B engine figures, bench/results/serve/gpu_check_0.5b.run*.json);
device kind nvidia-h200, from the repository root; bench/serve_gpu_smoke.sh runs it first:

    python3 bench/serve_gpu_check.py --shape 0.5b --out $OUT/gpu_check_0.5b.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_models import SHAPES, make_folder, peer_workload  # noqa: E402

from duoka.models.qwen2.args import ModelOptions  # noqa: E402
from duoka.models.qwen2.hf_adapter import read_config  # noqa: E402
from duoka.models.qwen2.paged import PagedBatch, paged_attention  # noqa: E402
from duoka.host.ports import free_port  # noqa: E402
from duoka.serve.tp_shard import all_reduce_outputs, load_tp_model  # noqa: E402
from duoka.serve.engine import LLM  # noqa: E402
from duoka.serve.params import SamplingParams  # noqa: E402
from duoka.serve.runner import CacheShape, ModelRunner, StepInputs  # noqa: E402


def kernel_check(heads: int, kv_heads: int, head_dim: int, splits: int, seed: int) -> tuple[float, float]:
    """(largest output difference, largest cache difference) of the cuda backend against the
    reference, and the largest output difference of the mixed backend (every row through
    paged_mixed's kernel, as a mixed step's CUDA graph runs it) against the reference."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)
    block, num_blocks = 16, 4096
    shape = (num_blocks + 1, block, kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    decodes = [rng.randint(1, 3000) for _ in range(rng.randint(1, 40))]
    prefills = [(rng.randint(0, 2000), rng.randint(2, 300)) for _ in range(rng.randint(0, 4))]  # (cached, new)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, context, q_lens = [], [], []
    for ctx in decodes:
        context.append(ctx)
        q_lens.append(1)
    for cached, new in prefills:
        context.append(cached + new)
        q_lens.append(new)
    for ctx in context:
        tables.append([free.pop() for _ in range(-(-ctx // block))])
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    slots = []
    for t, ctx, n in zip(tables, context, q_lens):
        slots += [t[p // block] * block + p % block for p in range(ctx - n, ctx)]
    total = sum(q_lens)
    q = torch.randn(1, heads, total, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, kv_heads, total, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, kv_heads, total, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    common = dict(slot_mapping=torch.tensor(slots, device="cuda"), block_tables=bt,
                  context_lens=torch.tensor(context, dtype=torch.int32, device="cuda"),
                  query_start=torch.tensor(starts, dtype=torch.int32, device="cuda"), max_query_len=max(q_lens),
                  logits_indices=torch.arange(total, device="cuda"))
    outs, caches = [], []
    for backend in ("reference", "cuda", "mixed"):
        batch = PagedBatch([k_cache.clone()], [v_cache.clone()], backend=backend, num_decodes=len(decodes),
                           decode_splits=splits, prefill_context=sum(context[len(decodes):]),
                           max_context_len=max(context), **common)
        outs.append(paged_attention(q, k, v, batch).float())
        caches.append((batch.k_caches[0], batch.v_caches[0]))
    cache_diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(*caches[:2]))
    return (outs[0] - outs[1]).abs().max().item(), cache_diff, (outs[0] - outs[2]).abs().max().item()


def forced_logits(folder: Path, options: ModelOptions, cuda_graphs: bool, tp_hooks: bool,
                  tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[B, steps + 1, vocab] logits: after the prompt, then after each forced token."""
    args = read_config(folder)
    device = torch.device("cuda", 0)
    model = load_tp_model(folder, args, None, device, torch.bfloat16, options)
    hooks = all_reduce_outputs(model, None) if tp_hooks else []
    b, total = tokens.shape
    per_seq = -(-total // 16)
    shape = CacheShape(args.n_layers, b * per_seq, 16, args.n_kv_heads, args.resolved_head_dim, torch.bfloat16)
    runner = ModelRunner(model, shape, device, per_seq * 16, max_num_seqs=8, cuda_graphs=cuda_graphs)
    tables = torch.arange(b * per_seq, dtype=torch.int32).view(b, per_seq)

    def slot(i, p):
        return int(tables[i, p // 16]) * 16 + p % 16

    n = prompt_len
    out = [runner.execute(StepInputs(
        tokens[:, :n].reshape(-1), torch.arange(n).repeat(b),
        torch.tensor([slot(i, p) for i in range(b) for p in range(n)]), tables, torch.full((b,), n, dtype=torch.int32),
        torch.arange(0, b * n + 1, n, dtype=torch.int32), torch.arange(n - 1, b * n, n), n, 0, n, b * n)).clone()]
    for p in range(n, total - 1):
        out.append(runner.execute(StepInputs(
            tokens[:, p], torch.full((b,), p), torch.tensor([slot(i, p) for i in range(b)]), tables,
            torch.full((b,), p + 1, dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32), torch.arange(b),
            1, b, p + 1, 0)).clone())
    for h in hooks:
        h.remove()
    del runner, model
    torch.cuda.empty_cache()
    return torch.stack(out, dim=1).float()


def logits_check(folder: Path) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    args = read_config(folder)
    b, prompt_len, steps = 3, 40, 24
    tokens = torch.randint(1, args.vocab_size, (b, prompt_len + steps), generator=torch.Generator().manual_seed(0))
    model = load_tp_model(folder, args, None, torch.device("cuda", 0), torch.bfloat16)
    with torch.no_grad():
        plain = model(tokens.cuda())[:, prompt_len - 1:-1].float()
    del model
    torch.cuda.empty_cache()
    packed = ModelOptions(packed_projections=True)
    configs = {"eager": (ModelOptions(), False, False),
               "eager+packed": (packed, False, False),
               "compiled": (ModelOptions(compile="block"), False, False),
               "compiled+packed+graphs": (packed.replace(compile="block", compile_dynamic=True), True, False),
               "compiled+packed+graphs+tp_hooks": (packed.replace(compile="block", compile_dynamic=True), True, True)}
    result = {"logit_scale": plain.abs().max().item()}
    for name, (options, graphs, hooks) in configs.items():
        got = forced_logits(folder, options, graphs, hooks, tokens, prompt_len)
        result[name] = dict(max_abs_diff=(got - plain).abs().max().item(),
                            argmax_agreement=(got.argmax(-1) == plain.argmax(-1)).float().mean().item())
    dist.destroy_process_group()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--requests", type=int, default=256, help="the workload of part 3; 0: the checks alone")
    a = ap.parse_args()
    results: dict = {"shape": a.shape, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    out = Path(a.out)

    def save():
        out.write_text(json.dumps(results, indent=2) + "\n")

    errors = {}
    for heads, kv, dim in ((28, 4, 128), (14, 2, 64), (12, 2, 128)):
        for splits in (1, 4, 16):
            checks = [kernel_check(heads, kv, dim, splits, s) for s in range(3)]
            errors[f"{heads}h{kv}kv{dim}d/splits{splits}"] = max(c[0] for c in checks)
            errors[f"{heads}h{kv}kv{dim}d/splits{splits}/cache"] = max(c[1] for c in checks)  # must be 0
            errors[f"{heads}h{kv}kv{dim}d/splits{splits}/mixed"] = max(c[2] for c in checks)
    results["kernel_max_abs_error_vs_reference"] = errors
    print(json.dumps(errors), flush=True)
    save()

    folder = make_folder(a.shape)
    results["teacher_forced_logits_vs_plain_forward"] = logits_check(folder)
    print(json.dumps(results["teacher_forced_logits_vs_plain_forward"]), flush=True)
    save()
    if a.requests == 0:
        return

    vocab = SHAPES[a.shape]["vocab_size"]
    t = time.perf_counter()
    llm = LLM(folder, max_num_seqs=256, max_model_len=4096)
    results["engine_start_s"] = time.perf_counter() - t
    load = peer_workload(a.requests, vocab=vocab)
    params = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    llm.generate(load[:8], params)
    torch.cuda.synchronize()
    t = time.perf_counter()
    done = llm.generate(load, params)
    wall = time.perf_counter() - t
    prompt_tokens, output_tokens = sum(map(len, load)), sum(len(c.token_ids) for c in done)
    results["workload"] = dict(requests=a.requests, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                               wall_s=wall, total_tokens_per_s=(prompt_tokens + output_tokens) / wall,
                               output_tokens_per_s=output_tokens / wall)
    print(json.dumps(results["workload"]), flush=True)
    save()

    engine = llm.engine
    engine.add_request("b1", load[0][:128], SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
    stamps = []
    while engine.has_unfinished():
        engine.step()
        stamps.append(time.perf_counter())
    results["batch1_decode_tokens_per_s"] = (len(stamps) - 2) / (stamps[-1] - stamps[1])
    print(json.dumps({"batch1_decode_tokens_per_s": results["batch1_decode_tokens_per_s"]}), flush=True)
    save()


if __name__ == "__main__":
    main()
