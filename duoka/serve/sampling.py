"""Batched sampling on the device, each row with its own SamplingParams.

Order (as vLLM): token masks (structured output) -> logit_bias -> min_tokens (stop ids
blocked) -> penalties (repetition, then frequency and presence) -> logprobs from
log_softmax of the processed logits (before temperature, as vLLM's "raw" logprobs after
its logits processors) -> temperature -> min-p -> top-k -> top-p -> an exponential race.
Greedy rows take the argmax of the processed logits: masks, bias, min_tokens and penalties
apply to them too. Each stage runs only when some row of the batch asks for it (checked on
the host), so rows that ask for none of them pay nothing.

No row ends with every token at -inf (which would give NaN logprobs and a meaningless
draw): a mask that allows no token of the vocabulary is ignored for its row, and min_tokens
leaves the blocked ids to a row whose other tokens are all masked (a grammar that can only
end now). Then bias and penalties keep finite values finite, and min-p, top-k and top-p
always keep the most likely token. So a row picks a disallowed token only where every token
is disallowed.

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

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

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


def uniform_noise(keys: torch.Tensor) -> torch.Tensor:
    """U(0, 1), one per row key: keys int64 [S, 1] -> fp32 [S]. Output 0 of the key's
    SplitMix64 stream, which the race (outputs 1..V) never reads, so it is independent of the
    row's race noise: speculative decoding's acceptance test draws it."""
    z = _mix64_(keys[:, 0].clone())
    return _shr_logical(z, 1).float().mul_(_TWO_POW_M63).clamp_(_TWO_POW_M63, _V_MAX)


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
    prompt_ids: Sequence[int] = ()
    """The request's prompt (read for repetition_penalty only)."""
    blocked_ids: Sequence[int] = ()
    """The ids that cannot be sampled while output_index < params.min_tokens: the stop ids
    (the engine's eos unless ignore_eos, and stop_token_ids). Ids beyond the logits are skipped."""
    # Fixed for the request's life, so built once, not every step (a long prompt, 1024 biases):
    prompt_seen: array = field(init=False, repr=False)
    """The prompt's distinct ids, when repetition_penalty is on."""
    bias_ids: array = field(init=False, repr=False)
    bias_values: array = field(init=False, repr=False)

    def __post_init__(self):
        params = self.params
        self.prompt_seen = array("q", sorted(set(self.prompt_ids)) if params.repetition_penalty != 1 else ())
        self.bias_ids = array("q", (t for t, _ in params.logit_bias))
        self.bias_values = array("f", (b for _, b in params.logit_bias))


@dataclass(frozen=True)
class TokenMasks:
    """The tokens that constrained rows may take (structured output), in xgrammar's bitmask
    format: bit j of word w of a row allows token 32 * w + j. Bits for ids beyond the logits'
    width are ignored; a logits row wider than 32 * words has its remaining tokens disallowed."""

    rows: list[int]
    """Indices into the step's rows (and logits rows) that are constrained, each at most once."""
    bits: torch.Tensor
    """int32 [len(rows), words], on the host (uploaded without a sync) or already on the device."""

    def __post_init__(self):
        if self.bits.dtype != torch.int32 or self.bits.dim() != 2 or self.bits.shape[0] != len(self.rows):
            raise ValueError(f"mask bits {self.bits.dtype} {tuple(self.bits.shape)} must be int32 "
                             f"[{len(self.rows)} rows, words]")
        if len(set(self.rows)) != len(self.rows):
            raise ValueError(f"mask rows {self.rows} name a row twice")


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without a host sync: a plain .to(cuda) copies from
    pageable memory and waits for the stream."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def _flat_index(ids: array, lengths: list[int], V: int, device: torch.device) -> torch.Tensor:
    """Positions in a flattened [S, V] tensor: row r's lengths[r] ids, one after another in
    `ids`, become r * V + id. The ids go up flat (array.extend and frombuffer: ~20x faster than
    torch.tensor of nested lists), each row's count of them alongside."""
    flat = to_device(torch.frombuffer(ids, dtype=torch.int64), device)
    # output_size spares repeat_interleave the host sync that would size its output.
    row = torch.arange(len(lengths), device=device).repeat_interleave(_upload(lengths, torch.int64, device),
                                                                      output_size=len(ids))
    return row.mul_(V).add_(flat)


class HostCopy:
    """A device tensor copied to pinned host memory behind the device's work, without waiting;
    values() waits for it (a host synchronisation) and returns it as a list."""

    def __init__(self, packed: torch.Tensor):
        self.event = None
        if packed.device.type == "cuda":
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = packed

    def values(self) -> list:
        return self.array().tolist()

    def array(self):
        """The values as a numpy array (waits for the copy like values())."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()


class PendingSample:
    """A launched sampling step: its figures are copied to the host behind the device's work;
    result() waits for them (the step's one host synchronisation) and unpacks them."""

    def __init__(self, packed: torch.Tensor, asked: list[int | None], want: list[int], top_k: int):
        self.asked, self.want, self.top_k = asked, want, top_k
        self.rows = len(asked)
        self.copy = HostCopy(packed)

    def result(self) -> SampleResult:
        host = self.copy.values()  # token ids are exact in fp64
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

    def sample(self, logits: torch.Tensor, rows: list[SampleRow], masks: TokenMasks | None = None) -> SampleResult:
        """logits [S, V] (fp32, one row per entry of `rows`) -> a token per row, and the
        logprobs of the rows that ask for them. masks: the allowed tokens of constrained rows."""
        return self.launch(logits, rows, masks).result()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, rows: list[SampleRow], masks: TokenMasks | None = None) -> PendingSample:
        """sample()'s device work, queued without waiting for it: the host may do other work
        (the previous step's text) until PendingSample.result()."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if masks is not None and not all(0 <= i < len(rows) for i in masks.rows):
            raise ValueError(f"mask rows {masks.rows} are not all rows of this step's {len(rows)}")
        device = logits.device
        params = [r.params for r in rows]
        logits = self._process(logits, rows, masks)
        tokens = self.draw(logits, rows)

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

    def draw(self, processed: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """A token per row of processed logits (processed()): the argmax for greedy rows, the
        race for the others."""
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            return processed.argmax(dim=-1)
        tokens = self._race(processed, rows)
        if any(greedy):
            is_greedy = _upload(greedy, torch.bool, processed.device)
            tokens = torch.where(is_greedy, processed.argmax(dim=-1), tokens)
        return tokens

    def probabilities(self, processed: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The distribution draw() takes each row's token from, fp32 [S, V]: one-hot at the
        argmax for greedy rows; for the others the softmax of the temperature-scaled logits with
        min-p, top-k and top-p applied (speculative decoding's p and q)."""
        V = processed.shape[1]
        scaled = self._scaled(processed, rows)
        truncation = self._truncation(rows, V)
        if truncation is not None:
            sorted_logits, order = self._truncated_sorted(scaled, truncation)
            scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
        probs = scaled.softmax(dim=-1)
        greedy = [r.params.greedy for r in rows]
        if any(greedy):
            one_hot = torch.zeros_like(probs).scatter_(1, processed.argmax(dim=-1, keepdim=True), 1.0)
            probs = torch.where(_upload(greedy, torch.bool, processed.device)[:, None], one_hot, probs)
        return probs

    def race_log(self, log_weights: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """A token per row drawn in proportion to exp(log_weights) (unnormalised; -inf: never),
        with each row's own noise (its seed and output_index), as the race draws."""
        keys = self.row_keys(rows, log_weights.device)
        noise = _noise_fn(log_weights.device)(keys, self._vocab_ids(log_weights.shape[1], log_weights.device))
        return noise.neg_().add_(log_weights).argmax(dim=-1)

    @staticmethod
    def row_keys(rows: list[SampleRow], device: torch.device) -> torch.Tensor:
        """int64 [S, 1]: each row's key (row_key of its seed and output_index)."""
        return _upload([[_signed(row_key(r.seed, r.output_index))] for r in rows], torch.int64, device)

    def processed(self, logits: torch.Tensor, rows: list[SampleRow], masks: TokenMasks | None = None) -> torch.Tensor:
        """The logits draw() and probabilities() take, fp32: masks, logit_bias, min_tokens and
        penalties applied (before temperature); the caller's tensor is never written."""
        return self._process(logits, rows, masks)

    def _process(self, logits: torch.Tensor, rows: list[SampleRow], masks: TokenMasks | None) -> torch.Tensor:
        """Masks -> logit_bias -> min_tokens -> penalties, each only if a row of the batch asks
        for it. Returns fp32 logits; the caller's tensor is never written."""
        params = [r.params for r in rows]
        masked = masks is not None and len(masks.rows) > 0
        biased = any(p.logit_bias for p in params)
        blocking = [i for i, r in enumerate(rows) if r.blocked_ids and r.output_index < r.params.min_tokens]
        # The first three stages write in place, so on a copy; without them, no copy at all.
        logits = logits.to(torch.float32, copy=masked or biased or bool(blocking))
        if masked:
            self._mask(logits, masks)
        if biased:
            self._add_bias(logits, rows)
        if blocking:
            self._block(logits, rows, blocking)
        if any(p.has_penalties for p in params):
            logits = self._penalise(logits, rows)
        return logits

    def _mask(self, logits: torch.Tensor, masks: TokenMasks) -> None:
        """Disallowed tokens of the constrained rows -> -inf, in place; the other rows untouched.
        A row whose mask allows no token of the vocabulary keeps its logits: nothing can satisfy
        that mask, and a row all -inf would give NaN (the module docstring)."""
        V = logits.shape[1]
        device = logits.device
        index = _upload(masks.rows, torch.int64, device)
        bits = masks.bits if masks.bits.device == device else to_device(masks.bits, device)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        # Bit j of word w is token 32 * w + j; & 1 after the (arithmetic) shift reads bit 31 too.
        allowed = (bits[:, :, None] >> shifts).bitwise_and_(1).view(len(masks.rows), -1).bool()
        if allowed.shape[1] >= V:
            allowed = allowed[:, :V]
        else:  # a narrower mask disallows the rest of the row
            allowed = torch.cat([allowed, allowed.new_zeros(len(masks.rows), V - allowed.shape[1])], dim=1)
        allowed.logical_or_(~allowed.any(dim=1, keepdim=True))
        rows = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
        logits.index_copy_(0, index, rows)

    def _add_bias(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        """OpenAI's logit_bias: each (id, bias) of a row added to its raw logit, in place."""
        V = logits.shape[1]
        device = logits.device
        ids, values, lengths = array("q"), array("f"), []
        for r in rows:
            # The admission checks the ids against the vocabulary (RequestLimits.check); beyond
            # the row, an id would land in the next row's logits, so it is refused here too.
            if r.bias_ids and r.bias_ids[-1] >= V:  # sorted: the last is the largest
                raise ValueError(f"logit_bias token id {r.bias_ids[-1]} is beyond the {V} logits")
            ids.extend(r.bias_ids)
            values.extend(r.bias_values)
            lengths.append(len(r.bias_ids))
        flat = _flat_index(ids, lengths, V, device)
        logits.view(-1).index_add_(0, flat, to_device(torch.frombuffer(values, dtype=torch.float32), device))

    def _block(self, logits: torch.Tensor, rows: list[SampleRow], blocking: list[int]) -> None:
        """min_tokens: the blocked ids of the rows in `blocking` -> -inf, in place, except in a
        row where nothing else is left (a mask that allows only them): there they stay."""
        V = logits.shape[1]
        device = logits.device
        ids, lengths = array("q"), []
        for i in blocking:
            blocked = [t for t in rows[i].blocked_ids if t < V]  # a stop id beyond the logits is never sampled
            ids.extend(blocked)
            lengths.append(len(blocked))
        if not ids:
            return
        index = _upload(blocking, torch.int64, device)
        token = to_device(torch.frombuffer(ids, dtype=torch.int64), device)
        # Each entry's row among the blocking rows; its position there and in the whole logits.
        entry_row = torch.arange(len(blocking), device=device).repeat_interleave(
            _upload(lengths, torch.int64, device), output_size=len(ids))
        local = entry_row * V + token
        flat = index.index_select(0, entry_row).mul_(V).add_(token)
        sub = logits.index_select(0, index)
        sub.view(-1).index_fill_(0, local, float("-inf"))
        kept = sub.amax(dim=1) > float("-inf")  # the row has a token left besides the blocked ones
        old = logits.view(-1).index_select(0, flat)
        logits.view(-1).index_copy_(0, flat, old.masked_fill_(kept.index_select(0, entry_row), float("-inf")))

    def _penalise(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Repetition penalty (vLLM's and transformers': a token in the prompt or the output so
        far has its logit divided by p if > 0, else multiplied by p), then OpenAI's formula:
        logit - presence * (count > 0) - frequency * count, with count the times the token occurs
        in this request's output so far. Rows without penalties send no ids."""
        S, V = logits.shape
        device = logits.device
        out_ids, out_lengths, seen_ids, seen_lengths = array("q"), [], array("q"), []
        for r in rows:
            n = len(r.output_ids) if r.params.has_penalties else 0
            out_ids.extend(r.output_ids if n else ())
            out_lengths.append(n)
            seen_ids.extend(r.prompt_seen)  # empty unless the row has a repetition penalty
            seen_lengths.append(len(r.prompt_seen))
        counts = None
        if out_ids:
            counts = torch.zeros(S, V, device=device)
            counts.view(-1).index_add_(0, _flat_index(out_ids, out_lengths, V, device),
                                       torch.ones(len(out_ids), device=device))
        params = [r.params for r in rows]
        if any(p.repetition_penalty != 1 for p in params) and (counts is not None or seen_ids):
            seen = counts > 0 if counts is not None else torch.zeros(S, V, dtype=torch.bool, device=device)
            if seen_ids:
                seen.view(-1).index_fill_(0, _flat_index(seen_ids, seen_lengths, V, device), True)
            # Division, not multiplication by 1 / p: the same rounding as transformers and vLLM.
            p = _upload([[q.repetition_penalty] for q in params], torch.float32, device)
            logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
        if counts is None or not any(p.presence_penalty or p.frequency_penalty for p in params):
            return logits
        coefs = _upload([[p.presence_penalty, p.frequency_penalty] for p in params], torch.float32, device)
        penalised = logits - coefs[:, 1:] * counts
        return penalised.sub_(coefs[:, :1] * (counts > 0))

    def _race(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p and the exponential race for every row (greedy rows
        take a dummy temperature of 1 and are replaced by the caller)."""
        V = logits.shape[1]
        device = logits.device
        keys = self.row_keys(rows, device)
        scaled = self._scaled(logits, rows)
        truncation = self._truncation(rows, V)
        if truncation is None:
            return _noise_fn(device)(keys, self._vocab_ids(V, device)).neg_().add_(scaled).argmax(dim=-1)
        # The race runs in sorted order, each entry with the noise of its own vocabulary id.
        sorted_logits, order = self._truncated_sorted(scaled, truncation)
        del scaled
        winner = _noise_fn(device)(keys, order).neg_().add_(sorted_logits).argmax(dim=-1, keepdim=True)
        return order.gather(1, winner)[:, 0]

    @staticmethod
    def _scaled(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Temperature and min-p: a new [S, V] tensor (greedy rows at a dummy temperature of 1)."""
        device = logits.device
        params = [r.params for r in rows]
        temps = _upload([p.temperature or 1.0 for p in params], torch.float32, device)
        # Subtracting the row max first keeps every value <= 0, so a tiny temperature gives
        # -inf at worst, never inf - inf; the clamp keeps an fp32-underflowing one above 0.
        # In-place steps below: each [S, V] temporary is a large allocation at a big batch.
        scaled = logits.sub(logits.amax(dim=-1, keepdim=True))
        scaled.div_(temps.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
        # min-p: p_i < min_p * p_max, with p_i / p_max = exp(scaled_i) since the row's max is 0
        # now, is scaled_i < log(min_p); no softmax needed. The most likely token (0) stays.
        min_p = [math.log(p.min_p) if p.min_p > 0 and not p.greedy else float("-inf") for p in params]
        if any(m != float("-inf") for m in min_p):
            scaled.masked_fill_(scaled < _upload([[m] for m in min_p], torch.float32, device), float("-inf"))
        return scaled

    @staticmethod
    def _truncation(rows: list[SampleRow], V: int) -> tuple[list[int], list[float]] | None:
        """Each row's top-k (V: off) and top-p (inf: off), or None when no row truncates."""
        params = [r.params for r in rows]
        top_k = [p.top_k if 0 < p.top_k < V and not p.greedy else V for p in params]
        top_p = [p.top_p if p.top_p < 1 and not p.greedy else float("inf") for p in params]
        if all(k == V for k in top_k) and all(p == float("inf") for p in top_p):
            return None
        return top_k, top_p

    def _truncated_sorted(self, scaled: torch.Tensor,
                          truncation: tuple[list[int], list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted logits with top-k and top-p applied, the sort's order). One descending sort
        serves every row's k and p: top-k masks ranks >= k, top-p then keeps the smallest prefix
        whose mass reaches p (the most likely token always stays)."""
        V = scaled.shape[1]
        device = scaled.device
        top_k, top_p = truncation
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ks = _upload([[k] for k in top_k], torch.int64, device)
        sorted_logits.masked_fill_(self._vocab_ids(V, device) >= ks, float("-inf"))
        if any(p != float("inf") for p in top_p):
            ps = _upload([[p] for p in top_p], torch.float32, device)
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1).sub_(probs)
            del probs
            sorted_logits.masked_fill_(mass_before >= ps, float("-inf"))
            del mass_before
        return sorted_logits, order
