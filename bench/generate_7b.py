"""Qwen2-7B shape on one GPU: load a sharded checkpoint written by transformers in bf16,
check it against transformers, and time batch-1 generation against transformers'
`generate` in the same process.

    python bench/generate_7b.py --out results.json [--model-dir /tmp/qwen2-7b-random]

Steps: (1) transformers builds a random Qwen2-7B (bf16, on the GPU, seed 0) and writes it
with save_pretrained (5 GB shards); (2) duoka loads it (load time, peak GPU memory);
(3) logits on a 128-token prompt against transformers' model from the same folder;
(4) batch-1 greedy decoding of 256 new tokens after a 128-token prompt, streamed one
token at a time to the host as the CLI does, eager and with the compiled decode step;
the same with transformers' generate (dynamic cache eager; static cache + compiled
forward, its documented fast path, which generate() compiles itself). Each figure is the median of 3 runs after a warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from duoka.models.qwen2.args import FLAVORS, to_hf_config  # noqa: E402
from duoka.models.qwen2.hf_adapter import load_hf_model  # noqa: E402
from duoka.serve.generate import Generator, SamplingParams  # noqa: E402

PROMPT_LEN, NEW_TOKENS, REPEATS = 128, 256, 3
results: dict = {}


def save(out: Path) -> None:
    out.write_text(json.dumps(results, indent=2) + "\n")


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def write_checkpoint(folder: Path, flavor: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (folder / "model.safetensors.index.json").is_file():
        return
    cfg = Qwen2Config(**{k: v for k, v in to_hf_config(FLAVORS[flavor], dtype="bfloat16").items()
                         if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="5GB")
    results["checkpoint_write_s"] = round(time.perf_counter() - t, 1)
    results["checkpoint_files"] = sorted(p.name for p in folder.iterdir())
    results["checkpoint_gib"] = round(sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**30, 2)
    del model
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def time_duoka(gen: Generator, prompt: torch.Tensor) -> dict:
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    runs = []
    for i in range(REPEATS + 1):
        sync()
        t0 = time.perf_counter()
        first = None
        n = 0
        for token in gen.stream(prompt, params):
            int(token[0])  # the host reads every token, as the streaming CLI does
            n += 1
            if first is None:
                first = time.perf_counter() - t0
        total = time.perf_counter() - t0
        if i:  # run 0 is the warm-up (and compilation)
            runs.append(((n - 1) / (total - first), first))
    return {"decode_tok_s": round(statistics.median(r[0] for r in runs), 1),
            "first_token_ms": round(1000 * statistics.median(r[1] for r in runs), 1)}


def time_hf(model, prompt: torch.Tensor, **gen_kwargs) -> dict:
    def run(n):
        sync()
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(prompt), **gen_kwargs)
        sync()
        return time.perf_counter() - t0, out

    run(NEW_TOKENS)  # warm-up (and compilation)
    firsts = [run(1)[0] for _ in range(REPEATS)]
    totals = [run(NEW_TOKENS)[0] for _ in range(REPEATS)]
    first, total = statistics.median(firsts), statistics.median(totals)
    return {"decode_tok_s": round((NEW_TOKENS - 1) / (total - first), 1), "first_token_ms": round(1000 * first, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/qwen2-7b-random"))
    p.add_argument("--flavor", default="qwen2-7b", help="debug gives a CPU smoke test of this script")
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    global DEVICE
    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    results.update(model=a.flavor, device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
                   torch=torch.__version__, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, batch=1, dtype="bfloat16")
    import transformers

    results["transformers"] = transformers.__version__

    write_checkpoint(a.model_dir, a.flavor)
    vocab = FLAVORS[a.flavor].vocab_size
    save(a.out)

    # --- duoka load
    peak = torch.cuda.max_memory_allocated if DEVICE == "cuda" else (lambda: 0)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    t = time.perf_counter()
    model, _ = load_hf_model(a.model_dir, device=DEVICE, dtype=torch.bfloat16)
    sync()
    results["duoka_load_s"] = round(time.perf_counter() - t, 2)
    results["duoka_load_peak_gib"] = round(peak() / 2**30, 2)
    results["weights_gib"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 2)
    save(a.out)

    prompt = torch.randint(0, vocab, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).to(DEVICE)

    # --- duoka decode, eager then compiled
    results["duoka_eager"] = time_duoka(Generator(model), prompt)
    results["duoka_generate_peak_gib"] = round(peak() / 2**30, 2)
    save(a.out)
    with torch.no_grad():
        ours_logits = model(prompt).float()
        ours_greedy = Generator(model).generate(prompt, SamplingParams(max_new_tokens=32))[0].tolist()
    if not a.no_compile:
        try:
            results["duoka_compiled"] = time_duoka(Generator(model, compile=True), prompt)
        except Exception:
            results["duoka_compiled_error"] = traceback.format_exc()[-2000:]
    save(a.out)
    del model
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()

    # --- transformers, same folder
    from transformers import Qwen2ForCausalLM

    sync()
    t = time.perf_counter()
    hf = Qwen2ForCausalLM.from_pretrained(a.model_dir, dtype=torch.bfloat16, device_map=DEVICE if DEVICE == "cuda" else None).eval()
    sync()
    results["hf_load_s"] = round(time.perf_counter() - t, 2)
    with torch.no_grad():
        hf_logits = hf(prompt).logits.float()
        hf_greedy = hf.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0,
                                attention_mask=torch.ones_like(prompt))[0, PROMPT_LEN:].tolist()
    results["bf16_logits_rel_err_vs_hf"] = float((ours_logits - hf_logits).norm() / hf_logits.norm())
    results["bf16_argmax_agreement_vs_hf"] = float((ours_logits.argmax(-1) == hf_logits.argmax(-1)).float().mean())
    results["greedy_32_tokens_equal_prefix"] = next((i for i, (x, y) in enumerate(zip(ours_greedy, hf_greedy)) if x != y), 32)
    del ours_logits, hf_logits
    results["hf_eager"] = time_hf(hf, prompt)
    save(a.out)
    if not a.no_compile:
        # transformers' fast path: a static cache makes generate() compile the decode
        # forward itself (CUDA graphs). Wrapping forward in torch.compile by hand, the
        # older recipe, fails in transformers 5.17 (a CUDA-graph output is read after
        # being overwritten), so that is not used.
        try:
            results["hf_static_compiled"] = time_hf(hf, prompt, cache_implementation="static")
        except Exception:
            results["hf_static_compiled_error"] = traceback.format_exc()[-2000:]
    save(a.out)

    for mode, peer in (("eager", "hf_eager"), ("compiled", "hf_static_compiled")):
        if f"duoka_{mode}" in results and peer in results:
            results[f"vs_peer_{mode}"] = round(results[f"duoka_{mode}"]["decode_tok_s"] / results[peer]["decode_tok_s"], 2)
    save(a.out)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
