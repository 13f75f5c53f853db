"""int4_gemv's Triton kernel (one to four token rows against a 4-bit group-wise weight in
gemlite's packing): equal to x @ W.T over the dequantized weight for 1-4 rows, widths no tile
divides, reductions with a tail, groups of 16-128 columns, every candidate tile; the packing equal to gemlite's
documented one (its column loop, written out here). Run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1 before Triton is imported: a process of its own). On a GPU the same checks
run compiled for real, plus the kernel on gemlite's own packed tensors against gemlite's output:
`python3 tests/unit/test_int4_gemv.py --device cuda`."""

import json
import sys

import pytest
import torch

pytest.importorskip("triton")

# (rows, N outputs, K columns, group size, x dtype)
CASES = [
    (1, 40, 64, 32, "float32"),
    (2, 72, 192, 64, "float32"),  # 24 words: a tail past a 16-word block
    (3, 24, 256, 16, "float32"),  # two words a group
    (4, 64, 512, 128, "float32"),  # the default tile divides both widths: the loads without masks
    (1, 64, 512, 128, "float32"),
    (4, 56, 256, 128, "bfloat16"),
]


def _gemlite_pack(q: torch.Tensor) -> torch.Tensor:
    """gemlite.bitpack.pack_weights_over_cols_torch(q, 4, 32, transpose=True), then .contiguous()
    as gemlite's pack() makes it: column j into word j // 8 at bit 4 * (j % 8)."""
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int32)
    for j in range(q.shape[1]):
        out[:, j // 8] |= q[:, j].to(torch.int32) << (4 * (j % 8))
    return out.t().contiguous()


def _weights(n: int, k: int, group: int, g: torch.Generator):
    """q uint8 [n, k]; scales and shifts [k / group, n] in bf16, shift = -zero * scale rounded once
    (gemlite's fma mode); the dequantized weight [n, k] in float64."""
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (k // group, n), generator=g).float()
    shifts = (-zeros * scales.float()).to(torch.bfloat16)
    w = q.double() * scales.double().t().repeat_interleave(group, dim=1) \
        + shifts.double().t().repeat_interleave(group, dim=1)
    return q, scales, shifts, w


def _case_error(device: str, case: tuple, seed: int, tiles=None) -> float:
    from duoka.models.quant.int4_gemv import int4_gemv, layout_problem, pack_int4

    rows, n, k, group, dtype = case
    g = torch.Generator().manual_seed(seed)
    q, scales, shifts, w = _weights(n, k, group, g)
    x = torch.randn(rows, k, generator=g).to(getattr(torch, dtype))
    packed = pack_int4(q)
    assert torch.equal(packed, _gemlite_pack(q)) and layout_problem(packed, scales, shifts, group) is None
    y = int4_gemv(*(t.to(device) for t in (x, packed, scales, shifts)), group, tiles=tiles).cpu()
    assert y.dtype == x.dtype and y.shape == (rows, n)
    want = x.double() @ w.t()
    return ((y.double() - want).abs().max() / want.abs().max()).item()


def _gemlite_case(device: str) -> dict:
    """On a GPU with gemlite: the kernel on an A16Wn layer's own tensors (4 rows) equals gemlite's output
    and the reference (the layout read in place is the layout gemlite wrote)."""
    from gemlite.helper import A16Wn

    from duoka.models.quant.int4_gemv import int4_gemv, layout_problem

    n, k, group = 4608, 3584, 128
    g = torch.Generator().manual_seed(7)
    q, scales, shifts, w = _weights(n, k, group, g)
    zeros = (-shifts.float() / scales.float()).round()
    layer = A16Wn(device=device, dtype=torch.bfloat16).from_weights(
        q.to(device), scales.t().contiguous().to(device), zeros.t().contiguous().to(device), 4, group)
    w_q, s, z, _ = layer.get_tensor_args()
    x = torch.randn(4, k, generator=g).to(torch.bfloat16).to(device)
    ours = int4_gemv(x, w_q, s, z, group).double().cpu()
    theirs = torch.ops.gemlite.forward_functional(x, None, layer.get_tensor_args(), layer.get_meta_args(), -1)
    want = x.double().cpu() @ w.t()
    scale = want.abs().max()
    return {"layout_problem": layout_problem(w_q, s, z, group), "group_mode": layer.get_meta_args()[10],
            "vs_reference": ((ours - want).abs().max() / scale).item(),
            "gemlite_vs_reference": ((theirs.double().cpu() - want).abs().max() / scale).item()}


def _rows_refused(device: str) -> bool:
    from duoka.models.quant.int4_gemv import MAX_ROWS, int4_gemv, pack_int4

    q, scales, shifts, _ = _weights(8, 64, 32, torch.Generator().manual_seed(0))
    try:
        int4_gemv(torch.zeros(MAX_ROWS + 1, 64, device=device), pack_int4(q).to(device), scales.to(device),
                  shifts.to(device), 32)
    except ValueError as e:
        return "1 to 4 rows" in str(e)
    return False


def _run(device: str = "cpu") -> dict:
    from duoka.models.quant.int4_gemv import CANDIDATES

    result = {"errors": [_case_error(device, case, i) for i, case in enumerate(CASES)],
              "tile_errors": [_case_error(device, CASES[2], 9, tiles) for tiles in CANDIDATES],
              "rows_refused": _rows_refused(device)}
    if device == "cuda":
        result["gemlite"] = _gemlite_case(device)
    return result


@pytest.fixture(scope="module")
def result(triton_interpreted):
    return triton_interpreted(__file__)


def test_the_kernel_equals_the_dequantized_product(result):
    for case, error in zip(CASES, result["errors"]):
        # fp32 rows: the sums' rounding; bf16 rows: the output's rounding to bf16.
        assert error <= (8e-3 if case[-1] == "bfloat16" else 1e-5), (case, error)


def test_more_rows_than_a_launch_takes_are_refused(result):
    assert result["rows_refused"]


def test_every_candidate_tile_computes_the_same(result):
    from duoka.models.quant.int4_gemv import CANDIDATES

    assert len(result["tile_errors"]) == len(CANDIDATES) and max(result["tile_errors"]) <= 1e-5, result["tile_errors"]


if __name__ == "__main__":
    print(json.dumps(_run(sys.argv[2] if sys.argv[1:2] == ["--device"] else "cpu")))
