"""Rotary position embeddings and the context extensions a Qwen2 config may ask for: the
frequencies and the cos/sin tables, as transformers' rope utilities compute them.

- default: inv_freq_i = theta^(-2i / head_dim).
- linear: positions divided by `factor` (every frequency over factor).
- yarn (Qwen's recipe for 128K: factor 4 over 32,768 positions, arXiv:2309.00071): low
  frequencies interpolated (over factor), high ones kept, a linear ramp between the
  dimensions that turn beta_slow and beta_fast times over the original context; cos and sin
  scaled by the attention factor 0.1 ln(factor) + 1 (or mscale / mscale_all_dim's ratio).
- llama3: Llama 3.1's piecewise rule (low_freq_factor, high_freq_factor).

Refused: dynamic NTK (its frequencies follow the running sequence length, so a cached key
would have been rotated by other frequencies than the query reading it) and longrope (Phi-3's
per-dimension factors; no Qwen2 config carries it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from duoka.errors import DuokaError

ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """A config's rope_scaling / rope_parameters (transformers' names), theta aside."""
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    """The pretraining context the factor extends; None: the config's max_position_embeddings."""
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not one of {ROPE_TYPES}")
        if self.rope_type != "default" and not (_finite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"rope scaling factor {self.factor!r} must be >= 1")
        self._check_ranges()

    def _check_ranges(self) -> None:
        """Every field a number in the range its formula needs (a config.json is untrusted: NaN,
        a string or a zero would give a model that loads and prints nothing)."""
        original = self.original_max_position_embeddings
        if original is not None and not (isinstance(original, int) and not isinstance(original, bool)
                                         and original >= 1):
            raise ValueError(f"original_max_position_embeddings {original!r} must be a positive integer")
        for name in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor", "attention_factor"):
            value = getattr(self, name)
            if value is not None and not (_finite(value) and value > 0):  # logs and divisions by them
                raise ValueError(f"{name} {value!r} must be a finite number > 0")
        for name in ("mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if value is not None and not _finite(value):
                raise ValueError(f"{name} {value!r} must be a finite number")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"truncate {self.truncate!r} must be true or false")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"high_freq_factor {self.high_freq_factor} must be above low_freq_factor "
                             f"{self.low_freq_factor} (llama3 divides by their difference)")

    def context_length(self, max_position_embeddings: int) -> int:
        """The longest sequence the scaled positions serve (vLLM's rule): the original context
        times the factor, never less than max_position_embeddings."""
        if self.rope_type == "default":
            return max_position_embeddings
        original = self.original_max_position_embeddings or max_position_embeddings
        return max(max_position_embeddings, int(original * self.factor))

    def to_config(self, theta: float) -> dict[str, Any]:
        """config.json's rope_parameters (transformers 5) for this scaling and theta."""
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        if self.rope_type == "default":
            fields = {"rope_type": "default"}
        return {**fields, "rope_theta": theta}


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


NO_ROPE_SCALING = RopeScaling()  # a frozen default: ModelArgs shares it


def read_rope_scaling(params: dict[str, Any], where: str) -> RopeScaling:
    """A config's rope scaling dict (rope_scaling's "type" or rope_parameters' "rope_type"),
    refused with the field and the fix where duoka cannot compute it."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("dynamic", "longrope"):
        raise DuokaError(f"{where} asks for {rope_type!r} RoPE scaling, which duoka does not implement"
                         + (" (its frequencies change with the running length, so cached keys would not match)"
                            if rope_type == "dynamic" else ""),
                         "use rope_type 'yarn' (Qwen's recipe for long context: factor 4, "
                         "original_max_position_embeddings 32768), or remove the scaling")
    if rope_type not in ROPE_TYPES:
        raise DuokaError(f"{where} asks for {rope_type!r} RoPE scaling, which duoka does not know",
                         f"use one of {', '.join(ROPE_TYPES)}")
    known = {f for f in RopeScaling.__dataclass_fields__ if f != "rope_type"}
    values = {k: v for k, v in params.items() if k in known and v is not None}
    try:
        if rope_type != "default" and "factor" not in values:
            raise ValueError("factor is missing")
        return RopeScaling(rope_type=rope_type, **values)
    except (TypeError, ValueError) as e:
        raise DuokaError(f"{where}: {e}", "give the scaling's fields as transformers documents them (factor >= 1, "
                                          "the betas and frequency factors > 0), or restore config.json from the "
                                          "original checkpoint") from None


def _yarn(dim: int, theta: float, s: RopeScaling, original: int, device) -> tuple[torch.Tensor, float]:
    factor = s.factor
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
    else:
        attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(inv_freq: torch.Tensor, s: RopeScaling, original: int) -> torch.Tensor:
    low_wavelen, high_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                     max_position_embeddings: int = 32768, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] fp32 on `device`, the factor cos and sin are scaled by). Made on
    the device with no host copy, so a CUDA graph capture may run it."""
    s = scaling or RopeScaling()
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    original = s.original_max_position_embeddings or max_position_embeddings
    if s.rope_type == "default":
        return base, 1.0
    if s.rope_type == "linear":
        return base / s.factor, 1.0
    if s.rope_type == "yarn":
        return _yarn(head_dim, theta, s, original, device)
    return _llama3(base, s, original), 1.0


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: RopeScaling | None = None, max_position_embeddings: int = 32768):
    """cos/sin tables for the given positions, shape [..., seq, head_dim].

    Computed from positions on every call (a few KB) instead of a cached buffer, so there
    is no buffer to re-create after `to_empty` and packed sequences whose positions
    restart per document need nothing special. Angles are fp32, then cast, as in HF."""
    inv_freq, attention = rope_frequencies(head_dim, theta, scaling, max_position_embeddings, positions.device)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    if attention == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * attention).to(dtype), (emb.sin() * attention).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim] or [batch, seq, head_dim]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
