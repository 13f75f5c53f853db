"""GPTQ and AWQ checkpoints as quantized linear layers (duoka/models/quant/gptq.py, awq.py,
groupwise.py, tinygemm.py, writers.py).

The checkpoints here are packed by plain Python integer arithmetic from the formats'
definitions (AutoGPTQ's QuantLinear.pack, AutoAWQ's WQLinear_GEMM.from_linear), independent of
the unpackers under test; the expected weights are computed from the integers directly.
"""

import pytest
import torch

from duoka.errors import DuokaError
from duoka.models.quant.awq import read_awq, read_awq_part, unpack_awq
from duoka.models.quant.base import Part, QuantScheme
from duoka.models.quant.gemlite_group import gemlite_problem
from duoka.models.quant.gptq import read_gptq, read_gptq_part
from duoka.models.quant.group_kernels import build_group_linear
from duoka.models.quant.groupwise import GroupInts, GroupQuantLinear
from duoka.models.quant.small_batch import load_gemlite
from duoka.models.quant.tinygemm import (
    TinyGemmInt4Linear,
    cuda_int4_bytes,
    tinygemm_dequantize,
    tinygemm_layout,
    tinygemm_problem,
)
from duoka.models.quant.writers import quantize_to_awq, quantize_to_gptq

CPU = torch.device("cpu")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ gemm.py order_map


# ---- an independent packer: Python ints, one value at a time ----

def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def py_pack_gptq(q, zeros, bits, v1):
    """q [out][in], zeros [groups][out] (real zero points) -> (qweight, qzeros) int32."""
    pack, mask = 32 // bits, (1 << bits) - 1
    out_f, in_f = len(q), len(q[0])
    qweight = [[_int32(sum(q[o][r * pack + k] << (bits * k) for k in range(pack))) for o in range(out_f)]
               for r in range(in_f // pack)]
    qzeros = [[_int32(sum(((row[c * pack + k] - (1 if v1 else 0)) & mask) << (bits * k) for k in range(pack)))
               for c in range(out_f // pack)] for row in zeros]
    return torch.tensor(qweight, dtype=torch.int32), torch.tensor(qzeros, dtype=torch.int32)


def py_pack_awq(q, zeros):
    """q [out][in], zeros [groups][out] -> (qweight [in, out/8], qzeros [groups, out/8])."""
    out_f, in_f = len(q), len(q[0])
    qweight = [[_int32(sum(q[c * 8 + AWQ_PACK_ORDER[k]][i] << (4 * k) for k in range(8))) for c in range(out_f // 8)]
               for i in range(in_f)]
    qzeros = [[_int32(sum(row[c * 8 + AWQ_PACK_ORDER[k]] << (4 * k) for k in range(8))) for c in range(out_f // 8)]
              for row in zeros]
    return torch.tensor(qweight, dtype=torch.int32), torch.tensor(qzeros, dtype=torch.int32)


def random_ints(out_f, in_f, bits, group_size, sym, seed, act_order=False):
    """(q, zeros, scales, g_idx) drawn at random; act_order shuffles which columns share a group."""
    gen = torch.Generator().manual_seed(seed)
    size = in_f if group_size == -1 else group_size
    groups = in_f // size
    q = torch.randint(0, 1 << bits, (out_f, in_f), generator=gen)
    if sym:
        zeros = torch.full((groups, out_f), 1 << (bits - 1))
    else:
        zeros = torch.randint(0, 1 << bits, (groups, out_f), generator=gen)
    scales = (torch.rand(groups, out_f, generator=gen) * 0.02 + 0.001).half()
    g_idx = torch.arange(in_f) // size
    if act_order:
        g_idx = g_idx[torch.randperm(in_f, generator=gen)]
    return q, zeros, scales, g_idx


def direct_weight(q, zeros, scales, g_idx):
    """W[o, i] = (q[o, i] - z[g_idx[i], o]) * s[g_idx[i], o], element by element's formula."""
    return (q.float() - zeros[g_idx].t().float()) * scales[g_idx].t().float()


def gptq_tensors(prefix, q, zeros, scales, g_idx, bits, v1=True, bias=None):
    qweight, qzeros = py_pack_gptq(q.tolist(), zeros.tolist(), bits, v1)
    tensors = {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales,
               f"{prefix}.g_idx": g_idx.int()}
    if bias is not None:
        tensors[f"{prefix}.bias"] = bias
    return tensors


def source(tensors):
    return lambda name: tensors[name]


def gptq_scheme(bits=4, group_size=32, sym=False, desc_act=False, fmt="gptq"):
    return QuantScheme("gptq", bits=bits, group_size=group_size, desc_act=desc_act, sym=sym, checkpoint_format=fmt)


# ---- unpacking ----

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_unpacks_what_the_format_packs(bits, sym, fmt):
    q, zeros, scales, g_idx = random_ints(16, 64, bits, 32, sym, seed=bits + sym)
    if not sym:
        zeros[0, :3] = torch.tensor([0, 1, (1 << bits) - 1])  # v1's edge: z = 0 is stored as 2**bits - 1
    tensors = gptq_tensors("m", q, zeros, scales, g_idx, bits, v1=fmt == "gptq")
    ints = read_gptq_part(source(tensors), "m", gptq_scheme(bits, 32, sym, fmt=fmt), False, CPU)
    assert torch.equal(ints.q.long(), q) and torch.equal(ints.zeros.long(), zeros)
    layer = read_gptq(source(tensors), [Part("m")], gptq_scheme(bits, 32, sym, fmt=fmt), False, CPU, torch.float32)
    assert torch.equal(layer.dequantize(), direct_weight(q, zeros, scales, g_idx))


def test_gptq_symmetric_checkpoints_store_the_midpoint_minus_one_in_v1():
    q, zeros, scales, g_idx = random_ints(8, 32, 4, 32, True, seed=1)
    tensors = gptq_tensors("m", q, zeros, scales, g_idx, 4, v1=True)
    assert tensors["m.qzeros"].unique().tolist() == [0x77777777]  # AutoGPTQ's symmetric Int4 files
    ints = read_gptq_part(source(tensors), "m", gptq_scheme(4, 32, sym=True), False, CPU)
    assert ints.zeros.unique().tolist() == [8]


def test_awq_unpacks_its_interleaved_order():
    q, zeros, scales, g_idx = random_ints(16, 64, 4, 32, False, seed=3)
    qweight, qzeros = py_pack_awq(q.tolist(), zeros.tolist())
    tensors = {"m.qweight": qweight, "m.qzeros": qzeros, "m.scales": scales}
    scheme = QuantScheme("awq", bits=4, group_size=32, sym=False)
    ints = read_awq_part(source(tensors), "m", scheme, False, CPU)
    assert torch.equal(ints.q.long(), q) and torch.equal(ints.zeros.long(), zeros)
    layer = read_awq(source(tensors), [Part("m")], scheme, False, CPU, torch.float32)
    assert torch.equal(layer.dequantize(), direct_weight(q, zeros, scales, g_idx))
    # Not the plain order: nibble k holding k reads back as output column j holding the nibble
    # that column came from.
    nibbles = torch.tensor([[_int32(sum(k << (4 * k) for k in range(8)))]], dtype=torch.int32)
    assert unpack_awq(nibbles).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]


# ---- the layer ----

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_forward_is_x_times_the_dequantized_weight_plus_bias(dtype, tol):
    q, zeros, scales, g_idx = random_ints(24, 64, 4, 32, False, seed=4)
    bias = torch.randn(24).half()
    tensors = gptq_tensors("m", q, zeros, scales, g_idx, 4, bias=bias)
    layer = read_gptq(source(tensors), [Part("m")], gptq_scheme(), True, CPU, dtype)
    assert isinstance(layer, GroupQuantLinear) and layer.kernel == "reference" and "cpu" in layer.reason
    x = torch.randn(2, 3, 64, dtype=dtype)
    want = x.float() @ direct_weight(q, zeros, scales, g_idx).t() + bias.float()
    got = layer(x)
    assert got.shape == (2, 3, 24) and got.dtype == dtype
    assert torch.allclose(got.float(), want, atol=tol * want.abs().max(), rtol=0)
    # Stored as integers: 4-bit values two to a byte, plus scales, zeros, g_idx and bias.
    assert layer.weight_bytes() == 24 * 64 // 2 + 2 * 24 * (2 + 1) + 64 * 8 + 24 * dtype.itemsize


def test_act_order_with_a_shuffled_g_idx():
    q, zeros, scales, g_idx = random_ints(16, 128, 4, 32, False, seed=5, act_order=True)
    assert not torch.equal(g_idx, torch.arange(128) // 32)
    tensors = gptq_tensors("m", q, zeros, scales, g_idx, 4)
    layer = read_gptq(source(tensors), [Part("m")], gptq_scheme(desc_act=True), False, CPU, torch.float32)
    want = direct_weight(q, zeros, scales, g_idx)
    assert torch.equal(layer.dequantize(), want)
    x = torch.randn(5, 128)
    assert torch.allclose(layer(x), x @ want.t(), atol=1e-5)


def _qkv(act_order=False, bias=True, bits=4):
    """Three modules sharing an input (q 32 rows, k and v 16), their tensors and whole weights."""
    tensors, weights, biases = {}, [], []
    shared_g = None
    for i, (name, rows) in enumerate((("q_proj", 32), ("k_proj", 16), ("v_proj", 16))):
        q, zeros, scales, g_idx = random_ints(rows, 128, bits, 32, False, seed=10 + i, act_order=act_order)
        shared_g = g_idx if shared_g is None else shared_g
        b = torch.randn(rows).half() if bias else None
        tensors |= gptq_tensors(name, q, zeros, scales, shared_g, bits, bias=b)
        weights.append(direct_weight(q, zeros, scales, shared_g))
        biases.append(b)
    return tensors, torch.cat(weights), (torch.cat(biases).float() if bias else None)


@pytest.mark.parametrize("act_order", [False, True])
def test_three_parts_concatenate_along_the_output_rows(act_order):
    tensors, whole, bias = _qkv(act_order)
    parts = [Part(n) for n in ("q_proj", "k_proj", "v_proj")]
    layer = read_gptq(source(tensors), parts, gptq_scheme(desc_act=act_order), True, CPU, torch.float32)
    assert (layer.out_features, layer.in_features) == (64, 128)
    assert torch.equal(layer.dequantize(), whole)
    assert torch.equal(layer.bias, bias)


def test_row_shards_of_concatenated_parts():
    tensors, whole, bias = _qkv()
    # Rank 1 of 2: q rows 16:32, k rows 8:16, v rows 8:16 (an odd cut too: the layer needs no packing alignment).
    parts = [Part("q_proj", (0, 16, 32)), Part("k_proj", (0, 8, 16)), Part("v_proj", (0, 3, 16))]
    layer = read_gptq(source(tensors), parts, gptq_scheme(), True, CPU, torch.float32)
    rows = [*range(16, 32), *range(32 + 8, 48), *range(48 + 3, 64)]
    assert torch.equal(layer.dequantize(), whole[rows])
    assert torch.equal(layer.bias, bias[rows])


@pytest.mark.parametrize("fmt,act_order", [("gptq", False), ("gptq", True), ("awq", False)])
def test_column_shards_equal_slices_of_the_whole_weight(fmt, act_order):
    q, zeros, scales, g_idx = random_ints(16, 128, 4, 32, False, seed=6, act_order=act_order)
    if fmt == "gptq":
        tensors, read = gptq_tensors("m", q, zeros, scales, g_idx, 4), read_gptq
        scheme = gptq_scheme(desc_act=act_order)
    else:
        qweight, qzeros = py_pack_awq(q.tolist(), zeros.tolist())
        tensors, read = {"m.qweight": qweight, "m.qzeros": qzeros, "m.scales": scales}, read_awq
        scheme = QuantScheme("awq", bits=4, group_size=32, sym=False)
    whole = direct_weight(q, zeros, scales, g_idx)
    for start, stop in ((0, 64), (64, 128), (32, 96)):
        layer = read(source(tensors), [Part("m", (1, start, stop))], scheme, False, CPU, torch.float32)
        assert torch.equal(layer.dequantize(), whole[:, start:stop])
        x = torch.randn(3, stop - start)
        assert torch.allclose(layer(x), x @ whole[:, start:stop].t(), atol=1e-5)


def test_column_shards_must_keep_whole_groups():
    q, zeros, scales, g_idx = random_ints(16, 128, 4, 32, False, seed=7)
    tensors = gptq_tensors("m", q, zeros, scales, g_idx, 4)
    with pytest.raises(DuokaError, match="cuts the checkpoint's groups of 32") as e:
        read_gptq(source(tensors), [Part("m", (1, 0, 48))], gptq_scheme(), False, CPU, torch.float32)
    assert "multiple of 32" in e.value.fix
    # Per channel (group_size -1), one group spans the row: any cut keeps it whole.
    q, zeros, scales, g_idx = random_ints(16, 128, 4, -1, False, seed=7)
    tensors = gptq_tensors("m", q, zeros, scales, g_idx, 4)
    layer = read_gptq(source(tensors), [Part("m", (1, 8, 40))], gptq_scheme(group_size=-1), False, CPU, torch.float32)
    assert torch.equal(layer.dequantize(), direct_weight(q, zeros, scales, g_idx)[:, 8:40])


def test_parts_grouped_differently_are_refused():
    tensors = {}
    for i, name in enumerate(("gate_proj", "up_proj")):
        q, zeros, scales, g_idx = random_ints(16, 64, 4, 32, False, seed=20 + i, act_order=True)
        tensors |= gptq_tensors(name, q, zeros, scales, g_idx, 4)
    with pytest.raises(DuokaError, match="up_proj groups its 64 input columns differently from gate_proj"):
        read_gptq(source(tensors), [Part("gate_proj"), Part("up_proj")], gptq_scheme(desc_act=True), False, CPU,
                  torch.float32)


# ---- malformed checkpoints ----

def _good():
    q, zeros, scales, g_idx = random_ints(16, 64, 4, 32, False, seed=8)
    return gptq_tensors("m", q, zeros, scales, g_idx, 4)


@pytest.mark.parametrize("change,scheme,message", [
    (lambda t: t.update({"m.qweight": t["m.qweight"].float()}), {}, r"m.qweight is float32, expected int32"),
    (lambda t: t.update({"m.scales": t["m.scales"][:, :8]}), {}, r"m.scales has shape \[2, 8\], expected \[2, 16\]"),
    (lambda t: t.update({"m.scales": t["m.scales"].int()}), {}, r"m.scales is int32, expected float16"),
    (lambda t: t.update({"m.qzeros": t["m.qzeros"][:1]}), {}, r"m.qzeros has shape \[1, 2\], expected \[2, 2\]"),
    (lambda t: t.pop("m.qzeros"), {}, r"m.qzeros is missing"),
    (lambda t: t.update({"m.g_idx": t["m.g_idx"] + 5}), {}, r"m.g_idx names groups outside 0..1"),
    (lambda t: t.pop("m.g_idx"), {"desc_act": True}, r"m.g_idx is missing, and act-order"),
    (lambda t: t["m.scales"].__setitem__((0, 0), float("nan")), {}, r"m.scales holds NaN"),
    (lambda t: None, {"group_size": 48}, r"group_size 48 does not divide the input width 64"),
    (lambda t: None, {"bits": 3}, r"GPTQ with 3 bits is not supported"),
    (lambda t: None, {"fmt": "marlin"}, r"checkpoint_format 'marlin' is not supported"),
])
def test_malformed_gptq_tensors_are_refused(change, scheme, message):
    tensors = _good()
    change(tensors)
    with pytest.raises(DuokaError, match=message) as e:
        read_gptq(source(tensors), [Part("m")], gptq_scheme(**scheme), False, CPU, torch.float32)
    assert e.value.fix


def test_missing_g_idx_without_act_order_means_contiguous_groups():
    q, zeros, scales, g_idx = random_ints(16, 64, 4, 32, False, seed=9)
    tensors = gptq_tensors("m", q, zeros, scales, g_idx, 4)
    del tensors["m.g_idx"]
    layer = read_gptq(source(tensors), [Part("m")], gptq_scheme(), False, CPU, torch.float32)
    assert torch.equal(layer.dequantize(), direct_weight(q, zeros, scales, g_idx))


def test_malformed_awq_tensors_are_refused():
    q, zeros, scales, _ = random_ints(16, 64, 4, 32, False, seed=10)
    qweight, qzeros = py_pack_awq(q.tolist(), zeros.tolist())
    scheme = QuantScheme("awq", bits=4, group_size=32, sym=False)
    good = {"m.qweight": qweight, "m.qzeros": qzeros, "m.scales": scales}
    with pytest.raises(DuokaError, match=r"m.qzeros is missing"):
        read_awq(source({k: v for k, v in good.items() if k != "m.qzeros"}), [Part("m")], scheme, False, CPU,
                 torch.float32)
    with pytest.raises(DuokaError, match=r"m.scales has shape \[2, 16\], expected \[2, 8\]"):
        read_awq(source(good | {"m.qweight": qweight[:, :1]}), [Part("m")], scheme, False, CPU, torch.float32)
    with pytest.raises(DuokaError, match="AWQ with 8 bits"):
        read_awq(source(good), [Part("m")], QuantScheme("awq", bits=8, group_size=32), False, CPU, torch.float32)
    with pytest.raises(KeyError):  # the loader names the folder and layer for a missing tensor
        read_awq(source(good), [Part("m")], scheme, True, CPU, torch.float32)


# ---- the tinygemm conversion ----

def _bf16_exact_ints(act_order, seed=11):
    """Scales of at most 4 significant bits: s and (8 - z) * s are then exact in bf16, so
    tinygemm's formula must reproduce (q - z) * s bit for bit."""
    q, zeros, scales, g_idx = random_ints(16, 128, 4, 32, False, seed=seed, act_order=act_order)
    gen = torch.Generator().manual_seed(seed)
    mantissa = torch.randint(8, 16, scales.shape, generator=gen)
    scales = (mantissa * 2.0 ** -10).half()
    return GroupInts(q.to(torch.uint8), zeros.to(torch.uint8), scales, g_idx, 32)


@pytest.mark.parametrize("act_order", [False, True])
def test_tinygemm_layout_reproduces_the_checkpoint_weight(act_order):
    ints = _bf16_exact_ints(act_order)
    perm, q_perm, sz = tinygemm_layout(ints)
    assert (perm is not None) == act_order and sz.shape == (4, 16, 2) and sz.dtype == torch.bfloat16
    emulated = tinygemm_dequantize(q_perm, sz, 32)
    want = ints.dequantize()
    if perm is not None:
        unpermuted = torch.empty_like(emulated)
        unpermuted[:, perm] = emulated
        emulated = unpermuted
        assert torch.equal(torch.sort(ints.g_idx[perm]).values, ints.g_idx[perm])  # groups consecutive
    assert torch.equal(emulated, want)


@pytest.mark.parametrize("act_order", [False, True])
def test_tinygemm_layout_through_pytorchs_cpu_int4_kernel(act_order):
    # The CPU twin of the CUDA op takes the same scales_and_zeros ([groups, out, 2], (q - 8) * s + f).
    q, zeros, scales, g_idx = random_ints(16, 128, 4, 32, False, seed=12, act_order=act_order)
    ints = GroupInts(q.to(torch.uint8), zeros.to(torch.uint8), scales, g_idx, 32)
    perm, q_perm, sz = tinygemm_layout(ints)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_perm.int(), 2)
    x = torch.randn(4, 128)
    rows = x if perm is None else x[:, perm]
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.bfloat16(), packed, 32, sz).float()
    want = x @ ints.dequantize().t()
    assert torch.allclose(got, want, atol=0.02 * want.abs().max(), rtol=0)


@pytest.mark.parametrize("act_order", [False, True])
def test_tinygemm_layer_with_pytorchs_cpu_int4_kernels_standing_in(monkeypatch, act_order):
    # The layer's wiring (column gather, bias, shapes, dequantize through the identity), run on
    # the CUDA ops' CPU twins; the CUDA ops themselves are not run here.
    def convert(packed_bytes, inner_k_tiles):  # undo cuda_int4_bytes, pack as the CPU op takes it
        q = torch.stack([packed_bytes >> 4, packed_bytes & 15], dim=2).reshape(packed_bytes.shape[0], -1)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), inner_k_tiles)

    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack", convert)
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm", torch.ops.aten._weight_int4pack_mm_for_cpu)
    ints = _bf16_exact_ints(act_order)
    ints = GroupInts(ints.q, ints.zeros, ints.scales, ints.g_idx, 32, bias=torch.randn(16).half())
    layer = TinyGemmInt4Linear(ints)
    assert layer.kernel == "tinygemm" and (layer.perm is not None) == act_order and layer.inner_k_tiles == 8
    want = ints.dequantize()
    assert torch.equal(layer.dequantize().float(), want)
    x = torch.randn(2, 3, 128).bfloat16()
    got = layer(x)
    assert got.shape == (2, 3, 16) and got.dtype == torch.bfloat16
    ref = x.float() @ want.t() + ints.bias.float()
    assert torch.allclose(got.float(), ref, atol=0.02 * ref.abs().max(), rtol=0)
    assert layer.weight_bytes() == 16 * 128 // 2 + 4 * 16 * 2 * 2 + (128 * 8 if act_order else 0) + 16 * 2
    with pytest.raises(RuntimeError, match="takes bf16"):
        layer(x.float())


def test_cuda_int4_bytes_put_the_even_column_high():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert cuda_int4_bytes(q).tolist() == [[0x12, 0xF0]]


def test_which_weights_take_tinygemm(monkeypatch):
    ints = _bf16_exact_ints(False)
    cuda = torch.device("cuda")
    assert "cpu" in tinygemm_problem(ints, 4, CPU, torch.bfloat16)
    assert "8-bit" in tinygemm_problem(ints, 8, cuda, torch.bfloat16)
    assert "float16" in tinygemm_problem(ints, 4, cuda, torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert tinygemm_problem(ints, 4, cuda, torch.bfloat16) is None
    assert tinygemm_problem(_bf16_exact_ints(True), 4, cuda, torch.bfloat16) is None  # act-order: permuted
    shard = _bf16_exact_ints(True).shard((1, 0, 64), "m")  # act-order column shard: uneven groups
    assert "unequal" in tinygemm_problem(shard, 4, cuda, torch.bfloat16)
    per_channel = GroupInts(ints.q, ints.zeros[:1], ints.scales[:1], torch.zeros(128, dtype=torch.long), 128)
    assert tinygemm_problem(per_channel, 4, cuda, torch.bfloat16) is None  # one group of 128
    groups_of_16 = GroupInts(ints.q, ints.zeros[:1].expand(8, -1), ints.scales[:1].expand(8, -1),
                             torch.arange(128) // 16, 16)
    assert "group size 16" in tinygemm_problem(groups_of_16, 4, cuda, torch.bfloat16)
    narrow = GroupInts(ints.q[:12, :96], ints.zeros[:3, :12], ints.scales[:3, :12], torch.arange(96) // 32, 32)
    assert "shape 12x96" in tinygemm_problem(narrow, 4, cuda, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "sm80" in tinygemm_problem(ints, 4, cuda, torch.bfloat16)
    assert build_group_linear(ints, 4, CPU, torch.bfloat16).kernel == "reference"



def test_which_weights_take_gemlite():
    ints = _bf16_exact_ints(False)
    cuda = torch.device("cuda")
    assert gemlite_problem(ints, 4, cuda, torch.bfloat16) is None
    assert gemlite_problem(ints, 8, cuda, torch.float16) is None
    assert gemlite_problem(_bf16_exact_ints(True), 4, cuda, torch.bfloat16) is None  # act-order: permuted
    assert "cpu" in gemlite_problem(ints, 4, CPU, torch.bfloat16)
    assert "2-bit" in gemlite_problem(ints, 2, cuda, torch.bfloat16)
    assert "float32" in gemlite_problem(ints, 4, cuda, torch.float32)
    assert "unequal" in gemlite_problem(_bf16_exact_ints(True).shard((1, 0, 64), "m"), 4, cuda, torch.bfloat16)
    narrow = GroupInts(ints.q[:, :80], ints.zeros[:1], ints.scales[:1], torch.zeros(80, dtype=torch.long), 80)
    assert "input width 80" in gemlite_problem(narrow, 4, cuda, torch.bfloat16)


_NEEDS_GEMLITE = pytest.mark.skipif(not torch.cuda.is_available() or load_gemlite() is None,
                                    reason="gemlite's kernels need CUDA and the gemlite package")


@_NEEDS_GEMLITE
@pytest.mark.parametrize("bits,act_order", [(4, False), (4, True), (8, False)])
def test_cuda_gemlite_layer_is_x_times_the_checkpoint_weight(bits, act_order):
    # Every kernel gemlite picks by rows (GEMV, split-K, GEMM) against an fp32 product on the CPU.
    q, zeros, scales, g_idx = random_ints(256, 512, bits, 128, False, seed=21, act_order=act_order)
    ints = GroupInts(q.to(torch.uint8), zeros.to(torch.uint8), scales.to(torch.bfloat16), g_idx, 128,
                     bias=torch.randn(256, dtype=torch.bfloat16))
    cuda = torch.device("cuda")
    layer = build_group_linear(_to(ints, cuda), bits, cuda, torch.bfloat16)
    assert layer.kernel == "gemlite"
    w = ints.dequantize()
    # gemlite (as tinygemm) computes q * s + (-z * s) with the zero term rounded to the
    # activations' dtype: within one bf16 rounding of |z * s| plus one of the result.
    zs = (ints.zeros.float() * ints.scales.float()).t().index_select(1, ints.g_idx)
    w_gpu = layer.dequantize().cpu().float()
    assert ((w_gpu - w).abs() <= 2 ** -8 * (w.abs() + zs.abs())).all()
    for rows in (1, 3, 8, 100):
        x = torch.randn(rows, 512, dtype=torch.bfloat16)
        want = x.float() @ w_gpu.t() + ints.bias.float()
        got = layer(x.to(cuda)).float().cpu()
        # fp32 sums in another order and one bf16 rounding of the output, against the product
        # with the layer's own weight: every kernel gemlite picks by rows computes the same.
        assert (got - want).abs().max() <= 2 ** -7 * (want.abs().max() + 1), rows


def _to(ints, device):
    return GroupInts(ints.q.to(device), ints.zeros.to(device), ints.scales.to(device), ints.g_idx.to(device),
                     ints.group_size, None if ints.bias is None else ints.bias.to(device))

# ---- the writers ----

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_quantize_to_gptq_reads_back_within_half_a_step(bits, sym, desc_act, fmt):
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(bits)) * 0.05
    tensors = {f"m.{k}": v for k, v in quantize_to_gptq(weight, bits, 64, sym, desc_act, seed=3,
                                                         checkpoint_format=fmt).items()}
    assert tensors["m.qweight"].shape == (256 * bits // 32, 32) and tensors["m.qzeros"].shape == (4, 32 * bits // 32)
    assert tensors["m.scales"].dtype == torch.float16 and tensors["m.g_idx"].dtype == torch.int32
    assert desc_act != torch.equal(tensors["m.g_idx"].long(), torch.arange(256) // 64)
    scheme = gptq_scheme(bits, 64, sym, desc_act, fmt)
    layer = read_gptq(source(tensors), [Part("m")], scheme, False, CPU, torch.float32)
    step = tensors["m.scales"].float()[tensors["m.g_idx"].long()].t()
    err = (layer.dequantize() - weight).abs()
    assert (err <= step * 0.5 + 1e-6).float().mean() > 0.99  # rounding; the few clipped are sym's lost top step
    assert (err <= step * 1.01).all()


def test_quantize_to_gptq_packs_as_the_independent_packer():
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    written = quantize_to_gptq(weight, 4, 32, sym=False, desc_act=True, seed=1)
    ints = read_gptq_part(source({f"m.{k}": v for k, v in written.items()}), "m", gptq_scheme(desc_act=True),
                          False, CPU)
    qweight, qzeros = py_pack_gptq(ints.q.long().tolist(), ints.zeros.long().tolist(), 4, v1=True)
    assert torch.equal(qweight, written["qweight"]) and torch.equal(qzeros, written["qzeros"])


def test_quantize_to_awq_reads_back_and_packs_as_the_independent_packer():
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    written = quantize_to_awq(weight, 64)
    assert written["qweight"].shape == (256, 4) and written["qzeros"].shape == (4, 4)
    tensors = {f"m.{k}": v for k, v in written.items()}
    scheme = QuantScheme("awq", bits=4, group_size=64, sym=False)
    ints = read_awq_part(source(tensors), "m", scheme, False, CPU)
    qweight, qzeros = py_pack_awq(ints.q.long().tolist(), ints.zeros.long().tolist())
    assert torch.equal(qweight, written["qweight"]) and torch.equal(qzeros, written["qzeros"])
    layer = read_awq(source(tensors), [Part("m")], scheme, False, CPU, torch.float32)
    step = written["scales"].float().repeat_interleave(64, 0).t()
    assert ((layer.dequantize() - weight).abs() <= step * 0.5 + 1e-6).all()


# ---- against the formats' own packers, where they import ----

def test_against_autoawqs_packer():
    gemm = pytest.importorskip("awq.modules.linear.gemm")  # its packer needs out to be a multiple of 32
    q, zeros, scales, g_idx = random_ints(32, 64, 4, 32, False, seed=13)
    linear = torch.nn.Linear(64, 32, bias=False).half()
    linear.weight.data = direct_weight(q, zeros, scales, g_idx).half()
    # from_linear takes scales and zeros [groups, out], as AutoAWQ's quantizer hands them over.
    module = gemm.WQLinear_GEMM.from_linear(linear, 4, 32, scales=scales, zeros=zeros)
    tensors = {"m.qweight": module.qweight, "m.qzeros": module.qzeros, "m.scales": module.scales}
    ints = read_awq_part(source(tensors), "m", QuantScheme("awq", bits=4, group_size=32, sym=False), False, CPU)
    assert torch.equal(ints.q.long(), q) and torch.equal(ints.zeros.long(), zeros)


def test_against_autogptqs_packer():
    qlinear = pytest.importorskip("auto_gptq.nn_modules.qlinear.qlinear_cuda")
    q, zeros, scales, g_idx = random_ints(32, 64, 4, 32, False, seed=14, act_order=True)
    zeros = zeros.clamp(min=1)  # AutoGPTQ's packer cannot store z = 0 (its z - 1 overflows into the next field)
    linear = torch.nn.Linear(64, 32, bias=False).half()
    linear.weight.data = direct_weight(q, zeros, scales, g_idx).half()
    module = qlinear.QuantLinear(4, 32, 64, 32, False)
    module.pack(linear, scales.t(), zeros.t().clone(), g_idx.int())  # [out, groups]; it decrements zeros in place
    tensors = {"m.qweight": module.qweight, "m.qzeros": module.qzeros, "m.scales": module.scales,
               "m.g_idx": module.g_idx}
    ints = read_gptq_part(source(tensors), "m", gptq_scheme(desc_act=True), False, CPU)
    assert torch.equal(ints.q.long(), q) and torch.equal(ints.zeros.long(), zeros)
    assert torch.equal(ints.g_idx, g_idx)
