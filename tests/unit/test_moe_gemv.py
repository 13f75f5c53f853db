"""moe_gemv's Triton kernels (one token's MoE layer as GEMVs: batch-1 decode of a Qwen2-MoE).
The experts equal the experts computed one by one: widths that are not multiples of the
kernel's tiles (a tensor-parallel shard's), top-k of 1 to 8, a few tokens. The routing equals
moe.route (the same experts in the same order, their weights) and the gate logit F.linear,
for every candidate tile. A MoE layer on one token without autograd takes the experts' kernels
(a compiled block too, where the op is opaque) with the output and routing counts of the
grouped path, and where no statistics are asked (serving) the routing's kernels too. Run by Triton's interpreter on the CPU
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


def _shared_reference(x, s1, s3, s2, gate_logit):
    x, s1, s3, s2 = (t.float() for t in (x, s1, s3, s2))
    h = torch.nn.functional.silu(x @ s1.T) * (x @ s3.T)
    return torch.sigmoid(gate_logit.float()) * (h @ s2.T)


def _case_error(device: str, case: tuple, seed: int, tiles=None, shared_hidden: int = 0, packed: bool = False) -> float:
    """The kernels' rows summed against the reference; with a shared expert of shared_hidden
    (its gate and up as views of one packed weight when `packed`, as FeedForward packs them)."""
    from duoka.models.moe_gemv import SharedExpert, expert_gemv

    n_experts, k, tokens, dim, hidden, dtype = case
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    x = torch.randn(tokens, dim, generator=g).to(dt)
    w1, w3 = (torch.randn(n_experts, hidden, dim, generator=g).div(dim ** 0.5).to(dt) for _ in range(2))
    w2 = torch.randn(n_experts, dim, hidden, generator=g).div(hidden ** 0.5).to(dt)
    experts = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g).to(dt)
    shared, want_shared = None, 0.0
    if shared_hidden:
        w13 = torch.randn(2 * shared_hidden, dim, generator=g).div(dim ** 0.5).to(dt)
        s1, s3 = w13.to(device).chunk(2) if packed else (w13[:shared_hidden].clone().to(device),
                                                           w13[shared_hidden:].clone().to(device))
        s2 = torch.randn(dim, shared_hidden, generator=g).div(shared_hidden ** 0.5).to(dt)
        gate_logit = torch.randn(tokens, 1, generator=g).to(dt)
        shared = SharedExpert(s1, s3, s2.to(device), gate_logit.to(device))
        want_shared = _shared_reference(x, *w13.chunk(2), s2, gate_logit)
    rows = expert_gemv(*(t.to(device) for t in (x, experts, weights, w1, w3, w2)), shared=shared, tiles=tiles).cpu()
    assert rows.dtype == torch.float32 and rows.shape == (tokens, k + bool(shared_hidden), dim)
    got = rows.sum(dim=1)
    want = _reference(x, experts, weights, w1, w3, w2) + want_shared
    return ((got.float() - want).abs().max() / want.abs().max()).item()


# (case, the shared expert's width, packed): widths no tile divides, a packed pair of views.
SHARED_CASES = [
    ((6, 2, 1, 48, 40, "float32"), 56, True),
    ((8, 4, 2, 64, 24, "float32"), 300, False),
    ((6, 4, 1, 48, 40, "bfloat16"), 88, True),
]


# Every tile the GPU's autotuner may pick, on widths that are a multiple of none of them and a
# reduction longer than the 128-wide tile.
TILE_CASE = (5, 2, 2, 136, 72, "float32")


def _kernel_cases(device: str) -> list[float]:
    return [_case_error(device, case, i) for i, case in enumerate(CASES)]


def _shared_cases(device: str) -> list[float]:
    return [_case_error(device, case, i, None, width, packed) for i, (case, width, packed) in enumerate(SHARED_CASES)]


def _tile_cases(device: str) -> list[float]:
    from duoka.models.moe_gemv import CANDIDATES

    return [_case_error(device, TILE_CASE, 0, tiles, shared_hidden=100, packed=True) for tiles in CANDIDATES]


# (experts, top-k, dim, norm_topk_prob, dtype): the A2.7B's 60 of 4 unnormalised and the 57B's
# 64 of 8 normalised among them; a reduction past one 256 block; bf16 (the interpreter rounds
# fp32 to bf16 toward zero, so a logit may lie an ulp from F.linear's: the GPU run rounds to nearest).
ROUTE_CASES = [
    (6, 2, 48, True, "float32"),
    (60, 4, 300, False, "float32"),
    (64, 8, 72, True, "float32"),
    (5, 1, 40, False, "float32"),
    (60, 4, 64, True, "bfloat16"),
]


def _route_cases(device: str) -> list[dict]:
    from duoka.models.moe_gemv import ROUTER_CANDIDATES, route_one_token
    from duoka.models.qwen2.moe import route

    results = []
    for i, (n_experts, k, dim, norm, dtype) in enumerate(ROUTE_CASES):
        g = torch.Generator().manual_seed(i)
        dt = getattr(torch, dtype)
        # A trained router's logits are a few units wide: weights ~ 1/sqrt(dim), x ~ 1.
        x = torch.randn(1, dim, generator=g).to(dt)
        router, gate = (torch.randn(rows, dim, generator=g).div(dim ** 0.5).to(dt) for rows in (n_experts, 1))
        want = route(x, router, k, norm)
        want_gate = torch.nn.functional.linear(x, gate)
        for tile in ROUTER_CANDIDATES:
            weights, experts, gate_logit = (t.cpu() for t in route_one_token(
                x.to(device), router.to(device), gate.to(device), k, norm, tile))
            results.append({"case": i, "tile": tile, "experts_equal": torch.equal(experts, want.experts),
                            "dtypes": [str(weights.dtype), str(experts.dtype), str(gate_logit.dtype)],
                            "weights_error": (weights.float() - want.weights.float()).abs().max().item(),
                            "gate_error": (gate_logit.float() - want_gate.float()).abs().max().item()})
    return results


def _layer(device: str) -> dict:
    """A MoE layer on one token: inference takes the kernels (counted), training the grouped
    path; eager and compiled (aot_eager, whole graph) alike."""
    from duoka.models import moe_gemv
    from duoka.models.qwen2.args import ModelOptions
    from duoka.models.qwen2.model import FeedForward
    from duoka.models.qwen2.moe import MoE

    calls, routes = [], []
    kernel, router = moe_gemv.expert_gemv, moe_gemv.route_one_token
    moe_gemv.expert_gemv = lambda *a, **kw: calls.append(kw.get("shared") is not None) or kernel(*a, **kw)
    moe_gemv.route_one_token = lambda *a, **kw: routes.append(1) or router(*a, **kw)
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
    with torch.inference_mode():  # bf16 served: the routing's kernels against torch's routing
        served_bf16 = torch.compile(half, backend="aot_eager", fullgraph=True, dynamic=True)(x.to(torch.bfloat16), False)
        bf16_routed = half(x.to(torch.bfloat16))[0]
    return {"eager_calls": eager_calls, "compiled_calls": len(calls) - eager_calls, "route_calls": len(routes),
            "shared_calls": sum(calls),
            "served_bf16_error": ((served_bf16[0].float() - bf16_routed.float()).abs().max()
                                  / bf16_routed.float().abs().max()).item(),  # relative: an ulp of bf16 is 2^-8
            "error": (got - want).abs().max().item(), "compiled_error": (compiled_out - want).abs().max().item(),
            "counts_equal": torch.equal(stats.expert_counts, want_stats.expert_counts), "bf16_errors": bf16_errors,
            "served_error": (served - want).abs().max().item(), "served_stats": served_stats is not None}


def _packed_layer(device: str) -> dict:
    """Served (no statistics) with packed projections, as serving packs gate and up, against the
    grouped path; then with the shared expert's down projection a Linear subclass (an adapter's
    or a quantized module's place), which its plain_weights refuses and its own forward computes."""
    from duoka.models.qwen2.args import ModelOptions
    from duoka.models.qwen2.model import FeedForward
    from duoka.models.qwen2.moe import MoE

    class Wrapped(torch.nn.Linear):
        pass

    torch.manual_seed(1)
    layer = MoE(48, 6, 2, 40, False, FeedForward(48, 80, ModelOptions(packed_projections=True)))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer.to(device)
    x = torch.randn(1, 48, device=device)
    want, _ = layer(x)
    with torch.inference_mode():
        served, _ = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)(x, False)
    wrapped = Wrapped(80, 48, bias=False, device=device)
    wrapped.weight = layer.shared_expert.w2.weight
    layer.shared_expert.w2 = wrapped
    with torch.inference_mode():
        fallback, _ = layer(x, False)
    return {"served_error": (served - want).abs().max().item(), "fallback_error": (fallback - want).abs().max().item(),
            "wrapped_refused": layer.shared_expert.plain_weights() is None}


def _run(device: str = "cpu") -> dict:
    return {"errors": _kernel_cases(device), "shared_errors": _shared_cases(device), "tile_errors": _tile_cases(device),
            "routes": _route_cases(device), "packed_layer": _packed_layer(device),
            "layer": _layer(device)}


@pytest.fixture(scope="module")
def result(triton_interpreted):
    return triton_interpreted(__file__)


def test_the_kernels_equal_the_experts_one_by_one(result):
    for case, error in zip(CASES, result["errors"]):
        assert error <= (2e-2 if case[-1] == "bfloat16" else 1e-5), (case, error)


def test_the_shared_expert_rides_in_the_same_kernels(result):
    assert len(result["shared_errors"]) == len(SHARED_CASES), result["shared_errors"]
    for (case, _, _), error in zip(SHARED_CASES, result["shared_errors"]):
        assert error <= (2e-2 if case[-1] == "bfloat16" else 1e-5), (case, error)


def test_every_candidate_tile_computes_the_same(result):
    assert len(result["tile_errors"]) >= 2 and max(result["tile_errors"]) <= 1e-5, result["tile_errors"]


def test_the_routing_kernels_route_as_torch(result):
    from duoka.models.moe_gemv import ROUTER_CANDIDATES

    routes = result["routes"]
    assert len(ROUTER_CANDIDATES) >= 2 and len(routes) == len(ROUTE_CASES) * len(ROUTER_CANDIDATES), len(routes)
    for r in routes:
        bf16 = ROUTE_CASES[r["case"]][-1] == "bfloat16"
        assert r["experts_equal"], r
        assert r["dtypes"] == [f"torch.{ROUTE_CASES[r['case']][-1]}", "torch.int64", f"torch.{ROUTE_CASES[r['case']][-1]}"], r
        assert r["weights_error"] <= (2e-2 if bf16 else 1e-6) and r["gate_error"] <= (2e-2 if bf16 else 1e-6), r


def test_a_layer_on_one_token_takes_them_without_autograd(result):
    layer = result["layer"]
    # The experts' kernels once in each one-token call (eager, compiled fp32 with and without
    # statistics, compiled and eager bf16, compiled bf16 served and its eager reference), never
    # for three tokens; the routing's only where no statistics are asked (the two served calls).
    assert layer["eager_calls"] == 1 and layer["compiled_calls"] == 6 and layer["route_calls"] == 2, layer
    assert layer["shared_calls"] == 2, layer  # the shared expert in the kernels where served
    assert layer["served_error"] <= 1e-5 and not layer["served_stats"], layer
    assert layer["served_bf16_error"] <= 2e-2, layer
    assert layer["error"] <= 1e-5 and layer["compiled_error"] <= 1e-5, layer
    assert layer["counts_equal"], layer
    assert max(layer["bf16_errors"]) <= 1e-6, layer  # compiled as eager, the same kernels


def test_a_packed_shared_expert_is_served_in_the_kernels_and_a_wrapped_one_is_not(result):
    packed = result["packed_layer"]
    assert packed["served_error"] <= 1e-5 and packed["fallback_error"] <= 1e-5, packed
    assert packed["wrapped_refused"], packed


if __name__ == "__main__":
    print(json.dumps(_run(sys.argv[2] if sys.argv[1:2] == ["--device"] else "cpu")))
