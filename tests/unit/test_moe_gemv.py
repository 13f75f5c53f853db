"""moe_gemv's Triton kernels (one token's routed experts as GEMVs: batch-1 decode of a
Qwen2-MoE) equal the experts computed one by one: widths that are not multiples of the
kernel's tiles (a tensor-parallel shard's), top-k of 1 to 8, a few tokens; and a MoE layer on
one token without autograd takes them (a compiled block too, where the op is opaque) with the
output and routing counts of the grouped path. Run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1 before Triton is imported: a process of its own). On a GPU the same
checks run compiled for real: `python3 tests/unit/test_moe_gemv.py --device cuda`."""

import json
import sys

import pytest
import torch

pytest.importorskip("triton")

# (experts, top-k, tokens, dim, hidden, dtype)
CASES = [
    (6, 2, 1, 48, 40, "float32"),
    (8, 4, 1, 64, 24, "float32"),
    (4, 1, 3, 40, 56, "float32"),
    (9, 8, 2, 32, 300, "float32"),  # hidden past one 256-wide reduction tile
    (6, 4, 1, 48, 40, "bfloat16"),
]


def _reference(x, experts, weights, w1, w3, w2):
    """Token by token, expert by expert, in fp32."""
    x, w1, w3, w2 = (t.float() for t in (x, w1, w3, w2))
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for j, e in enumerate(experts[t].tolist()):
            h = torch.nn.functional.silu(w1[e] @ x[t]) * (w3[e] @ x[t])
            out[t] += float(weights[t, j]) * (w2[e] @ h)
    return out


def _case_error(device: str, case: tuple, seed: int, tiles=None) -> float:
    from duoka.models.moe_gemv import expert_gemv

    n_experts, k, tokens, dim, hidden, dtype = case
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    x = torch.randn(tokens, dim, generator=g).to(dt)
    w1, w3 = (torch.randn(n_experts, hidden, dim, generator=g).div(dim ** 0.5).to(dt) for _ in range(2))
    w2 = torch.randn(n_experts, dim, hidden, generator=g).div(hidden ** 0.5).to(dt)
    experts = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g).to(dt)
    got = expert_gemv(*(t.to(device) for t in (x, experts, weights, w1, w3, w2)), tiles=tiles).cpu()
    assert got.dtype == dt and got.shape == (tokens, dim)
    want = _reference(x, experts, weights, w1, w3, w2)
    return ((got.float() - want).abs().max() / want.abs().max()).item()


# Every tile the GPU's autotuner may pick, on widths that are a multiple of none of them and a
# reduction longer than the 128-wide tile.
TILE_CASE = (5, 2, 2, 136, 72, "float32")


def _kernel_cases(device: str) -> list[float]:
    return [_case_error(device, case, i) for i, case in enumerate(CASES)]


def _tile_cases(device: str) -> list[float]:
    from duoka.models.moe_gemv import CANDIDATES

    return [_case_error(device, TILE_CASE, 0, tiles) for tiles in CANDIDATES]


def _layer(device: str) -> dict:
    """A MoE layer on one token: inference takes the kernels (counted), training the grouped
    path; eager and compiled (aot_eager, whole graph) alike."""
    from duoka.models import moe_gemv
    from duoka.models.qwen2.args import ModelOptions
    from duoka.models.qwen2.model import FeedForward
    from duoka.models.qwen2.moe import MoE

    calls = []
    kernel = moe_gemv.expert_gemv
    moe_gemv.expert_gemv = lambda *a, **kw: calls.append(1) or kernel(*a, **kw)
    torch.manual_seed(0)
    layer = MoE(48, 6, 2, 40, True, FeedForward(48, 80, ModelOptions()))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer.to(device)
    x = torch.randn(1, 48, device=device)
    want, want_stats = layer(x)  # autograd on: the grouped path
    assert not calls
    with torch.no_grad():
        got, stats = layer(x)
        eager_calls = len(calls)
        # fullgraph, as serving compiles its blocks: the path's test and the op leave no graph break
        compiled_out, _ = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)(x)
    with torch.inference_mode():  # as serving runs it: no statistics asked, none made, in one graph
        served, served_stats = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)(x, False)
    with torch.no_grad():
        # In bf16 (grouped_mm compiles there) one token, then three in the same compiled code.
        half = layer.to(torch.bfloat16)
        both = torch.compile(half, backend="aot_eager", fullgraph=True, dynamic=True)
        three = torch.randn(3, 48, device=device, dtype=torch.bfloat16)
        bf16_errors = [(both(t)[0] - half(t)[0]).abs().max().item() for t in (x.to(torch.bfloat16), three)]
    return {"eager_calls": eager_calls, "compiled_calls": len(calls) - eager_calls,
            "error": (got - want).abs().max().item(), "compiled_error": (compiled_out - want).abs().max().item(),
            "counts_equal": torch.equal(stats.expert_counts, want_stats.expert_counts), "bf16_errors": bf16_errors,
            "served_error": (served - want).abs().max().item(), "served_stats": served_stats is not None}


def _run(device: str = "cpu") -> dict:
    return {"errors": _kernel_cases(device), "tile_errors": _tile_cases(device), "layer": _layer(device)}


@pytest.fixture(scope="module")
def result(triton_interpreted):
    return triton_interpreted(__file__)


def test_the_kernels_equal_the_experts_one_by_one(result):
    for case, error in zip(CASES, result["errors"]):
        assert error <= (2e-2 if case[-1] == "bfloat16" else 1e-5), (case, error)


def test_every_candidate_tile_computes_the_same(result):
    assert len(result["tile_errors"]) >= 2 and max(result["tile_errors"]) <= 1e-5, result["tile_errors"]


def test_a_layer_on_one_token_takes_them_without_autograd(result):
    layer = result["layer"]
    # Once in each one-token call (eager, compiled fp32 with and without statistics, compiled and
    # eager bf16), never for three tokens.
    assert layer["eager_calls"] == 1 and layer["compiled_calls"] == 4, layer
    assert layer["served_error"] <= 1e-5 and not layer["served_stats"], layer
    assert layer["error"] <= 1e-5 and layer["compiled_error"] <= 1e-5, layer
    assert layer["counts_equal"], layer
    assert max(layer["bf16_errors"]) <= 1e-6, layer  # compiled as eager, the same kernels


if __name__ == "__main__":
    print(json.dumps(_run(sys.argv[2] if sys.argv[1:2] == ["--device"] else "cpu")))
