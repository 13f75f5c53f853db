"""Autoregressive generation with a static KV cache (the gpt-fast recipe: the cache lives on
the model's attention layers for the length of one generation).

The prompt is prefilled in one forward pass; each later step feeds one token per
sequence. Sampling stays on the device (no host sync to pick a token); the only sync per
step is the caller reading the token it streams, and the stop check. With
`compile=True` the one-token step is compiled with CUDA graphs ("reduce-overhead"),
which removes the per-kernel launch cost that dominates batch-1 decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from duoka.errors import DuokaError
from duoka.models.qwen2.model import KVCache, Qwen2


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    """0 means greedy (argmax); otherwise logits are divided by it before sampling."""
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise DuokaError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:  # nan passes `< 0`; inf samples uniformly
            raise DuokaError(f"temperature={self.temperature} must be a finite number >= 0",
                             "use 0 for greedy decoding, or e.g. 0.7 to sample")
        if self.top_k is not None and self.top_k < 1:
            raise DuokaError(f"top_k={self.top_k} must be >= 1", "leave it unset to sample from the whole vocabulary")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise DuokaError(f"top_p={self.top_p} must be in (0, 1]", "leave it unset (or 1.0) to disable nucleus sampling")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [batch, vocab] -> token ids [batch], without leaving the device."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        # Nucleus sampling (Holtzman et al., arXiv:1904.09751): keep the smallest set of
        # tokens whose probability mass reaches top_p; the most likely token always stays.
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    # argmax(p / E) with E ~ Exp(1) draws from p (the exponential-race trick) and, unlike
    # torch.multinomial, needs no host synchronisation.
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(dim=-1)


def _forward_step(model: Qwen2, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The last position's logits; with the caches set up, positions are the cache positions."""
    return model(tokens, positions=positions)[:, -1].float()


class Generator:
    """Holds a model and, when asked, its compiled decode step, for repeated calls."""

    def __init__(self, model: Qwen2, compile: bool = False):
        self.model = model.eval()
        self.compile = compile
        self._decode = _forward_step
        if compile:
            self._decode = torch.compile(_forward_step, mode="reduce-overhead", fullgraph=True)

    @torch.inference_mode()
    def stream(
        self,
        prompt: torch.Tensor,
        params: SamplingParams = SamplingParams(),
        stop_ids: set[int] | frozenset[int] = frozenset(),
        use_cache: bool = True,
    ) -> Iterator[torch.Tensor]:
        """Yield one [batch] tensor of new token ids per step until every sequence hit a
        stop id or max_new_tokens. A finished sequence keeps yielding its stop id."""
        model = self.model
        if prompt.dim() == 1:
            prompt = prompt[None]
        batch, prompt_len = prompt.shape
        if prompt_len == 0:
            raise DuokaError("the prompt is empty", "give at least one token of prompt")
        total = prompt_len + params.max_new_tokens
        if total > model.args.max_seq_len:
            raise DuokaError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} exceeds the "
                f"model's context of {model.args.max_seq_len} positions",
                "shorten the prompt or lower --max-new-tokens",
            )
        device = model.tok_embeddings.weight.device
        prompt = prompt.to(device)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        stops = torch.tensor(sorted(stop_ids), device=device, dtype=torch.long)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)

        # The caches exist for this generation only: afterwards (or once the caller stops
        # early) the model's forward is the plain one again.
        try:
            if use_cache:
                model.setup_kv_cache(batch, total, device=device)
                if self.compile:
                    for cache in model.modules():
                        if isinstance(cache, KVCache):  # CUDA graphs replay on these buffers
                            torch._dynamo.mark_static_address(cache.k)
                            torch._dynamo.mark_static_address(cache.v)
                logits = _forward_step(model, prompt, torch.arange(prompt_len, device=device))
                position = torch.tensor([prompt_len], device=device)
            else:
                sequence = prompt
                logits = model(sequence)[:, -1].float()

            for step in range(params.max_new_tokens):
                token = sample(logits, params, generator)
                if len(stops):
                    token = torch.where(finished, stops[0], token)
                    finished |= torch.isin(token, stops)
                yield token
                if step + 1 == params.max_new_tokens or (len(stops) and bool(finished.all())):
                    return
                if use_cache:
                    logits = self._decode(model, token[:, None], position)
                    position += 1
                else:
                    sequence = torch.cat([sequence, token[:, None]], dim=1)
                    logits = model(sequence)[:, -1].float()
        finally:
            model.clear_kv_cache()

    def generate(self, prompt: torch.Tensor, params: SamplingParams = SamplingParams(),
                 stop_ids: set[int] | frozenset[int] = frozenset(), use_cache: bool = True,
                 on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """All new tokens as [batch, n] (n <= max_new_tokens), stop ids included."""
        out = []
        for token in self.stream(prompt, params, stop_ids, use_cache):
            out.append(token)
            if on_token is not None:
                on_token(token)
        return torch.stack(out, dim=1)


class TextStream:
    """Turns a growing list of token ids into newly printable text.

    Byte-level BPE can split one character over several tokens; text is released only
    once it no longer ends in an incomplete UTF-8 sequence (decoded as U+FFFD)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[self.emitted:], len(text)
        return new

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        new, self.emitted = text[self.emitted:], len(text)
        return new
