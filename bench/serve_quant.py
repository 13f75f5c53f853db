"""Quantized serving on the GPU against bf16 duoka in the same call (issue 39): batch-1 decode
(128-token prompt, 256 tokens, greedy, ignore_eos) with bf16, FP8 quantized at load,
GPTQ-Int4 and AWQ (round-to-nearest folders written from the same random weights); with
--workload also the peer's 256-request workload through the engine, bf16 against FP8.

    PYTHONPATH=$PWD python3 bench/serve_quant.py --shape 7b --out $OUT/quant_7b.json [--workload]

Measured so far (one H100, bench/results/quant/): batch-1 bf16 161.7 tok/s, FP8 179.7 (1.11x),
GPTQ-Int4 282.3 (1.75x) with `--only bf16,fp8,gptq4`; the workload (each engine in its own
process) bf16 29,151 and FP8 34,002 total tok/s (1.17x).

Targets: FP8 batch-1 >= 1.6x bf16, Int4 >= 2.2x; the workload with FP8 >= bf16's total tok/s.
Device kind nvidia-h200 (or nvidia-h100-x1); .wheels carried as for serve_openai_mix.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_models import SHAPES, make_folder, peer_workload  # noqa: E402

from duoka.models.quant import group_kernels  # noqa: E402
from duoka.models.quant.folders import write_quantized_folder  # noqa: E402
from duoka.models.quant.small_batch import load_gemlite  # noqa: E402
from duoka.serve.config import EngineConfig  # noqa: E402
from duoka.serve.engine import LLM, LLMEngine  # noqa: E402
from duoka.serve.params import SamplingParams  # noqa: E402


def batch1(folder: Path, quantization: str | None, vocab: int) -> dict:
    # Memory as a difference: variants share this process, and what an earlier engine left
    # allocated (compiled graphs may keep its weights) is not this one's (an H100 run read
    # 17.8 GiB "weights" for a 5.3 GiB AWQ model right after the bf16 one).
    gc.collect()  # an earlier variant's engine, if a reference cycle still holds it
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(folder), quantization=quantization, max_model_len=4096,
                                    max_num_seqs=1))
    start_s = time.perf_counter() - t0
    prompt = peer_workload(1, 128, 128, vocab)[0]

    def run(out_len: int, rid: str, engine=engine) -> list[float]:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
        stamps = []
        while engine.has_unfinished():
            engine.step()
            stamps.append(time.perf_counter())
        return stamps

    run(32, "warm")
    rates = []
    for k in range(3):
        stamps = run(256, f"timed{k}")
        rates.append((len(stamps) - 3) / (stamps[-1] - stamps[2]))
    result = {"start_s": round(start_s, 1), "tokens_per_s": sorted(rates)[1], "runs": rates,
              "allocated_gib": (torch.cuda.memory_allocated() - before) / 2**30}
    del engine, run  # run's default argument holds the engine too (an H100 run read that as a leak)
    gc.collect()
    torch.cuda.empty_cache()
    result["left_allocated_gib"] = (torch.cuda.memory_allocated() - before) / 2**30  # after del: a leak
    return result


def kernel_check() -> dict:
    """The CUDA kernels against their reference paths on one 7B-sized projection: the group-wise
    int4 matmul against x @ dequantized.T, _scaled_mm's FP8 against the emulated arithmetic."""
    from duoka.models.quant.base import Part, QuantScheme
    from duoka.models.quant.gptq import read_gptq
    from duoka.models.quant.fp8 import quantize_fp8
    from duoka.models.quant.writers import quantize_to_gptq

    torch.manual_seed(0)
    w = torch.randn(4608, 3584, device="cuda") * 0.02
    x = torch.randn(8, 3584, device="cuda", dtype=torch.bfloat16)
    packed = {f"p.{k}": v for k, v in quantize_to_gptq(w, 4, 128).items()}
    int4 = read_gptq(packed.__getitem__, [Part("p")], QuantScheme("gptq", 4, 128), False, torch.device("cuda"),
                     torch.bfloat16)
    ref = x.float() @ int4.dequantize().float().T
    fp8 = quantize_fp8({"p.weight": w.bfloat16()}.__getitem__, [Part("p")], QuantScheme("fp8"), False,
                       torch.device("cuda"), torch.bfloat16)
    return {"int4_kernel": getattr(int4, "kernel", "?"),
            "int4_rel_err": float((int4(x).float() - ref).norm() / ref.norm()),
            "fp8_scaled_mm": bool(getattr(fp8, "uses_scaled_mm", False)),
            "fp8_rel_err_vs_emulation": float((fp8(x).float() - fp8.forward_reference(x).float()).norm()
                                              / fp8.forward_reference(x).float().norm())}


def workload(folder: Path, quantization: str | None, vocab: int) -> dict:
    llm = LLM(str(folder), quantization=quantization, max_model_len=4096)
    prompts = peer_workload(256, 128, 1024, vocab)
    params = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
    llm.generate(prompts[:16], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    tokens = sum(len(p) for p in prompts) + sum(len(o.token_ids) for o in outs)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {"wall_s": wall, "total_tokens_per_s": tokens / wall}


def main() -> None:
    # Several engines in one process share the compiled decoder block's code: each adds its
    # own variants (its projection types, its shapes), past dynamo's default limit of 8. One
    # engine per process, as duoka serve runs, never comes near it.
    torch._dynamo.config.recompile_limit = 64
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--workload", action="store_true")
    ap.add_argument("--only", default="bf16,fp8,gptq4,awq", help="also awq_tinygemm (awq without gemlite)")
    ap.add_argument("--workload-of", default="bf16,fp8", help="engines the workload runs (bf16, fp8, awq)")
    ap.add_argument("--workload-variant", choices=("bf16", "fp8", "awq"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.workload_variant:
        base = make_folder(args.shape)
        folder = base.parent / f"qwen2-{args.shape}-awq" if args.workload_variant == "awq" else base
        print(json.dumps(workload(folder, "fp8" if args.workload_variant == "fp8" else None,
                                  SHAPES[args.shape]["vocab_size"])))
        return
    base = make_folder(args.shape)
    vocab = SHAPES[args.shape]["vocab_size"]
    root = base.parent
    folders = {"bf16": (base, None), "fp8": (base, "fp8")}
    t = time.perf_counter()
    if "gptq4" in args.only:
        folders["gptq4"] = (write_quantized_folder(base, root / f"qwen2-{args.shape}-gptq4", "gptq", 4, device="cuda"),
                            None)
    if "awq" in args.only:
        folders["awq"] = (write_quantized_folder(base, root / f"qwen2-{args.shape}-awq", "awq", 4, device="cuda"),
                          None)
    result = {"shape": args.shape, "command": " ".join(sys.argv), "write_s": round(time.perf_counter() - t, 1),
              "device": torch.cuda.get_device_name(), "kernels": kernel_check()}
    print("kernels", json.dumps(result["kernels"]), flush=True)
    if "awq_tinygemm" in args.only:
        folders["awq_tinygemm"] = folders["awq"]
    for name in args.only.split(","):
        folder, quantization = folders[name]
        # awq_tinygemm: the same folder with gemlite hidden from the kernel choice, so the
        # group-wise layers take PyTorch's tinygemm (the path without duoka[gpu]).
        group_kernels.load_gemlite = (lambda: None) if name == "awq_tinygemm" else load_gemlite
        result[name] = batch1(folder, quantization, vocab)
        print(name, json.dumps(result[name]), flush=True)
    for name in args.only.split(",")[1:]:
        result[f"{name}_vs_bf16"] = result[name]["tokens_per_s"] / result["bf16"]["tokens_per_s"]
    if args.workload:
        # One process per engine: a second engine in this process would find the first one's
        # memory (CUDA graph pools) still held and no room for its KV cache.
        for name in args.workload_of.split(","):
            run = subprocess.run([sys.executable, __file__, "--workload-variant", name, "--shape", args.shape,
                                  "--out", "-"], capture_output=True, text=True, check=True)
            result[f"workload_{name}"] = json.loads(run.stdout.strip().splitlines()[-1])
            print(name, json.dumps(result[f"workload_{name}"]), flush=True)
        for name in args.workload_of.split(",")[1:]:
            result[f"workload_{name}_vs_bf16"] = (result[f"workload_{name}"]["total_tokens_per_s"]
                                                  / result["workload_bf16"]["total_tokens_per_s"])
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    main()
