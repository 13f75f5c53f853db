"""Quantized matmul kernels on the 7B projections, one at a time, each replayed from a CUDA graph
(issue 39): bf16 cuBLAS, FP8 torch._scaled_mm with per-token activation scales, FP8 weight-only
(gemlite A16W8), int4 tinygemm and int4 gemlite (A16W4, group 128), for 1 to 64 token rows, and
duoka's int4 GEMV for 1-4 rows (int4_gemv.py) on the gemlite layer's tensors. Reports
microseconds per call, the weight-read rate and the error against x @ dequantized.T; also checks
that the gemlite layer traces under torch.compile(fullgraph) and replays inside a captured
graph.

    PYTHONPATH=$PWD python3 bench/quant_kernels.py --out $OUT/quant_kernels.json

Needs CUDA and the gemlite wheel (.wheels carried as for serve_openai_mix.py).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from duoka.models.quant.fp8 import Fp8Linear, row_scales, to_e4m3
from duoka.models.quant.gemlite_group import GemliteGroupLinear
from duoka.models.quant.groupwise import GroupInts
from duoka.models.quant.int4_gemv import chosen_tiles, int4_gemv
from duoka.models.quant.tinygemm import TinyGemmInt4Linear

SHAPES_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944),
             "head": (152064, 3584)}
GROUP = 128


def graph_us(fn, x, iters: int = 50) -> float:
    """Microseconds per call of fn(x), replayed from one graph of `iters` calls."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * iters)


def int4_parts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit groups: q [out, in] uint8, scales and zeros [out, groups]."""
    out, inp = w.shape
    g = w.float().reshape(out, inp // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = (-lo / scale).round().clamp(0, 15)
    q = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(out, inp)
    return q, scale.to(torch.bfloat16), zero


def build(name: str, shape: tuple[int, int], device: torch.device) -> dict:
    from gemlite.core import GEMLITE_MATMUL_TYPES_MAPPING
    from gemlite.helper import A16W8_FP8, A16Wn

    out, inp = shape
    w = torch.randn(out, inp, device=device, dtype=torch.bfloat16) * 0.02
    scale = row_scales(w.abs().amax(dim=1))
    q8 = to_e4m3(w, scale)
    fp8 = Fp8Linear(q8, scale, None, torch.bfloat16)
    w8 = (q8.float() * scale[:, None]).to(torch.bfloat16)
    gl8 = A16W8_FP8(device=device, dtype=torch.bfloat16).from_weights(q8, None, scale[:, None])
    q4, s4, z4 = int4_parts(w)
    w4 = ((q4.float().reshape(out, -1, GROUP) - z4[..., None]) * s4.float()[..., None]).reshape(out, inp)
    ints = GroupInts(q=q4, zeros=z4.t().to(torch.uint8), scales=s4.t(), group_size=GROUP,
                     g_idx=torch.arange(inp, device=device) // GROUP)
    tiny = TinyGemmInt4Linear(ints)
    gl4 = A16Wn(device=device, dtype=torch.bfloat16).from_weights(q4, s4, z4.to(torch.bfloat16), 4, GROUP)
    ours = GemliteGroupLinear(ints, 4, torch.bfloat16)  # gemlite with duoka's kernel choice by rows
    forced = {f"int4_gemlite_{name}": (forced_kernel(ours, index), w4.to(torch.bfloat16))
              for name, index in GEMLITE_MATMUL_TYPES_MAPPING.items()}
    w_q, s, z, _ = gl4.get_tensor_args()  # int4_gemv reads the gemlite layer's tensors in place
    return forced | {"bf16": (lambda x: F.linear(x, w), w), "fp8_scaled_mm": (fp8, w8), "fp8_gemlite": (gl8, w8),
            "int4_tinygemm": (tiny, w4.to(torch.bfloat16)), "int4_gemlite": (gl4, w4.to(torch.bfloat16)),
            "int4_duoka": (ours, w4.to(torch.bfloat16)),
            "int4_gemv": (lambda x: int4_gemv(x, w_q, s, z, GROUP), w4.to(torch.bfloat16))}  # 1-4 rows


def forced_kernel(layer: GemliteGroupLinear, index: int):
    """The layer's weight through one of gemlite's kernels, whatever the rows."""
    return lambda x: torch.ops.gemlite.forward_functional(x, None, layer.tensor_args(), layer.meta_args, index)


def weight_bytes(kind: str, shape: tuple[int, int]) -> int:
    out, inp = shape
    per = {"bf16": 2.0, "fp8_scaled_mm": 1.0, "fp8_gemlite": 1.0}.get(kind, 0.5 + 4 / GROUP)
    return int(out * inp * per)


def compile_check(layer, x: torch.Tensor, ref: torch.Tensor) -> dict:
    compiled = torch.compile(lambda t: layer(t) * 1.0, fullgraph=True, dynamic=True)
    y = compiled(x)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    compiled(static_x)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_y = compiled(static_x)
    static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    return {"compiled_rel_err": float((y.float() - ref).norm() / ref.norm()),
            "graph_equals_compiled": bool(torch.equal(static_y, y))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--shapes", default=",".join(SHAPES_7B), help="projections to time")
    parser.add_argument("--kinds", default=None, help="kernels to time (default: all)")
    parser.add_argument("--no-compile-check", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    try:
        import gemlite
        import triton
        results["gemlite"], results["triton"] = gemlite.__version__, triton.__version__
    except ImportError as exc:  # recorded: the point of the run is to find out
        results["gemlite"] = f"unavailable: {exc!r}"
    for name in args.shapes.split(","):
        shape = SHAPES_7B[name]
        layers = build(name, shape, device)
        if args.kinds:
            layers = {k: v for k, v in layers.items() if k in args.kinds.split(",")}
        rows_out: dict = {}
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, shape[1], device=device, dtype=torch.bfloat16)
            row: dict = {}
            for kind, (fn, w_ref) in layers.items():
                ref = x.float() @ w_ref.float().t()
                try:
                    y = fn(x).float()
                    us = graph_us(fn, x)
                except Exception as exc:  # noqa: BLE001 - a forced kernel may refuse a row count: recorded
                    row[kind] = {"us": float("nan"), "error": repr(exc)[:200]}
                    continue
                row[kind] = {"us": round(us, 2), "tb_s": round(weight_bytes(kind, shape) / us / 1e6, 2),
                             "rel_err": float((y - ref).norm() / ref.norm())}
                if kind == "int4_gemv":
                    row[kind]["tiles"] = str(chosen_tiles())
            rows_out[rows] = row
            print(name, rows, {k: v["us"] for k, v in row.items()}, flush=True)
        x1 = torch.randn(1, shape[1], device=device, dtype=torch.bfloat16)
        for kind in () if args.no_compile_check else ("fp8_gemlite", "int4_gemlite", "int4_duoka"):
            if kind not in layers:
                continue
            fn, w_ref = layers[kind]
            try:
                rows_out[f"compile_{kind}"] = compile_check(fn, x1, x1.float() @ w_ref.float().t())
            except Exception as exc:  # noqa: BLE001 - recorded: whether it traces is what is measured
                rows_out[f"compile_{kind}"] = {"error": repr(exc)[:400]}
        results["shapes"][name] = rows_out
        del layers
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:  # after each shape: a run cut short keeps what it measured
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
