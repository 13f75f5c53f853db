"""Causal attention kernels on GPU: which exact kernel is fastest for Qwen2's head shapes.

    python bench/attention_kernels.py --out $OUT/attention_kernels.json

Forward + backward of causal self-attention, bf16, 16k tokens (batch x 2048, and the same
tokens at 4096 and 8192), for each Qwen2 shape's heads (query heads, KV heads, head dim),
through each way duoka can run it: SDPA restricted to one backend at a time (flash, cuDNN,
memory-efficient; GQA through enable_gqa, or with repeated KV heads where a backend refuses
it), flex attention (compiled) and flash varlen with one document per row. Each output is
compared with the flash result (cuDNN's with --fa4), output and the gradients of
q, k and v. Times are CUDA-event medians of 10 runs after 3 warm-up runs.
Reproduces bench/results/attention_kernels.md, which docs/config.md (`attention_kernel`) and
docs/performance.md cite (device kind nvidia-h200, nothing carried but the repository).

    python bench/attention_kernels.py --compile-check

--compile-check answers another question (bench/NOTES.md section 16, docs/performance.md
"What makes the difference"): does a compiled function honour the SDPA kernel choice? Causal
GQA attention (1.5B's heads, 2 x 2048 tokens), forward + backward, profiled; it prints the
attention kernels that ran. The same function is compiled under PyTorch's process-wide
switches set to flash only, then (after torch._dynamo.reset()) to cuDNN only; then with the
choice made inside the function by sdpa_kernel(), as duoka's model does
(Attention.sdpa_backend). Run it in a fresh process: the compile caches persist. (It was
bench/sdpa_compile_check.py.)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.profiler import ProfilerActivity, profile

from duoka.models.qwen2.args import FLAVORS
from duoka.models.qwen2.model import Varlen, _varlen_attention

SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION}


def timed(fn, q, k, v, runs=10, warmup=3) -> float:
    times = []
    for i in range(warmup + runs):
        for t in (q, k, v):
            t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def fa4(q, k, v):
    """FlashAttention-4 on [batch, heads, seq, dim] views (it takes [batch, seq, heads, dim])."""
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)


# ---------------------------------------------------------------- --compile-check


def attention_kernels(fn, *args) -> list[str]:
    """The attention kernels one profiled forward + backward of fn(*args) ran (after one unprofiled)."""
    fn(*args).sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args).sum().backward()
        torch.cuda.synchronize()
    words = ("flash", "fmha", "sdpa", "cudnn", "attention", "efficient")
    return sorted({e.key[:70] for e in prof.key_averages() if any(w in e.key.lower() for w in words)})


def switches(backend: SDPBackend) -> None:
    """PyTorch's process-wide SDPA switches: only `backend` on."""
    torch.backends.cuda.enable_flash_sdp(backend == SDPBackend.FLASH_ATTENTION)
    torch.backends.cuda.enable_cudnn_sdp(backend == SDPBackend.CUDNN_ATTENTION)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_math_sdp(False)


def compile_check() -> None:
    def plain(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def chosen(backend):
        def fn(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return fn

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (12, 2, 2))
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        switches(backend)
        torch._dynamo.reset()
        print(f"switches {backend.name}, compiled: {attention_kernels(torch.compile(plain), q, k, v)}")
    switches(SDPBackend.FLASH_ATTENTION)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        torch._dynamo.reset()
        print(f"sdpa_kernel({backend.name}) inside, compiled: "
              f"{attention_kernels(torch.compile(chosen(backend)), q, k, v)}")


# ---------------------------------------------------------------- the kernel table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="the JSON of the kernel table (required unless --compile-check)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--fa4", action="store_true",
                    help="compare FlashAttention-4 (the flash-attn-4 package, called directly) with cuDNN only")
    ap.add_argument("--compile-check", action="store_true",
                    help="only print which attention kernels a compiled function runs under each way of choosing")
    args = ap.parse_args()
    if args.compile_check:
        compile_check()
        return
    if not args.out:
        ap.error("--out is required (or give --compile-check)")
    torch._dynamo.config.recompile_limit = 64  # flex is specialised per shape: 9 shapes x grad modes
    flex = torch.compile(flex_attention, dynamic=False)
    results = []
    for flavor in ("qwen2-0.5b", "qwen2-1.5b", "qwen2-7b"):
        a = FLAVORS[flavor]
        hq, hkv, d = a.n_heads, a.n_kv_heads, a.resolved_head_dim
        for seq in (2048, 4096, 8192):
            b = args.tokens // seq
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, hq, seq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            k = torch.randn(b, hkv, seq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            v = torch.randn(b, hkv, seq, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            # causal attention FLOPs, forward + backward (2.5x forward), PaLM-style half of the square
            flops = 4 * b * hq * seq * seq * d / 2 * 3.5
            reference = None
            row = {"flavor": flavor, "heads": hq, "kv_heads": hkv, "head_dim": d, "seq": seq, "batch": b, "ms": {},
                   "tflops": {}, "max_rel_diff_vs_flash": {}, "errors": {}}

            def sdpa(name, repeat):
                def fn(q, k, v):
                    if repeat:
                        k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
                    with sdpa_kernel(SDPA[name]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not repeat)
                return fn

            block = create_block_mask(lambda b_, h_, i, j: i >= j, None, None, seq, seq, device="cuda")
            cu = torch.arange(0, b * seq + 1, seq, device="cuda", dtype=torch.int32)
            if args.fa4:  # cuDNN first: it is the reference for the differences then
                candidates = {"cudnn": sdpa("cudnn", False), "fa4": fa4}
            else:
                candidates = {"flash": sdpa("flash", False), "cudnn": sdpa("cudnn", False),
                              "cudnn_repeat_kv": sdpa("cudnn", True), "efficient_repeat_kv": sdpa("efficient", True),
                              "flex": lambda q, k, v: flex(q, k, v, block_mask=block, enable_gqa=True),
                              "varlen": lambda q, k, v: _varlen_attention(q, k, v, Varlen(cu, seq)).transpose(1, 2)}
            dout = torch.randn(b, seq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
            for name, fn in candidates.items():
                try:
                    for t in (q, k, v):
                        t.grad = None
                    out = fn(q, k, v)
                    out.backward(dout)
                    values = [out.detach().float()] + [t.grad.float() for t in (q, k, v)]
                    ms = timed(fn, q, k, v)
                except Exception as e:  # a backend that refuses this shape: recorded, not hidden
                    row["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    continue
                if reference is None:
                    reference = values
                row["ms"][name] = ms
                row["tflops"][name] = flops / ms / 1e9
                # output and dq, dk, dv: largest difference relative to the reference's largest value
                row["max_rel_diff_vs_flash"][name] = [float((a - r).abs().max() / r.abs().max())
                                                      for a, r in zip(values, reference)]
            print(json.dumps(row), flush=True)
            results.append(row)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
