"""Batched sampling on the device, each row with its own SamplingParams.

Order (as OpenAI and vLLM): presence/frequency penalties on the raw logits -> logprobs
from log_softmax of the penalised logits (vLLM's default "raw" logprobs, before
temperature) -> temperature -> top-k -> top-p -> an exponential race.

The race: argmax_i p_i / E_i with E_i ~ Exp(1) independent is a draw from p (the
Gumbel-max trick in another form), and needs no host synchronisation, unlike
torch.multinomial. It is taken in log space, argmax_i (logit_i / T - log E_i), which is
the same argmax without a softmax (no reduction whose rounding could depend on the batch)
and without underflow. E_i comes from a counter-based hash of (seed, output_index,
vocabulary index) and nothing else, so a seeded request draws the same tokens whatever
batch it shares and in whatever row; there is no torch.Generator per row.

One host synchronisation per call: the per-row tensors go up by non-blocking copies from
pinned memory, and everything that comes back (token ids, logprobs) is packed into one
tensor read with one `.tolist()`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from duoka.models.compiled_functions import compiled
from duoka.serve.params import SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1
# SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
# OOPSLA 2014): the stream's increment and the finaliser's multipliers.
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# The uniform is taken from 63 hash bits converted to fp32, which keeps 24 significant
# bits at every scale: values near 0 (E near 0, the tokens that win the race) are resolved
# as finely as the rest. The clamp keeps it in (0, 1): v = 0 would make E = 0 and log E = -inf.
_TWO_POW_M63 = 2.0**-63
_V_MAX = 1.0 - 2.0**-24  # the largest fp32 below 1


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 value torch stores for it."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def mix64(x: int) -> int:
    """SplitMix64's finaliser on a Python int (exact 64-bit arithmetic); the reference for
    `_mix64_` below."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, output_index: int) -> int:
    """The 64-bit key of one sampling step of one request. mix64 is a bijection, so for a
    given seed each output index gets its own key."""
    return mix64(mix64(seed) + output_index)


def _shr_logical(x: torch.Tensor, s: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic (copies the sign bit); masking gives the logical shift.
    return (x >> s).bitwise_and_((1 << (64 - s)) - 1)


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """mix64 in place on an int64 tensor: int64 multiplication wraps modulo 2**64 on CPU and
    CUDA, which is exactly the unsigned arithmetic SplitMix64 wants."""
    z.bitwise_xor_(_shr_logical(z, 30)).mul_(_signed(_MIX1))
    z.bitwise_xor_(_shr_logical(z, 27)).mul_(_signed(_MIX2))
    return z.bitwise_xor_(_shr_logical(z, 31))


def log_exponential_noise(keys: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """log E for E ~ Exp(1), one per (row key, vocabulary id): keys int64 [S, 1], vocab_ids
    int64 [S, V] or [1, V] -> fp32 [S, V]. Element (r, i) is output vocab_ids[r, i] + 1 of
    the SplitMix64 stream seeded with keys[r], so it depends on nothing else."""
    z = _mix64_((vocab_ids.expand(keys.shape[0], -1) + 1).mul_(_signed(_GAMMA)).add_(keys))
    v = _shr_logical(z, 1).float().mul_(_TWO_POW_M63).clamp_(_TWO_POW_M63, _V_MAX)
    return v.neg_().log1p_().neg_().log_()  # E = -log(1 - v), fine-grained near 0 through log1p


def _noise_fn(device: torch.device):
    """On CUDA the ~20 element-wise passes over [S, V] fuse into one kernel (3.3 ms -> 0.2 ms
    at 256 x 152k on an H200, bitwise equal to eager); on CPU inductor would need a C++
    compiler for a cost that matters little there."""
    if device.type == "cuda":
        return compiled(log_exponential_noise, dynamic=True, fullgraph=True)
    return log_exponential_noise


@dataclass
class SampleRow:
    params: SamplingParams
    seed: int
    """Resolved: the request's seed, or the one the engine drew at admission."""
    output_index: int
    """How many tokens this request has generated so far: step i's noise depends only on (seed, i)."""
    output_ids: list[int]
    """The request's generated tokens (read for penalties only)."""


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without a host sync: a plain .to(cuda) copies from
    pageable memory and waits for the stream."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _to_device(torch.tensor(values, dtype=dtype), device)


class PendingSample:
    """A launched sampling step: its figures are copied to the host behind the device's work;
    result() waits for them (the step's one host synchronisation) and unpacks them."""

    def __init__(self, packed: torch.Tensor, asked: list[int | None], want: list[int], top_k: int):
        self.asked, self.want, self.top_k = asked, want, top_k
        self.rows = len(asked)
        self.event = None
        if packed.device.type == "cuda":
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = packed

    def result(self) -> SampleResult:
        if self.event is not None:
            self.event.synchronize()
        host = self.host.tolist()  # token ids are exact in fp64
        S, want, top_k = self.rows, self.want, self.top_k
        token_ids = [int(t) for t in host[:S]]
        result: list[TokenLogprob | None] = [None] * S
        n = len(want)
        values, ids = host[S + n:S + n + n * top_k], host[S + n + n * top_k:]
        for j, i in enumerate(want):
            k = self.asked[i]
            row = slice(j * top_k, j * top_k + k)
            result[i] = TokenLogprob(token_ids[i], host[S + j], [(int(t), v) for t, v in zip(ids[row], values[row])])
        return SampleResult(token_ids, result)


class Sampler:
    """Stateless apart from a cached vocabulary index; one instance serves every step."""

    def __init__(self):
        self._arange: torch.Tensor | None = None

    def _vocab_ids(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._arange is None or self._arange.shape[1] != vocab or self._arange.device != device:
            self._arange = torch.arange(vocab, device=device)[None]
        return self._arange

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        """logits [S, V] (fp32, one row per entry of `rows`) -> a token per row, and the
        logprobs of the rows that ask for them."""
        return self.launch(logits, rows).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, rows: list[SampleRow]) -> PendingSample:
        """sample()'s device work, queued without waiting for it: the host may do other work
        (the previous step's text) until PendingSample.result()."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        logits = logits.float()
        device = logits.device
        params = [r.params for r in rows]

        if any(p.has_penalties for p in params):
            logits = self._penalise(logits, rows)

        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._race(logits, rows)
            if any(greedy):
                is_greedy = _upload(greedy, torch.bool, device)
                tokens = torch.where(is_greedy, logits.argmax(dim=-1), tokens)

        # Logprobs: only the rows that ask pay for a log_softmax over the vocabulary.
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        packed = [tokens.double()]
        top_k = max((params[i].logprobs for i in want), default=0)
        if want:
            index = _upload(want, torch.int64, device)
            logprobs = torch.log_softmax(logits.index_select(0, index), dim=-1)
            packed.append(logprobs.gather(1, tokens.index_select(0, index)[:, None])[:, 0].double())
            if top_k:
                top_values, top_ids = logprobs.topk(top_k, dim=-1)  # sorted, most likely first
                packed += [top_values.double().flatten(), top_ids.double().flatten()]
        return PendingSample(torch.cat(packed), [p.logprobs for p in params], want, top_k)

    def _penalise(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """OpenAI's formula: logit - presence * (count > 0) - frequency * count, with count the
        times the token occurs in this request's output so far."""
        S, V = logits.shape
        device = logits.device
        # The ids go up flat (array.extend and frombuffer: ~20x faster than torch.tensor of
        # nested lists), each row's count of them alongside; rows without penalties send none.
        ids = array("q")
        lengths = []
        for r in rows:
            n = len(r.output_ids) if r.params.has_penalties else 0
            ids.extend(r.output_ids if n else ())
            lengths.append(n)
        if not ids:
            return logits
        flat = _to_device(torch.frombuffer(ids, dtype=torch.int64), device)
        # output_size spares repeat_interleave the host sync that would size its output.
        row = torch.arange(S, device=device).repeat_interleave(_upload(lengths, torch.int64, device), output_size=len(ids))
        counts = torch.zeros(S, V, device=device)
        counts.view(-1).index_add_(0, row.mul_(V).add_(flat), torch.ones(len(ids), device=device))
        coefs = _upload([[r.params.presence_penalty, r.params.frequency_penalty] for r in rows], torch.float32, device)
        penalised = logits - coefs[:, 1:] * counts
        return penalised.sub_(coefs[:, :1] * (counts > 0))

    def _race(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Temperature, top-k, top-p and the exponential race for every row (greedy rows take a
        dummy temperature of 1 and are replaced by the caller)."""
        V = logits.shape[1]
        device = logits.device
        params = [r.params for r in rows]
        keys = _upload([[_signed(row_key(r.seed, r.output_index))] for r in rows], torch.int64, device)
        top_k = [p.top_k if 0 < p.top_k < V and not p.greedy else V for p in params]
        top_p = [p.top_p if p.top_p < 1 and not p.greedy else float("inf") for p in params]
        temps = _upload([p.temperature or 1.0 for p in params], torch.float32, device)
        # Subtracting the row max first keeps every value <= 0, so a tiny temperature gives
        # -inf at worst, never inf - inf; the clamp keeps an fp32-underflowing one above 0.
        # In-place steps below: each [S, V] temporary is a large allocation at a big batch.
        scaled = logits.sub(logits.amax(dim=-1, keepdim=True))
        scaled.div_(temps.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
        if all(k == V for k in top_k) and all(p == float("inf") for p in top_p):
            return _noise_fn(device)(keys, self._vocab_ids(V, device)).neg_().add_(scaled).argmax(dim=-1)

        # One descending sort serves every row's k and p: top-k masks ranks >= k, top-p then
        # keeps the smallest prefix whose mass reaches p (the most likely token always stays).
        # The race runs in sorted order, each entry with the noise of its own vocabulary id.
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        del scaled
        ks = _upload([[k] for k in top_k], torch.int64, device)
        sorted_logits.masked_fill_(self._vocab_ids(V, device) >= ks, float("-inf"))
        if any(p != float("inf") for p in top_p):
            ps = _upload([[p] for p in top_p], torch.float32, device)
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1).sub_(probs)
            del probs
            sorted_logits.masked_fill_(mass_before >= ps, float("-inf"))
            del mass_before
        winner = _noise_fn(device)(keys, order).neg_().add_(sorted_logits).argmax(dim=-1, keepdim=True)
        return order.gather(1, winner)[:, 0]
