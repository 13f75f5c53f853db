"""The serving peer: Hugging Face transformers' own continuous batching (`model.generate_batch`,
paged KV cache) and its batch-1 static-cache decode, on a randomly initialised Qwen2 of a
published shape, bf16, one GPU: what a user of the transformers stack gets without vLLM or
SGLang. `duoka bench serve --vs-peer` runs it (its default --peer) on the same prompts once
its own server has given the GPU back; bench/serve_vs_peer.sh drives that.

    python bench/peers/serve_peer.py --model 7b --requests 256 --prompt-min 128 --prompt-max 1024 --out-len 256
    python bench/peers/serve_peer.py --model 7b --case batch1
    python bench/peers/serve_peer.py --model moe-a2.7b --case continuous  # bench/serve_moe.py runs this
    python bench/peers/serve_peer.py --model tiny --requests 4 --prompt-min 8 --prompt-max 16 --out-len 8  # CPU
    python bench/peers/serve_peer.py --model moe-tiny --requests 4 --prompt-min 8 --prompt-max 16 --out-len 8  # CPU

Workload (`continuous`): --requests prompts of uniformly random token ids, one
random.Random(0) drawing every length first, uniform in [--prompt-min, --prompt-max], then
the ids, uniform in [1, vocab) (duoka/bench/loadgen.py's random_prompts draws the very same
prompts); each request generates exactly --out-len tokens, greedy (the random model has no
end-of-text token to stop it). A warm-up call on the first 8 prompts, then one timed call of
`generate_batch` over all of them (SDPA attention, or --attn; --num-blocks and
--max-batch-tokens size transformers' paged cache, 0: its defaults). `batch1`: one
128-token random prompt (torch generator seeded 0) through `generate` with the static cache,
which `generate` compiles; two warm-up calls, then the median of three timed ones.

A MoE shape (`moe-*`) is transformers' Qwen2MoeForCausalLM, its experts through transformers'
default experts implementation (grouped_mm since transformers 5), which each line names
(`experts`).

Prints one JSON line per case, each with its `case` (`continuous_batching`,
`batch1_static_compiled`): output_tokens_per_s, total_tokens_per_s (prompt + output tokens
over the wall time), wall_s and peak_mem_gib for the first; tokens_per_s and wall_s for the
second. A case that fails prints {"case", "model", "error"} and the next one still runs.
duoka/bench/serving.py's run_peer reads these lines.

The figures it reproduces (the recorded serving peer: one H200, 2026-12-01, torch 2.11,
transformers 5.17, random Qwen2-7B in bf16): on 256 requests of 128-1,024 random prompt
tokens (149,108 in all) and 256 output tokens each, 577 output tok/s, 1,889 total tok/s,
113.6 s, 124 GiB peak; its `paged|eager` attention ran out of memory on the same load.
Batch-1 decode with its static cache, compiled by `generate`: 121 tok/s. In the same calls
as duoka (docs/performance.md "Serving", bench/results/serve/): 1,975 to 2,055 total tok/s,
batch-1 128.8 to 134.8 tok/s. Later transformers releases change generate_batch (5.25
captures CUDA graphs inside each call and takes a ContinuousBatchingConfig): compare on the
version printed in each line.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from qwen2_shapes import CONFIGS, hf_model, is_moe


def build(name: str, attn: str):
    c = CONFIGS[name]
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    # A MoE is made in bf16 from the start: Qwen1.5-MoE-A2.7B's fp32 copy (57 GB) beside its
    # bf16 one would not fit an 80 GB GPU. The dense shapes keep the recorded runs' fp32 init.
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype if is_moe(c) else torch.float32)
    try:
        with torch.device(dev):
            model = hf_model(c, attn_implementation=attn, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    finally:
        torch.set_default_dtype(before)
    return model.to(dtype).eval(), dev


def experts(model) -> dict:
    """A MoE's experts implementation as transformers resolved it at init; nothing for a dense model."""
    name = getattr(model.config, "_experts_implementation", None) if is_moe(model.config.to_dict()) else None
    return {"experts": name} if name else {}


def workload(a: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    lens = [rng.randint(a.prompt_min, a.prompt_max) for _ in range(a.requests)]
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lens]


def cache_options(gen, a: argparse.Namespace) -> dict:
    """--num-blocks / --max-batch-tokens where this transformers takes them: a
    ContinuousBatchingConfig (newer releases) or fields of the GenerationConfig (5.17)."""
    given = {k: v for k, v in (("num_blocks", a.num_blocks), ("max_batch_tokens", a.max_batch_tokens)) if v}
    if not given:
        return {}
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        for k, v in given.items():
            setattr(gen, k, v)
        return {}
    return {"continuous_batching_config": ContinuousBatchingConfig(**given)}


def continuous(a: argparse.Namespace) -> dict:
    from transformers import GenerationConfig

    model, dev = build(a.model, a.attn)
    prompts = workload(a, model.config.vocab_size)
    gen = GenerationConfig(max_new_tokens=a.out_len, min_new_tokens=a.out_len, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    extra = cache_options(gen, a)
    model.generate_batch(inputs=prompts[: min(8, len(prompts))], generation_config=gen, **extra)  # warm-up
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gen, **extra)
    if dev == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    produced = sum(len(o.generated_tokens) for o in out.values())
    prompt_tokens = sum(map(len, prompts))
    return dict(case="continuous_batching", model=a.model, attn=a.attn, requests=a.requests,
                prompt_tokens=prompt_tokens, output_tokens=produced, wall_s=wall,
                output_tokens_per_s=produced / wall, total_tokens_per_s=(produced + prompt_tokens) / wall,
                peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None, **experts(model))


def batch1(a: argparse.Namespace) -> dict:
    model, dev = build(a.model, "sdpa")
    ids = torch.randint(1, model.config.vocab_size, (1, 128), device=dev,
                        generator=torch.Generator(dev).manual_seed(0))
    kw = dict(max_new_tokens=a.out_len, min_new_tokens=a.out_len, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    model.generate(ids, **kw)  # warm-up: generate() compiles the static-cache forward
    model.generate(ids, **kw)
    times = []
    for _ in range(3):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    n = out.shape[1] - ids.shape[1]
    return dict(case="batch1_static_compiled", model=a.model, new_tokens=n, wall_s=sorted(times)[1],
                tokens_per_s=n / sorted(times)[1], **experts(model))


def main() -> None:
    p = argparse.ArgumentParser(description="transformers continuous batching and batch-1 decode, one GPU")
    p.add_argument("--model", default="7b", choices=sorted(CONFIGS))
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-min", type=int, default=128)
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument("--out-len", type=int, default=256)
    p.add_argument("--attn", default="sdpa", help="sdpa | paged|eager | a flash implementation")
    p.add_argument("--num-blocks", type=int, default=0, help="paged cache blocks (0: transformers' default)")
    p.add_argument("--max-batch-tokens", type=int, default=0)
    p.add_argument("--case", default="both", choices=["both", "continuous", "batch1"])
    a = p.parse_args()
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name, fn in (("continuous", continuous), ("batch1", batch1)):
        if a.case in (name, "both"):
            try:
                print(json.dumps({**fn(a), **versions}), flush=True)
            except Exception as e:  # report and go on: one peer path failing says something too
                print(json.dumps(dict(case=name, model=a.model, error=f"{type(e).__name__}: {e}"[:2000], **versions)),
                      flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
