"""Group-wise integer weights (GPTQ and AWQ): the canonical form both readers unpack a
checkpoint module to, its tensor-parallel shards and concatenation, and the reference layer
that dequantizes per call.

Canonical form (GroupInts): the integers q [out, in], per-group zero points z and scales s
[groups, out], and g_idx [in], the group of each input column, so that

    W[o, i] = (q[o, i] - z[g_idx[i], o]) * s[g_idx[i], o]

g_idx is general: contiguous groups (g_idx = i // group_size) are the common case, GPTQ's
act-order (desc_act) shuffles them. tinygemm.py converts this form to PyTorch's int4 kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from duoka.errors import DuokaError
from duoka.models.quant.base import QuantizedLinear, Shard, TensorSource

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GroupInts:
    """One projection's (or one part's) quantized weight, unpacked. Invariants: q and zeros are
    uint8 below 2**bits; g_idx is int64 with values in [0, groups); group_size is the nominal
    number of columns per group (the whole width for per-channel checkpoints)."""
    q: torch.Tensor
    """uint8 [out, in]."""
    zeros: torch.Tensor
    """uint8 [groups, out]: the real zero points (GPTQ v1's stored zero - 1 already undone)."""
    scales: torch.Tensor
    """[groups, out], in the checkpoint's float dtype (kept so that dequantizing rounds once)."""
    g_idx: torch.Tensor
    """int64 [in]."""
    group_size: int
    bias: torch.Tensor | None = None
    """[out] in the checkpoint's dtype, or None."""

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1]

    @property
    def contiguous(self) -> bool:
        """Whether group k holds exactly the columns k*group_size ... (k+1)*group_size - 1."""
        want = torch.arange(self.in_features, device=self.g_idx.device) // self.group_size
        return torch.equal(self.g_idx, want)

    def shard(self, shard: Shard, where: str) -> GroupInts:
        """The part of the weight a tensor-parallel rank keeps: output rows (dim 0) or input
        columns (dim 1) start:stop of the logical [out, in] weight."""
        if shard is None:
            return self
        dim, start, stop = shard
        size = self.out_features if dim == 0 else self.in_features
        if dim not in (0, 1) or not 0 <= start < stop <= size:
            raise ValueError(f"{where}: shard {shard} does not fit a weight of {self.out_features}x{self.in_features}")
        if dim == 0:
            bias = None if self.bias is None else self.bias[start:stop]
            return replace(self, q=self.q[start:stop], zeros=self.zeros[:, start:stop],
                           scales=self.scales[:, start:stop], bias=bias)
        return self._column_shard(start, stop, where)

    def _column_shard(self, start: int, stop: int, where: str) -> GroupInts:
        if self.bias is not None:  # a bug of the caller, not the user's: rows split by columns sum partials
            raise ValueError(f"{where}: a bias with an input-column shard would be added once per rank")
        groups = self.scales.shape[0]
        if groups > 1 and self.contiguous and (start % self.group_size or stop % self.group_size):
            raise DuokaError(
                f"{where}: the tensor-parallel shard of input columns {start}:{stop} cuts the checkpoint's groups "
                f"of {self.group_size} columns (each group shares one scale and zero point)",
                f"use a --tp N for which {self.in_features}/N is a multiple of {self.group_size}")
        g_idx = self.g_idx[start:stop]
        # Keep the groups the slice's columns use (all of them under act-order, a run otherwise).
        first, last = int(g_idx.min()), int(g_idx.max()) + 1
        group_size = stop - start if groups == 1 else self.group_size
        return replace(self, q=self.q[:, start:stop], zeros=self.zeros[first:last],
                       scales=self.scales[first:last], g_idx=g_idx - first, group_size=group_size)

    def dequantize(self, contiguous: bool | None = None) -> torch.Tensor:
        """W [out, in] in float32, where (q - z) * s is exact for fp16/bf16 scales. `contiguous`:
        self.contiguous if known (saves the check, a device sync)."""
        contiguous = self.contiguous if contiguous is None else contiguous
        w = self.q.float()
        if contiguous:  # broadcast per group: one float32 [out, in] temporary, no gathered copies
            view = w.view(self.out_features, self.scales.shape[0], -1)
            view.sub_(self.zeros.t().unsqueeze(2)).mul_(self.scales.t().unsqueeze(2).float())
            return w
        w.sub_(self.zeros.t().index_select(1, self.g_idx))
        return w.mul_(self.scales.t().index_select(1, self.g_idx).float())


def uniform_groups(ints: GroupInts) -> bool:
    """Whether sorting the columns by group leaves groups of exactly group_size consecutive
    columns, in group order (always, but for an act-order weight's column shard)."""
    order = torch.argsort(ints.g_idx, stable=True)
    want = torch.arange(ints.in_features, device=ints.g_idx.device) // ints.group_size
    return ints.in_features % ints.group_size == 0 and torch.equal(ints.g_idx[order], want)


def unpermuted_columns(w_perm: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """W [out, in] from a kernel's W_perm, whose column k is input column perm[k] (act-order
    weights made group-consecutive at load); perm None: W_perm is W."""
    if perm is None:
        return w_perm.contiguous()
    w = torch.empty_like(w_perm)
    w[:, perm] = w_perm
    return w


def concat_parts(parts: list[GroupInts], names: list[str]) -> GroupInts:
    """The parts stacked along the output rows (q/k/v -> one projection). They read one input,
    so their input columns must mean the same: same g_idx and group count."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for part, name in zip(parts[1:], names[1:]):
        if (part.in_features != first.in_features or part.scales.shape[0] != first.scales.shape[0]
                or not torch.equal(part.g_idx, first.g_idx)):
            raise DuokaError(
                f"{name} groups its {part.in_features} input columns differently from {names[0]} (g_idx or group "
                f"count differ), so the two cannot be packed into one projection",
                "quantize modules that share an input (q/k/v, gate/up) with the same act-order (desc_act) "
                "permutation, as AutoGPTQ and GPTQModel do")
    if any((p.bias is None) != (first.bias is None) for p in parts):
        raise ValueError(f"{names}: some parts have a bias and some not")
    bias = None if first.bias is None else torch.cat([p.bias for p in parts])
    return replace(first, q=torch.cat([p.q for p in parts]), zeros=torch.cat([p.zeros for p in parts], 1),
                   scales=torch.cat([p.scales for p in parts], 1), bias=bias)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32/bits values per int32 along dim 0, lowest bits first ->
    uint8 [R * 32/bits, C] (GPTQ's qweight)."""
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    # Arithmetic shift of a negative int32 drags the sign in above the field; the mask drops it.
    values = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32/bits values per int32 along dim 1, lowest bits first ->
    uint8 [R, C * 32/bits] (GPTQ's qzeros; AWQ's before its interleave is undone)."""
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    values = (packed.unsqueeze(2) >> shifts.view(1, 1, -1)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


def group_count(where: str, in_features: int, group_size: int) -> int:
    """Groups of a module whose input width is in_features; -1 is one group (per channel)."""
    if group_size == -1:
        return 1
    if group_size <= 0 or in_features % group_size:
        raise DuokaError(f"{where}: group_size {group_size} does not divide the input width {in_features}",
                         "set quantization_config.group_size in config.json to the group size the checkpoint was "
                         "quantized with (a divisor of every input width, usually 128)")
    return in_features // group_size


def checked(source: TensorSource, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None,
            fix: str, ndim: int = 2) -> torch.Tensor:
    """Checkpoint tensor `name`, refused unless of one of `dtypes` and of `shape` (None: any
    shape of `ndim` dimensions). A missing tensor raises KeyError (the loader names the folder)."""
    t = source(name)
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise DuokaError(f"checkpoint tensor {name} is {str(t.dtype).removeprefix('torch.')}, expected {want}", fix)
    if (shape is not None and tuple(t.shape) != tuple(shape)) or (shape is None and t.dim() != ndim):
        want = list(shape) if shape is not None else f"{ndim} dimensions"
        raise DuokaError(f"checkpoint tensor {name} has shape {list(t.shape)}, expected {want}", fix)
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise DuokaError(f"checkpoint tensor {name} holds NaN or infinity", fix)
    return t


class GroupQuantLinear(QuantizedLinear):
    """The reference layer: integer weights stored, dequantized to the compute dtype on every
    call (never cached: a kept dense weight would undo the memory quantization saves). Used on
    CPU, for 8 bits everywhere (PyTorch ships no group-wise int8 weight-only kernel) and where
    tinygemm cannot apply (`reason` says why)."""

    def __init__(self, ints: GroupInts, bits: int, dtype: torch.dtype, reason: str):
        super().__init__()
        self.in_features, self.out_features = ints.in_features, ints.out_features
        self.bits, self.group_size, self.dtype = bits, ints.group_size, dtype
        self.kernel, self.reason = "reference", reason
        # 4 bits: two rows per byte (row 2r low nibble, 2r+1 high), halving what is kept.
        self.nibbles = bits == 4 and self.out_features % 2 == 0
        q = ints.q[0::2] | (ints.q[1::2] << 4) if self.nibbles else ints.q
        self.register_buffer("qdata", q.contiguous())
        self.register_buffer("zeros", ints.zeros.contiguous())
        self.register_buffer("scales", ints.scales.contiguous())
        self.register_buffer("g_idx", ints.g_idx.contiguous())
        self.register_buffer("bias", None if ints.bias is None else ints.bias.to(dtype))
        self.contiguous_groups = ints.contiguous

    def ints(self) -> GroupInts:
        q = self.qdata
        if self.nibbles:
            q = torch.stack([q & 15, q >> 4], dim=1).reshape(self.out_features, self.in_features)
        return GroupInts(q, self.zeros, self.scales, self.g_idx, self.group_size, self.bias)

    def dequantize(self) -> torch.Tensor:
        return self.ints().dequantize(self.contiguous_groups).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def weight_bytes(self) -> int:
        # The bias too: the loader's count leaves every tensor of a QuantizedLinear to it.
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, kernel=reference ({self.reason})")
