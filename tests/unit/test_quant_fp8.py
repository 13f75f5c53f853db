"""FP8 serving layers (duoka/models/quant/fp8.py): the load-time quantizer's error bound, shards
and packing; the reference forward against a formula written here; the _scaled_mm path (its
CPU kernel, and its arguments under CUDA's shape/stride checks with fake CUDA tensors);
compressed-tensors checkpoints written by the compressed-tensors package itself; the
quantization_config parser and its refusals. The real GPU comparison is the CUDA-only test."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from duoka.errors import DuokaError
from duoka.models.quant.base import Part, QuantScheme
from duoka.models.quant.fp8 import (
    Fp8Linear,
    parse_compressed_tensors,
    quantize_fp8,
    read_compressed_fp8,
    run_scaled_mm,
    scaled_mm_args,
)
from duoka.models.quant.small_batch import SMALL_BATCH_ROWS

CPU = torch.device("cpu")
FP8 = QuantScheme("fp8")
CT_CHANNEL = QuantScheme("compressed-tensors")
CT_TENSOR = QuantScheme("compressed-tensors", weight_per_tensor=True)
E4M3 = torch.float8_e4m3fn


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes (10^-3 .. 10^3), as per-row scales must handle."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(rows, 1, generator=g) * 6 - 3)
    return torch.randn(rows, cols, generator=g) * magnitude


def _dequantized(layer: Fp8Linear) -> torch.Tensor:
    n, k = layer.out_features, layer.in_features
    return layer.weight[:n, :k].float() * layer.weight_scale[:n, None]


def _per_token_reference(x: torch.Tensor) -> torch.Tensor:
    """Activations as the layer must see them, written out: per row s = max(amax / 448,
    1 / (448 * 512)), x / s clamped to +-448, rounded to e4m3, times s."""
    s = torch.clamp(x.float().abs().amax(dim=-1, keepdim=True) / 448.0, min=1.0 / (448.0 * 512.0))
    return (x.float() / s).clamp(-448.0, 448.0).to(E4M3).float() * s


# ---- quantize_fp8 (a bf16/fp32 checkpoint quantized at load)

def test_quantize_fp8_is_within_e4m3_rounding_of_each_row_and_zero_rows_stay_zero():
    w = _weight(40, 72)
    w[3] = 0.0  # a row of zeros: scale 1, not 0 (no 0/0)
    w[5, 7] = -w[5].abs().max() * 2  # the row's amax, negative: maps to -448 exactly
    layer = quantize_fp8({"m.weight": w}.__getitem__, [Part("m")], FP8, False, CPU, torch.float32)
    assert layer.weight.dtype == E4M3 and layer.weight_scale.dtype == torch.float32
    scale = layer.weight_scale[:40]
    assert torch.equal(scale, torch.where(w.abs().amax(1) > 0, w.abs().amax(1) / 448, torch.ones(40)))
    dq = layer.dequantize()
    # e4m3 keeps 3 mantissa bits: round to nearest is within 2^-4 relative for normal values;
    # below 2^-6 (subnormal, spacing 2^-9) within 2^-10 absolute, in units of the row's scale.
    bound = 2.0**-4 * w.abs() + 2.0**-10 * scale[:, None]
    assert bool(((dq - w).abs() <= bound * (1 + 1e-6)).all())
    assert not dq.isnan().any() and bool((dq[3] == 0).all())
    assert dq[5, 7] == pytest.approx(w[5, 7].item(), rel=1e-6)  # amax is e4m3's 448: exact
    assert layer.weight.shape == (48, 80)  # 40 and 72 are not multiples of 16: stored padded
    assert layer.weight_bytes() == 48 * 80 + 48 * 4


def test_quantize_fp8_shards_and_packing_are_slices_of_the_whole():
    t = {"q.weight": _weight(48, 32, 1), "k.weight": _weight(16, 32, 2), "v.weight": _weight(16, 32, 3),
         "o.weight": _weight(32, 48, 4), "q.bias": torch.randn(48), "k.bias": torch.randn(16),
         "v.bias": torch.randn(16)}
    source = t.__getitem__

    def read(parts, bias=False, dtype=torch.bfloat16):
        return quantize_fp8(source, parts, FP8, bias, CPU, dtype)

    whole = {m: read([Part(m)], bias=(m != "o")) for m in "qkvo"}
    packed = read([Part("q"), Part("k"), Part("v")], bias=True)
    assert torch.equal(packed.weight.view(torch.uint8),
                       torch.cat([whole[m].weight.view(torch.uint8) for m in "qkv"]))
    assert torch.equal(packed.weight_scale, torch.cat([whole[m].weight_scale for m in "qkv"]))
    assert torch.equal(packed.bias, torch.cat([t[f"{m}.bias"] for m in "qkv"]).bfloat16())
    # Rows (q/k/v, gate/up under tp): a shard is the rows of the whole.
    rows = read([Part("q", (0, 16, 32)), Part("k", (0, 0, 16))], bias=True)
    assert torch.equal(rows.dequantize(), torch.cat([whole["q"].dequantize()[16:32], whole["k"].dequantize()]))
    assert torch.equal(rows.bias, torch.cat([t["q.bias"][16:32], t["k.bias"]]).bfloat16())
    # Columns (o/down under tp): scales come from whole rows, so every rank holds its exact slice.
    for start in (0, 16, 32):
        cols = read([Part("o", (1, start, start + 16))])
        assert torch.equal(cols.dequantize(), whole["o"].dequantize()[:, start:start + 16])


def test_quantize_fp8_refuses_what_it_cannot_quantize():
    w = _weight(16, 16)
    with pytest.raises(DuokaError, match="not a bf16/fp16/fp32 matrix") as e:
        quantize_fp8({"m.weight": w.to(E4M3)}.__getitem__, [Part("m")], FP8, False, CPU, torch.bfloat16)
    assert "without the flag" in e.value.fix
    w[2, 3] = float("inf")
    with pytest.raises(DuokaError, match="inf or NaN"):
        quantize_fp8({"m.weight": w}.__getitem__, [Part("m")], FP8, False, CPU, torch.bfloat16)


# ---- forward

def _layer(n: int, k: int, bias: bool = True, dtype=torch.float32, seed: int = 0, input_scale=None) -> Fp8Linear:
    t = {"m.weight": _weight(n, k, seed) / 100, "m.bias": torch.randn(n)}
    layer = quantize_fp8(t.__getitem__, [Part("m")], FP8, bias, CPU, dtype)
    if input_scale is not None:
        layer = Fp8Linear(layer.weight[:n, :k], layer.weight_scale[:n], layer.bias, dtype, torch.tensor(input_scale))
    return layer


def test_reference_forward_is_the_formula_and_near_the_unquantized_matmul():
    layer = _layer(40, 72)
    x = torch.randn(2, 3, 72) * torch.logspace(-2, 2, 6).reshape(2, 3, 1)  # tokens of very different sizes
    x[1, 2] = 0.0  # a token of zeros: floor scale, zeros out
    y = layer(x)
    assert y.shape == (2, 3, 40) and y.dtype == torch.float32 and not layer.uses_scaled_mm
    w = _dequantized(layer)
    torch.testing.assert_close(y, _per_token_reference(x) @ w.T + layer.bias, rtol=1e-6, atol=1e-6)
    assert torch.allclose(y[1, 2], layer.bias)
    # Against x @ W.T unquantized: each product carries at most (1 + 2^-4)^2 - 1 < 0.13 relative
    # error (plus subnormal terms far smaller here), so the sum is within 0.13 of sum |x||w|.
    t = {"m.weight": _weight(40, 72) / 100}
    exact = x @ t["m.weight"].T + layer.bias
    assert bool(((y - exact).abs() <= 0.13 * (x.abs() @ t["m.weight"].abs().T) + 1e-5).all())


def test_static_input_scale_quantizes_every_token_with_it():
    layer = _layer(32, 48, input_scale=0.02)
    x = torch.randn(5, 48)
    x[0, 0] = 100.0  # beyond 448 * 0.02: saturates at 8.96
    q = (x / 0.02).clamp(-448, 448).to(E4M3).float() * 0.02
    torch.testing.assert_close(layer(x), q @ _dequantized(layer).T + layer.bias, rtol=1e-6, atol=1e-6)
    assert layer.weight_bytes() == 32 * 48 + 32 * 4 + 4


@pytest.mark.parametrize("n,k", [(48, 32), (40, 24), (16, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("static", [False, True])
def test_scaled_mm_path_equals_the_reference_on_cpu(n, k, dtype, static):
    """forward_scaled_mm is the GPU path's code (padding, operands, torch._scaled_mm with
    rowwise scales and bias); torch's CPU kernel runs it, so only the CUDA kernel is untested here."""
    layer = _layer(n, k, dtype=dtype, input_scale=0.01 if static else None)
    x = torch.randn(3, 5, k, dtype=dtype)
    fast, ref = layer.forward_scaled_mm(x), layer.forward_reference(x)
    assert fast.shape == ref.shape == (3, 5, n) and fast.dtype == ref.dtype == dtype
    # The same fp32 sum in another order, rounded once to 16 bits: at most an ulp apart.
    torch.testing.assert_close(fast, ref, rtol=2**-7 if dtype == torch.bfloat16 else 2**-10, atol=1e-3)


@pytest.mark.parametrize("tokens", [1, 5, 17])
@pytest.mark.parametrize("n,k", [(48, 32), (40, 24)])
def test_scaled_mm_arguments_pass_the_cuda_checks(tokens, n, k):
    """Fake CUDA tensors (no GPU needed) go through torch's own _scaled_mm checks for CUDA:
    mat1 row-major, mat2 column-major, K and N multiples of 16, rowwise scales [T, 1] and
    [1, N] fp32 contiguous, bias in the output dtype. The token count needs no padding."""
    with FakeTensorMode():
        dev = torch.device("cuda")
        weight = torch.empty(n, k, dtype=E4M3, device=dev)
        layer = Fp8Linear(weight, torch.empty(n, device=dev), torch.empty(n, device=dev), torch.bfloat16)
        x = torch.empty(tokens, k, dtype=torch.bfloat16, device=dev)
        args = scaled_mm_args(x, layer.weight, layer.weight_scale, layer.bias)
        n_pad, k_pad = -(-n // 16) * 16, -(-k // 16) * 16
        assert args.a.shape == (tokens, k_pad) and args.a.stride() == (k_pad, 1) and args.a.dtype == E4M3
        assert args.b.shape == (k_pad, n_pad) and args.b.stride() == (1, k_pad) and args.b.dtype == E4M3
        assert args.scale_a.shape == (tokens, 1) and args.scale_a.is_contiguous()
        assert args.scale_b.shape == (1, n_pad) and args.scale_b.is_contiguous()
        assert args.scale_a.dtype == args.scale_b.dtype == torch.float32
        assert args.bias.shape == (n_pad,) and args.bias.dtype == args.out_dtype == torch.bfloat16
        y = run_scaled_mm(args)  # torch._scaled_mm's checks for CUDA run here
        assert y.shape == (tokens, n_pad) and y.dtype == torch.bfloat16
        # (forward_scaled_mm then cuts the padded columns: a CPU-only torch cannot slice fake
        # CUDA tensors, so that step is checked by the CPU test with n = 40.)


def test_scaled_mm_path_compiles_whole():
    """Dynamo traces it without a break and Inductor lowers aten._scaled_mm (on CPU here; the
    CUDA test compiles it on a GPU)."""
    layer = _layer(40, 24, dtype=torch.bfloat16)
    x = torch.randn(4, 24, dtype=torch.bfloat16)
    compiled = torch.compile(layer.forward_scaled_mm, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer.forward_scaled_mm(x), rtol=2**-7, atol=1e-3)


_NEEDS_FP8_GPU = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                    reason="FP8 matmuls need a CUDA GPU of compute capability 8.9+")


def _one_step(dtype: torch.dtype) -> dict:
    """One rounding step of the output dtype at the output's magnitude (2 eps relative; absolute
    for outputs near 0): a kernel's fp32 accumulation order and bias add differ from the
    reference's, so some elements land one step apart (an H100: 12 of 5,376 in bf16)."""
    eps = torch.finfo(dtype).eps
    return {"rtol": 2 * eps, "atol": 2 * eps}


def _assert_within_steps(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype,
                         steps: int = 2) -> None:
    """|got - want| within `steps` rounding steps of `dtype` at `magnitude`, the size of the
    terms added last (the product before its bias): kernels round the product before adding
    the bias, so an output that cancels is off by a step of the product's size (an H100,
    fp16: 0.047 where the output was 0.9)."""
    eps = torch.finfo(dtype).eps
    excess = (got.float() - want.float()).abs() - steps * eps * (magnitude.float().abs() + 1)
    assert excess.max() <= 0, f"{int((excess > 0).sum())} elements off by up to {excess.max():.4g} beyond tolerance"


def _graph_replays_as_eager(layer, x: torch.Tensor, exact: bool = True) -> None:
    graph, static_x, side = torch.cuda.CUDAGraph(), x.clone(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, on a side stream (torch's recipe)
        layer(static_x)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
    static_x.copy_(x * 2)
    graph.replay()
    # Not exact where a kernel adds split-K partials by atomics (their order varies).
    torch.testing.assert_close(static_y, layer(x * 2), **({"rtol": 0, "atol": 0} if exact else _one_step(x.dtype)))


@_NEEDS_FP8_GPU
@pytest.mark.parametrize("n,k", [(256, 512), (40, 24)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_scaled_mm_equals_the_reference(n, k, dtype):
    t = {"m.weight": _weight(n, k) / 100, "m.bias": torch.randn(n)}
    dev = torch.device("cuda")
    layer = quantize_fp8(t.__getitem__, [Part("m")], FP8, True, dev, dtype)
    assert layer.uses_scaled_mm
    x = torch.randn(3, 7, k, dtype=dtype, device=dev)
    tol = _one_step(dtype)
    # The reference: the kernel's own e4m3 operands and scales, multiplied in fp32 on the CPU.
    # Not a CUDA fp32 matmul (it may run in TF32, whose error grows with the terms' size: an
    # H100, 0.14 off a product of 279.6), nor the CPU layer's own activation rounding (a
    # division rounded otherwise flips an e4m3 code: an H200 run, past two output steps).
    args = scaled_mm_args(x.reshape(-1, k), layer.weight, layer.weight_scale, layer.bias)
    product = ((args.a.cpu().float() * args.scale_a.cpu()) @ (args.b.cpu().float() * args.scale_b.cpu()))[:, :n]
    want = (product + layer.bias.cpu().float()).reshape(3, 7, n).to(dev)
    # Hopper's FP8 tensor cores keep ~14 bits of the running sum whatever use_fast_accum says
    # for the row-wise kernels (H100/H200 runs: up to 0.025 past two fp16 steps of the output):
    # the bound adds 2^-12 of the terms' absolute sum to the output's rounding.
    terms = ((args.a.cpu().float() * args.scale_a.cpu()).abs() @ (args.b.cpu().float() * args.scale_b.cpu()).abs())
    magnitude = product.abs() + 2 ** -12 / torch.finfo(dtype).eps * terms[:, :n]
    _assert_within_steps(layer.forward_scaled_mm(x), want, magnitude.reshape(3, 7, n).to(dev), dtype)
    # Steps of more than SMALL_BATCH_ROWS rows take _scaled_mm, compiled and from graphs too.
    big = torch.randn(SMALL_BATCH_ROWS + 1, k, dtype=dtype, device=dev)
    torch.testing.assert_close(layer(big), layer.forward_scaled_mm(big), rtol=0, atol=0)
    torch.testing.assert_close(torch.compile(layer, fullgraph=True)(big), layer(big), **tol)
    _graph_replays_as_eager(layer, big)


@_NEEDS_FP8_GPU
@pytest.mark.skipif(importlib.util.find_spec("gemlite") is None, reason="the small-batch kernel is gemlite's")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_small_batch_is_the_weight_only_product(dtype):
    """At most SMALL_BATCH_ROWS rows: x against the FP8 weight widened, no activation rounding."""
    n, k = 1152, 896  # Qwen2-0.5B's packed q/k/v
    t = {"m.weight": _weight(n, k) / 100, "m.bias": torch.randn(n)}
    dev = torch.device("cuda")
    layer = quantize_fp8(t.__getitem__, [Part("m")], FP8, True, dev, dtype)
    assert layer.small_batch is not None
    w = (layer.weight.float() * layer.weight_scale[:, None]).cpu()
    # fp16 outputs: gemlite 0.6 adds split-K partials with fp16 atomics whatever
    # set_native_atomic_bfp16 says (native for fp16), each partial rounded to fp16: an H100 had
    # 0.19 off at magnitude 30 (12 fp16 steps, 0.6%: under two bf16 steps). bf16 sums in fp32.
    steps = 2 if dtype is torch.bfloat16 else 16
    for rows in (1, 3, SMALL_BATCH_ROWS):
        x = torch.randn(rows, k, dtype=dtype, device=dev)
        product = (x.float().cpu() @ w.t()).to(dev)  # on the CPU: exact fp32, never TF32
        want = (product + layer.bias.float()).to(dtype)
        _assert_within_steps(layer(x), want, product, dtype, steps)
        _assert_within_steps(torch.compile(layer, fullgraph=True, dynamic=True)(x), want, product, dtype, steps)
        _graph_replays_as_eager(layer, x, exact=False)


# ---- compressed-tensors checkpoints

def _hand_written(per_tensor: bool, static: bool) -> dict[str, torch.Tensor]:
    """q/k/v/o tensors in compressed-tensors' float-quantized layout, written by hand."""
    t = {}
    for i, (m, n, k) in enumerate((("q", 48, 32), ("k", 16, 32), ("v", 16, 32), ("o", 32, 48))):
        w = _weight(n, k, i)
        scale = (w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)) / 448
        t[f"{m}.weight"] = (w / scale).clamp(-448, 448).to(E4M3)
        t[f"{m}.weight_scale"] = scale.reshape(1) if per_tensor else scale
        t[f"{m}.bias"] = torch.randn(n, dtype=torch.bfloat16)
        if static:
            t[f"{m}.input_scale"] = torch.tensor([0.01 * (i + 1)])
    return t


@pytest.mark.parametrize("per_tensor", [False, True])
def test_compressed_shards_and_packing(per_tensor):
    t = _hand_written(per_tensor, static=False)
    scheme = CT_TENSOR if per_tensor else CT_CHANNEL
    expected = {m: t[f"{m}.weight"].float() * t[f"{m}.weight_scale"].reshape(-1, 1) for m in "qkvo"}

    def read(parts, bias=False):
        return read_compressed_fp8(t.__getitem__, parts, scheme, bias, CPU, torch.float32)

    packed = read([Part("q"), Part("k"), Part("v")], bias=True)
    # Per-tensor scales of q, k, v become per-row scales, each row its own module's: exact.
    assert torch.equal(packed.dequantize(), torch.cat([expected[m] for m in "qkv"]))
    assert packed.input_scale is None and packed.weight_scale.shape == (80,)
    rows = read([Part("q", (0, 8, 24)), Part("v", (0, 0, 8))], bias=True)
    assert torch.equal(rows.dequantize(), torch.cat([expected["q"][8:24], expected["v"][:8]]))
    assert torch.equal(rows.bias, torch.cat([t["q.bias"][8:24], t["v.bias"][:8]]).float())
    cols = read([Part("o", (1, 16, 32))])  # a column shard keeps every row's scale
    assert torch.equal(cols.dequantize(), expected["o"][:, 16:32])


def test_compressed_static_input_scales_share_the_largest():
    t = _hand_written(per_tensor=True, static=True)
    layer = read_compressed_fp8(t.__getitem__, [Part("q"), Part("k"), Part("v")], CT_TENSOR, True, CPU,
                                torch.float32)
    assert layer.input_scale.item() == pytest.approx(0.03)  # q 0.01, k 0.02, v 0.03
    del t["k.input_scale"]
    with pytest.raises(DuokaError, match="k lack the input_scale"):
        read_compressed_fp8(t.__getitem__, [Part("q"), Part("k")], CT_TENSOR, False, CPU, torch.float32)


def test_compressed_reader_refusals():
    t = _hand_written(per_tensor=False, static=False)
    with pytest.raises(DuokaError, match=r"weight_scale has shape \(48, 1\)"):
        read_compressed_fp8(t.__getitem__, [Part("q")], CT_TENSOR, False, CPU, torch.bfloat16)
    t["k.weight"] = t["k.weight"].float().bfloat16()
    with pytest.raises(DuokaError, match="not the float8_e4m3fn matrix"):
        read_compressed_fp8(t.__getitem__, [Part("k")], CT_CHANNEL, False, CPU, torch.bfloat16)
    t["v.weight"].view(torch.uint8)[0, 0] = 0x7F  # e4m3fn's NaN
    with pytest.raises(DuokaError, match="NaN or inf"):
        read_compressed_fp8(t.__getitem__, [Part("v")], CT_CHANNEL, False, CPU, torch.bfloat16)
    with pytest.raises(KeyError):  # the loader names the missing tensor
        read_compressed_fp8(t.__getitem__, [Part("x")], CT_CHANNEL, False, CPU, torch.bfloat16)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(32, 48), nn.Linear(32, 16), nn.Linear(32, 16)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.lm_head = _Attention(), nn.Linear(32, 64, bias=False)


def _written_by_compressed_tensors(preset: str, tmp_path) -> tuple[dict, dict, dict]:
    """(state dict as saved, the original weights, config.json) of a tiny model quantized and
    compressed by the compressed-tensors package: its preset scheme applied to every Linear but
    lm_head, weight scales from its calculate_qparams (what llm-compressor's min-max observer
    feeds it), static input scales set by hand (calibration is llm-compressor's), then its
    ModelCompressor (format float-quantized) and update_config."""
    import json

    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils import calculate_qparams

    torch.manual_seed(0)
    model = _Tiny()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"],
                                                                             **PRESET_SCHEMES[preset])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for i, module in enumerate(model.self_attn.children()):
        args, w = module.quantization_scheme.weights, module.weight.data
        dims = dict(dim=1, keepdim=True) if args.strategy == "channel" else {}
        scale, _ = calculate_qparams(w.amin(**dims).reshape(-1, 1) if dims else w.amin().reshape(1),
                                     w.amax(**dims).reshape(-1, 1) if dims else w.amax().reshape(1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale"):
            module.input_scale.data.fill_(0.01 * (i + 1))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    compressor.update_config(str(tmp_path))
    assert ct.__version__
    return model.state_dict(), original, json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8"])
def test_checkpoint_written_by_compressed_tensors(preset, tmp_path):
    saved, original, config = _written_by_compressed_tensors(preset, tmp_path)
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    per_tensor = preset == "FP8"
    prefix = "self_attn."
    assert saved[prefix + "q_proj.weight"].dtype == E4M3
    assert saved[prefix + "q_proj.weight_scale"].shape == ((1,) if per_tensor else (48, 1))
    assert (prefix + "q_proj.input_scale" in saved) == per_tensor
    assert saved["lm_head.weight"].dtype == torch.float32  # ignored: left as it was
    scheme = parse_compressed_tensors(config["quantization_config"])
    assert scheme == QuantScheme("compressed-tensors", bits=8, weight_per_tensor=per_tensor)
    parts = [Part(prefix + m) for m in ("q_proj", "k_proj", "v_proj")]
    layer = read_compressed_fp8(saved.__getitem__, parts, scheme, True, CPU, torch.float32)
    args = PRESET_SCHEMES[preset]["weights"]
    theirs = torch.cat([dequantize(saved[p.prefix + ".weight"], saved[p.prefix + ".weight_scale"], args=args)
                        for p in parts])
    assert torch.equal(layer.dequantize(), theirs)  # the package's own decompression
    w = torch.cat([original[p.prefix + ".weight"] for p in parts])
    assert bool(((theirs - w).abs() <= 2**-4 * w.abs() + 2**-10 * w.abs().amax()).all())
    assert torch.equal(layer.bias, torch.cat([original[p.prefix + ".bias"] for p in parts]))
    if per_tensor:
        assert layer.input_scale.item() == pytest.approx(0.03)


# ---- quantization_config

def _published(strategy: str = "channel", dynamic: bool = True) -> dict:
    """The quantization_config of llm-compressor's FP8 checkpoints (e.g. its FP8_DYNAMIC
    Qwen2.5-*-Instruct-FP8-dynamic), with the keys compressed-tensors 0.8-0.10 wrote."""
    def args(strategy, dynamic, observer):
        return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None, "num_bits": 8,
                "observer": observer, "observer_kwargs": {}, "strategy": strategy, "symmetric": True,
                "type": "float"}

    return {
        "config_groups": {"group_0": {
            "input_activations": args("token" if dynamic else "tensor", dynamic, None if dynamic else "minmax"),
            "output_activations": None, "targets": ["Linear"],
            "weights": args(strategy, False, "minmax")}},
        "format": "float-quantized", "global_compression_ratio": 1.4632, "ignore": ["lm_head"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
        "sparsity_config": {}}


def test_parse_published_configs():
    assert parse_compressed_tensors(_published()) == QuantScheme("compressed-tensors", bits=8)
    static = parse_compressed_tensors(_published("tensor", dynamic=False))
    assert static == QuantScheme("compressed-tensors", bits=8, weight_per_tensor=True)
    preset = {"quant_method": "compressed-tensors", "format": "naive-quantized", "ignore": ["re:.*lm_head"],
              "config_groups": {"FP8_DYNAMIC": ["Linear"]}}
    assert not parse_compressed_tensors(preset).weight_per_tensor
    wider = _published()
    wider["ignore"] += ["re:.*visual.*", "model.embed_tokens", "re:.*mlp.gate$"]  # none is a projection
    wider["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    wider["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*_proj$", "re:.*mlp.*_proj$"]
    wider["ignore"].remove("lm_head")  # the targets leave it out
    assert parse_compressed_tensors(wider).method == "compressed-tensors"


def _edit(path: str, value) -> dict:
    qc = copy.deepcopy(_published())
    *keys, last = path.split(".")
    node = qc
    for key in keys:
        node = node[key]
    node[last] = value
    return qc


@pytest.mark.parametrize("qc,message", [
    (_edit("config_groups.group_0.weights.type", "int"), r"weights = 'int 8 bits'"),
    (_edit("config_groups.group_0.weights.strategy", "group"), r"weights.strategy = 'group'"),
    (_edit("config_groups.group_0.weights.block_structure", [128, 128]), r"weights.block_structure"),
    (_edit("config_groups.group_0.weights.num_bits", 4), r"weights = 'float 4 bits'"),
    (_edit("config_groups.group_0.input_activations", None), r"input_activations = None"),
    (_edit("config_groups.group_0.input_activations.dynamic", "local"), r"dynamic local"),
    (_edit("config_groups.group_0.input_activations.strategy", "group"), r"strategy group"),
    (_edit("config_groups.group_0.output_activations", {"num_bits": 8}), r"output_activations"),
    (_edit("format", "pack-quantized"), r"format = 'pack-quantized'"),
    (_edit("format", "dense"), r"format = 'dense'"),
    (_edit("quant_method", "fp8"), r"quant_method = 'fp8'"),
    (_edit("sparsity_config", {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}), r"sparse-24-bitmask"),
    (_edit("transform_config", {"config_groups": {"R1": {}}}), r"transform_config"),
    (_edit("ignore", ["lm_head", "re:.*down_proj"]), r"'re:.\*down_proj' leaves model.layers.0.mlp.down_proj"),
    (_edit("ignore", ["lm_head", "model.layers.5.self_attn.k_proj"]), r"leaves model.layers.5.self_attn.k_proj"),
    (_edit("ignore", []), r"lm_head is quantized"),
    (_edit("config_groups.group_0.targets", ["re:.*self_attn.*"]), r"no config group targets .*mlp.gate_proj"),
    (_edit("config_groups", {"W4A16": ["Linear"]}), r"\(preset\) = 'W4A16'"),
])
def test_parse_refusals_name_the_field_and_the_fix(qc, message):
    with pytest.raises(DuokaError, match=message) as e:
        parse_compressed_tensors(qc)
    assert e.value.fix
