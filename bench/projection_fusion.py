"""Linear layers that read the same input: one matmul each, or one over the concatenated
weights (`training.fuse_projections`, duoka.models.qwen2.model.fused_linear).

    python bench/projection_fusion.py --out $OUT/projection_fusion.json

For each Qwen2 shape, bf16, the tokens of one micro-batch (8 x 2048 for 0.5B and 1.5B,
4 x 2048 for 7B): forward, and forward + both backward products (input and weight
gradients, through torch.autograd.grad so nothing accumulates), of
  qkv:     the query, key and value projections (with their biases),
  gate_up: the MLP's gate and up projections,
each as separate F.linear calls and as fused_linear. Times are CUDA-event medians of 20
runs after 5 warm-up runs; inputs are random (never zeros). The fused results are
compared with the separate ones (largest difference over the largest value).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from duoka.models.qwen2.args import FLAVORS
from duoka.models.qwen2.model import fused_linear

TOKENS = {"qwen2-0.5b": 8 * 2048, "qwen2-1.5b": 8 * 2048, "qwen2-7b": 4 * 2048}


def median_ms(fn, runs: int = 20, warmup: int = 5) -> float:
    times = []
    for i in range(warmup + runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def linears(dim: int, outs: list[int], bias: bool) -> list[nn.Linear]:
    layers = []
    for out in outs:
        layer = nn.Linear(dim, out, bias=bias, device="cuda", dtype=torch.bfloat16)
        nn.init.normal_(layer.weight, std=0.02)
        if bias:
            nn.init.normal_(layer.bias, std=0.02)
        layers.append(layer)
    return layers


def measure(x: torch.Tensor, layers: list[nn.Linear]) -> dict:
    params = [p for layer in layers for p in layer.parameters()]
    grads_out = [torch.randn(x.shape[0], layer.weight.shape[0], device="cuda", dtype=x.dtype) for layer in layers]

    def separate():
        return [F.linear(x, layer.weight, layer.bias) for layer in layers]

    def fused():
        return list(fused_linear(x, *layers))

    row = {}
    values = {}
    for name, forward in (("separate", separate), ("fused", fused)):
        def step(forward=forward):
            return torch.autograd.grad(forward(), [x, *params], grads_out)
        with torch.no_grad():
            row[f"{name}_forward_ms"] = median_ms(forward)
        row[f"{name}_forward_backward_ms"] = median_ms(step)
        values[name] = [t.float() for t in forward()] + [g.float() for g in step()]
    row["max_rel_diff"] = max(float((a - b).abs().max() / b.abs().max())
                              for a, b in zip(values["fused"], values["separate"]))
    outs = sum(layer.weight.shape[0] for layer in layers)
    flop = 2 * x.shape[0] * x.shape[1] * outs
    for name in ("separate", "fused"):
        row[f"{name}_forward_tflops"] = flop / row[f"{name}_forward_ms"] / 1e9
        row[f"{name}_forward_backward_tflops"] = 3 * flop / row[f"{name}_forward_backward_ms"] / 1e9
    row["saved_ms_per_layer"] = row["separate_forward_backward_ms"] - row["fused_forward_backward_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = []
    for flavor, tokens in TOKENS.items():
        a = FLAVORS[flavor]
        d = a.resolved_head_dim
        x = torch.randn(tokens, a.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for group, outs, bias in (("qkv", [a.n_heads * d, a.n_kv_heads * d, a.n_kv_heads * d], True),
                                  ("gate_up", [a.intermediate_size, a.intermediate_size], False)):
            row = {"flavor": flavor, "group": group, "tokens": tokens, "dim": a.dim, "outs": outs,
                   "layers": a.n_layers, **measure(x, linears(a.dim, outs, bias))}
            row["saved_ms_per_step"] = row["saved_ms_per_layer"] * a.n_layers
            print(json.dumps(row), flush=True)
            results.append(row)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "results": results}, indent=1) + "\n")
    print(f"{'shape':12} {'group':8} {'sep fwd+bwd ms':>15} {'fused ms':>9} {'sep TF/s':>9} {'fused TF/s':>10} "
          f"{'saved/step ms':>13} {'rel diff':>9}")
    for r in results:
        print(f"{r['flavor']:12} {r['group']:8} {r['separate_forward_backward_ms']:15.3f} "
              f"{r['fused_forward_backward_ms']:9.3f} {r['separate_forward_backward_tflops']:9.0f} "
              f"{r['fused_forward_backward_tflops']:10.0f} {r['saved_ms_per_step']:13.2f} {r['max_rel_diff']:9.2e}")


if __name__ == "__main__":
    main()
