"""Qwen2 as a plain single-device nn.Module.

Numerically the same model as transformers' Qwen2ForCausalLM (checked in
tests/unit/test_parity.py), laid out for parallelism the torchtitan way: no process
groups inside, layers in a ModuleDict with string keys (a pipeline stage builds only the
ones it owns, under their global names), built on the meta device and then materialised
with `to_empty` + `init_weights`, or filled from a checkpoint. How it runs (attention
kernels, fused projections, compiled bodies) is fixed at construction by ModelOptions.

Architecture (Qwen2 technical report, arXiv:2407.10671): pre-norm decoder blocks with
RMSNorm, grouped-query attention with biases on q/k/v, rotary position embeddings
(RoFormer, arXiv:2104.09864, "rotate-half" layout) and a SwiGLU MLP (arXiv:2002.05202).
"""

from __future__ import annotations

import contextlib
import inspect
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from duoka.models.compile import compiled
from duoka.models.loss import chunked_cross_entropy
from duoka.models.qwen2.args import DOCUMENT_MASKING, ModelArgs, ModelOptions


def write_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a full (unsharded) value into a parameter that may be a DTensor shard once
    the model is parallelized. Every rank holds the same full value, so each slices out
    its own shard locally (src_data_rank=None: no communication)."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            full = full.to(device=param.to_local().device, dtype=param.dtype)
            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                     src_data_rank=None).to_local())
        else:
            param.copy_(full)


class RMSNorm(nn.Module):
    """Root-mean-square norm (arXiv:1910.07467). The statistic is taken in fp32 and the
    result cast back before the weight multiply, exactly as transformers' Qwen2RMSNorm,
    so bf16 runs round at the same points."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for the given positions, shape [..., seq, head_dim].

    Computed from positions on every call (a few KB) instead of a cached buffer, so there
    is no buffer to re-create after `to_empty` and packed sequences whose positions
    restart per document need nothing special. Angles are fp32, then cast, as in HF."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim] or [batch, seq, head_dim]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class KVCache(nn.Module):
    """One attention layer's static key/value cache (gpt-fast style).

    Buffers are allocated once at [batch, kv_heads, max_len, head_dim] and written in
    place at the decoded positions; attention always reads the full buffer under a
    position mask. Shapes therefore never change from step to step, which keeps a compiled
    or CUDA-graph-captured decode step valid for the whole generation. The buffers are not
    persistent: a cache never enters a state_dict."""

    def __init__(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, device, dtype):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


def cache_mask(input_pos: torch.Tensor, max_len: int) -> torch.Tensor:
    """[query, key] boolean over a cache of max_len: a query at position p sees keys at positions <= p."""
    return torch.arange(max_len, device=input_pos.device)[None, :] <= input_pos[:, None]


# ---------------------------------------------------------------- document masking
# Packed pretraining windows hold several documents; a token attends only to earlier
# tokens of its own document. Three exact ways to run that, chosen by
# ModelOptions.document_masking (bench/results/attention_masking.md compares them):
#   sdpa:   a dense [batch, 1, seq, seq] boolean mask. Runs anywhere, but a mask rules out
#           the flash kernel, and the memory-efficient one still reads the mask.
#   flex:   flex attention with a block mask: fully masked tiles are skipped, so the cost
#           falls with the document length. Its kernel is generated by torch.compile.
#   varlen: flash attention over the concatenated documents (cumulative lengths), CUDA only.


@dataclass
class Varlen:
    """Documents of a packed batch as one concatenated sequence: document i is tokens
    cu_seqlens[i]:cu_seqlens[i+1] of the flattened [batch * seq] tokens."""
    cu_seqlens: torch.Tensor  # int32 [n_documents + 1]
    max_len: int


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """varlen's cumulative lengths: int32 [n_documents + 1] offsets into the flattened
    [batch * seq] tokens; a document starts where the id changes or a new row begins.
    Data-dependent in size, so the trainer computes it on the host, off the GPU's path."""
    bsz, seq = document_ids.shape
    flat = (document_ids + torch.arange(bsz, device=document_ids.device)[:, None] * seq).flatten()
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    end = torch.tensor([flat.numel()], device=flat.device)
    return torch.cat([torch.nonzero(starts).flatten(), end]).to(torch.int32)


def document_mask(document_ids: torch.Tensor, backend: str, cu_seqlens: torch.Tensor | None = None):
    """The per-forward mask object for `backend`, built once and shared by all layers.
    cu_seqlens (varlen only): document_starts(document_ids), if already computed."""
    bsz, seq = document_ids.shape
    if backend == "sdpa":
        causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
        return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]
    if backend == "flex":
        def same_document_causal(b, h, q, kv):
            return (document_ids[b, q] == document_ids[b, kv]) & (q >= kv)
        return create_block_mask(same_document_causal, bsz, None, seq, seq, device=document_ids.device)
    if backend == "varlen":
        # The longest document is bounded by seq without looking at the data (no sync).
        return Varlen(document_starts(document_ids) if cu_seqlens is None else cu_seqlens, seq)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {DOCUMENT_MASKING}")


def _flex(q: torch.Tensor):
    """flex attention must be compiled to run its fused kernel on GPU; on CPU (tests) the
    eager reference implementation is exact and needs no compiler."""
    return compiled(flex_attention, dynamic=False) if q.device.type == "cuda" else flex_attention


def _varlen_attention(q, k, v, mask: Varlen) -> torch.Tensor:
    """q, k, v: [batch, heads, seq, head_dim] -> [batch, seq, heads, head_dim]."""
    # Imported on first use: the module imports torch._dynamo, a second of start-up for
    # every process that never runs varlen (generation, CPU training).
    from torch.nn.attention.varlen import varlen_attn

    bsz, n_heads, seq, head_dim = q.shape
    if torch.is_autocast_enabled(q.device.type):
        # What autocast does for SDPA: attention runs in the autocast dtype. Under DDP's
        # autocast, q and k leave the rotary embedding in fp32 (the cos/sin tables follow the
        # fp32 residual stream), which flash varlen refuses.
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    q, k, v = (t.transpose(1, 2).reshape(bsz * seq, t.shape[1], head_dim) for t in (q, k, v))
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if k.shape[1] != n_heads:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(n_heads // t.shape[1], dim=1) for t in (k, v))
    out = varlen_attn(q, k, v, mask.cu_seqlens, mask.cu_seqlens, mask.max_len, mask.max_len, **kwargs)
    return out.view(bsz, seq, n_heads, head_dim)


def fusable(*linears: nn.Module) -> bool:
    """Whether these linear layers, which read the same input, can run as one matmul: plain
    nn.Linear on plain tensors. Under tensor parallelism the weights are DTensor shards (a
    concatenation along the sharded dimension would need communication) and float8 layers
    run their own matmuls, so both keep one matmul per layer."""
    return all(type(layer) is nn.Linear and not isinstance(layer.weight, DTensor) for layer in linears)


def fused_linear(x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """The outputs of several nn.Linear layers on the same input from one matmul over their
    concatenated weights. The parameters stay separate (checkpoints, TP plans and FSDP2
    units see the usual layout); only the product is shared. It pays where a layer is
    narrow: Qwen2's key and value projections have 2-4 KV heads (256 outputs at 1.5B),
    too few columns to fill a large GPU alone, in the forward and in both backward products.
    Each output column is the same dot product as before.
    The outputs are views of one buffer."""
    weight = torch.cat([layer.weight for layer in linears])
    bias = None if linears[0].bias is None else torch.cat([layer.bias for layer in linears])
    return F.linear(x, weight, bias).split([layer.weight.shape[0] for layer in linears], dim=-1)


SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def compiled_body(body, compile: bool):
    """`body` (a bound method holding a module's computation) as one fullgraph torch.compile
    region, or as it is. The module's forward calls it, so the hooks of that module
    (FSDP2's, tensor parallelism's, timers) and any wrapper around it stay outside the
    graph, and parameter names keep no `_orig_mod.` prefix."""
    return torch.compile(body, fullgraph=True) if compile else body


class Attention(nn.Module):
    """Grouped-query attention. Only x is positional in forward: the tensor-parallel plan
    lays out the first positional input and passes keyword arguments through untouched."""

    def __init__(self, args: ModelArgs, options: ModelOptions = ModelOptions()):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.resolved_head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=True)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=True)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=True)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.fuse_qkv = options.fuse_qkv  # q, k and v from one matmul where fusable(); see fused_linear
        # The one SDPA kernel for causal attention (None: PyTorch's choice), applied with
        # sdpa_kernel() inside the forward: torch.compile bakes a context manager's backend
        # into the graph and its cache key, but not the process-wide switches.
        self.sdpa_backend = SDPA_BACKENDS[options.sdpa_backend] if options.sdpa_backend else None
        self.kv_cache: KVCache | None = None  # set by Qwen2.setup_kv_cache for generation
        self._body = compiled_body(self._attend, options.compile == "parts")

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask=None,
                input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x [batch, seq, dim]; rope: (cos, sin); mask: None (causal), a document mask or a
        cache mask; input_pos: the cache positions of x's tokens when a cache is set up."""
        return self._body(x, rope, mask, input_pos)

    def _attend(self, x, rope, mask, input_pos):
        bsz, seqlen, _ = x.shape
        cos, sin = rope
        # -1 instead of the head count keeps this module correct when tensor parallelism
        # has sharded the projections and each rank holds only its share of the heads.
        if self.fuse_qkv and fusable(self.wq, self.wk, self.wv):
            q, k, v = fused_linear(x, self.wq, self.wk, self.wv)
            # Attention keeps v for its backward; as a view it would keep the whole q/k/v
            # buffer alive. q and k are replaced by their rotated copies below.
            v = v.contiguous()
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = q.shape[1] != k.shape[1]
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        if mask is None:  # plain causal attention: the fused kernels' fast path
            with sdpa_kernel(self.sdpa_backend) if self.sdpa_backend is not None else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif isinstance(mask, BlockMask):
            out = _flex(q)(q, k, v, block_mask=mask, enable_gqa=gqa)
        elif isinstance(mask, Varlen):
            return self.wo(_varlen_attention(q, k, v, mask).reshape(bsz, seqlen, -1))
        else:  # a cache's position mask, or SDPA's dense document mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is HF's gate_proj, w3 up_proj, w2 down_proj."""

    def __init__(self, dim: int, hidden: int, options: ModelOptions = ModelOptions()):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self._body = compiled_body(self._mlp, options.compile == "parts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._body(x)

    def _mlp(self, x):
        # Gate and up stay two matmuls: each is wide enough to fill the GPU alone, and one
        # matmul over both was slower.
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, options: ModelOptions = ModelOptions()):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, options)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.intermediate_size, options)
        self._body = compiled_body(self._block, options.compile == "block")

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask=None,
                input_pos: torch.Tensor | None = None) -> torch.Tensor:
        return self._body(x, rope, mask, input_pos)

    def _block(self, x, rope, mask, input_pos):
        x = x + self.attention(self.attention_norm(x), rope=rope, mask=mask, input_pos=input_pos)
        return x + self.feed_forward(self.ffn_norm(x))


@dataclass(frozen=True)
class StageSlice:
    """What one pipeline stage of the model holds: decoder layers [start, stop) under their
    global names; the embedding on the first stage; the final norm and head on the last,
    and there, for a tied model, the embedding too as the home of the shared weight."""
    start: int
    stop: int
    first: bool
    last: bool


class Qwen2(nn.Module):
    def __init__(self, args: ModelArgs, options: ModelOptions = ModelOptions(), stage: StageSlice | None = None):
        super().__init__()
        self.args = args
        self.options = options
        self.stage = stage
        start, stop = (0, args.n_layers) if stage is None else (stage.start, stage.stop)
        first = stage is None or stage.first
        last = stage is None or stage.last
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim) \
            if first or (last and args.tie_word_embeddings) else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, options) for i in range(start, stop)})
        self.norm = RMSNorm(args.dim, args.norm_eps) if last else None
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False) if last else None
        self.kv_cache_len = 0  # the caches' length while setup_kv_cache's caches are in place
        self.tie_weights()

    @property
    def takes_tokens(self) -> bool:
        """False for pipeline stages after the first: they receive the previous stage's
        hidden states (a tied last stage holds the embedding without calling it)."""
        return self.stage is None or self.stage.first

    def tie_weights(self):
        """Share the embedding with the output head (Qwen2 <= 3B). Call again after any
        operation that replaces parameters (to_empty, load_state_dict(assign=True))."""
        if self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        """Random init as transformers' Qwen2PreTrainedModel: normal(0, initializer_range)
        for linear and embedding weights, zero biases, unit norms.

        Each parameter's values are a function of (seed, its name) only, drawn in full and
        then written into whatever shard this rank holds. So a model initialises to the
        same weights on one process and under any DDP/FSDP layout, which is what lets the
        equivalence tests compare layouts step by step. Works after meta + to_empty."""
        self.tie_weights()
        std = self.args.initializer_range
        seen = set()
        for name, param in self.named_parameters():
            if id(param) in seen:  # the tied head was written with the embedding
                continue
            seen.add(id(param))
            local = param.to_local() if isinstance(param, DTensor) else param
            if name.endswith("norm.weight"):
                full = torch.ones(param.shape, device=local.device, dtype=torch.float32)
            elif name.endswith(".bias"):
                full = torch.zeros(param.shape, device=local.device, dtype=torch.float32)
            else:
                gen = torch.Generator(device=local.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full = torch.empty(param.shape, device=local.device, dtype=torch.float32).normal_(0.0, std, generator=gen)
            write_full_(param, full)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens: [batch, seq] -> logits [batch, seq, vocab] in the compute dtype, or with
        labels [batch, seq] the summed fp32 cross-entropy, computed chunk by chunk with the
        output head so the logits are never materialised (duoka.models.loss).

        positions: [seq] or [batch, seq]; defaults to 0..seq-1. With caches set up
        (setup_kv_cache), positions are where the tokens go in the caches (a [seq] tensor),
        and every query attends to all cached keys at or before its own position.
        document_ids: [batch, seq] for packed sequences: a token attends only to earlier
        tokens of its own document (give positions restarting per document too, see
        duoka.data.dataset.document_layout). cu_seqlens: document_starts(document_ids)
        precomputed, for the varlen backend."""
        h = self.tok_embeddings(tokens) if self.takes_tokens else tokens
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=h.device)
        rope = rope_cos_sin(positions, self.args.resolved_head_dim, self.args.rope_theta, h.dtype)
        mask, input_pos = None, None
        if self.kv_cache_len:
            mask, input_pos = cache_mask(positions, self.kv_cache_len), positions
        elif document_ids is not None:
            mask = document_mask(document_ids, self.options.document_masking, cu_seqlens)
        for layer in self.layers.values():
            h = layer(h, rope, mask=mask, input_pos=input_pos)
        if self.norm is not None:
            h = self.norm(h)
        if labels is not None:
            return chunked_cross_entropy(h, self.output.weight, labels, compiled=self.options.compile_loss)
        return self.output(h) if self.output is not None else h

    def setup_kv_cache(self, batch: int, max_len: int, device=None, dtype=None) -> None:
        """Give every attention layer a static KV cache of max_len positions (device and
        dtype default to the parameters'); forward then decodes into them."""
        p = next(self.parameters())
        for module in self.modules():
            if isinstance(module, Attention):
                module.kv_cache = KVCache(batch, max_len, self.args.n_kv_heads, self.args.resolved_head_dim,
                                          device or p.device, dtype or p.dtype)
        self.kv_cache_len = max_len

    def clear_kv_cache(self) -> None:
        """Drop the caches: forward is the plain (training and scoring) forward again."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.kv_cache = None
        self.kv_cache_len = 0


def build_model(args: ModelArgs, options: ModelOptions = ModelOptions(), device: str | torch.device = "meta",
                dtype: torch.dtype | None = None, stage: StageSlice | None = None) -> Qwen2:
    """Build with uninitialised storage on `device` (meta by default: no memory at all).

    On a real device call `init_weights()` or load a checkpoint next."""
    with torch.device(device):
        model = Qwen2(args, options, stage)
    if dtype is not None:
        model.to(dtype)
    return model


def materialize(model: Qwen2, device: str | torch.device, dtype: torch.dtype | None = None) -> Qwen2:
    """Give a meta-built model real (uninitialised) storage, keeping the tie.

    The dtype is set while still on meta, so storage is allocated once, in the final
    dtype: allocating fp32 first and casting would briefly need three times the bf16 size."""
    if dtype is not None:
        model.to(dtype)
    model.to_empty(device=device)
    model.tie_weights()
    return model


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

