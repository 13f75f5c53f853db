"""Qwen2 as a plain single-device nn.Module.

Numerically the same model as transformers' Qwen2ForCausalLM (checked in
tests/unit/test_parity.py) and Qwen2MoeForCausalLM (tests/unit/test_moe_model.py), laid
out for parallelism the torchtitan way: no process groups inside, layers in a ModuleDict
with string keys (a pipeline stage builds only the ones it owns, under their global
names), built on the meta device and then materialised with `to_empty` + `init_weights`,
or filled from a checkpoint. How it runs (attention kernels, fused projections, compiled
bodies, the MoE expert matmuls) is fixed at construction by ModelOptions; LoRA adapters
(duoka.models.lora), which change what it computes and trains, by LoRAArgs.

Architecture (Qwen2 technical report, arXiv:2407.10671): pre-norm decoder blocks with
RMSNorm, grouped-query attention with biases on q/k/v, rotary position embeddings
(RoFormer, arXiv:2104.09864, "rotate-half" layout) and a SwiGLU MLP (arXiv:2002.05202);
in a MoE model (Qwen2-MoE, transformers' Qwen2MoeForCausalLM) the MLP of the layers
ModelArgs.is_moe_layer names is duoka.models.qwen2.moe's sparse one.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from duoka.models.compiled_functions import compiled
from duoka.models.lora import (
    LoRAArgs,
    LoRALinear,
    adapter_init,
    freeze_base,
    is_adapter,
    linear,
    quantize_weight_,
)
from duoka.models.loss import IGNORE_INDEX, chunked_cross_entropy
from duoka.models.qwen2.args import DOCUMENT_MASKING, ModelArgs, ModelOptions
from duoka.models.qwen2.moe import MoE, RoutingRecorder, RoutingStats, load_balancing_loss
from duoka.models.qwen2.paged import PagedBatch, causal_varlen, paged_attention


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
    bsz, n_heads, seq, head_dim = q.shape
    if torch.is_autocast_enabled(q.device.type):
        # What autocast does for SDPA: attention runs in the autocast dtype. Under DDP's
        # autocast, q and k leave the rotary embedding in fp32 (the cos/sin tables follow the
        # fp32 residual stream), which flash varlen refuses.
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    q, k, v = (t.transpose(1, 2).reshape(bsz * seq, t.shape[1], head_dim) for t in (q, k, v))
    out = causal_varlen(q, k, v, mask.cu_seqlens, mask.cu_seqlens, mask.max_len, mask.max_len)
    return out.view(bsz, seq, n_heads, head_dim)


def fusable(*linears: nn.Module) -> bool:
    """Whether these linear layers, which read the same input, can run as one matmul: plain
    nn.Linear (or LoRALinear, whose base weights fuse and whose adapters run apart) on plain
    tensors. Under tensor parallelism the weights are DTensor shards (a concatenation along
    the sharded dimension would need communication), float8 layers run their own matmuls,
    and NF4 weights (QLoRA) would be dequantised into one concatenation kept for backward,
    so each keeps one matmul per layer."""
    return all(type(layer) in (nn.Linear, LoRALinear) and type(layer.weight) in (torch.Tensor, nn.Parameter)
               for layer in linears)


def fused_linear(x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """The outputs of several nn.Linear layers on the same input from one matmul over their
    concatenated weights. The parameters stay separate (checkpoints, TP plans and FSDP2
    units see the usual layout); only the product is shared. It pays where a layer is
    narrow: Qwen2's key and value projections have 2-4 KV heads (256 outputs at 1.5B),
    too few columns to fill a large GPU alone, in the forward and in both backward products.
    Each output column is the same dot product as before.
    The outputs are views of one buffer, except a LoRA layer's, which adds its adapter's share."""
    weight = torch.cat([layer.weight for layer in linears])
    bias = None if linears[0].bias is None else torch.cat([layer.bias for layer in linears])
    outs = F.linear(x, weight, bias).split([layer.weight.shape[0] for layer in linears], dim=-1)
    return tuple(out + layer.delta(x) if isinstance(layer, LoRALinear) else out for out, layer in zip(outs, linears))


SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def compiled_body(body, compile: bool, dynamic: bool = False):
    """`body` (a bound method holding a module's computation) as one fullgraph torch.compile
    region, or as it is. The module's forward calls it, so the hooks of that module
    (FSDP2's, tensor parallelism's, timers) and any wrapper around it stay outside the
    graph, and parameter names keep no `_orig_mod.` prefix."""
    return torch.compile(body, fullgraph=True, dynamic=True if dynamic else None) if compile else body


class Attention(nn.Module):
    """Grouped-query attention. Only x is positional in forward: the tensor-parallel plan
    lays out the first positional input and passes keyword arguments through untouched."""

    def __init__(self, args: ModelArgs, options: ModelOptions = ModelOptions(), lora: LoRAArgs | None = None):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.resolved_head_dim
        q_out, kv_out = args.n_heads * self.head_dim, args.n_kv_heads * self.head_dim
        self.packed = options.packed_projections
        if self.packed:
            self.wqkv = nn.Linear(args.dim, q_out + 2 * kv_out, bias=True)
            self.qkv_split = (q_out, kv_out, kv_out)
        else:
            self.wq = linear(args.dim, q_out, True, lora, "q_proj")
            self.wk = linear(args.dim, kv_out, True, lora, "k_proj")
            self.wv = linear(args.dim, kv_out, True, lora, "v_proj")
        self.wo = linear(args.n_heads * self.head_dim, args.dim, False, lora, "o_proj")
        self.fuse_qkv = options.fuse_qkv  # q, k and v from one matmul where fusable(); see fused_linear
        # The one SDPA kernel for causal attention (None: PyTorch's choice), applied with
        # sdpa_kernel() inside the forward: torch.compile bakes a context manager's backend
        # into the graph and its cache key, but not the process-wide switches.
        self.sdpa_backend = SDPA_BACKENDS[options.sdpa_backend] if options.sdpa_backend else None
        self._body = compiled_body(self._attend, options.compile == "parts", options.compile_dynamic)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask=None) -> torch.Tensor:
        """x [batch, seq, dim]; rope: (cos, sin); mask: None (causal), a document mask, or a
        serving step's PagedBatch for this layer (x is then the step's tokens as one row)."""
        return self._body(x, rope, mask)

    def _attend(self, x, rope, mask):
        bsz, seqlen, _ = x.shape
        cos, sin = rope
        # -1 instead of the head count keeps this module correct when tensor parallelism
        # has sharded the projections and each rank holds only its share of the heads.
        if self.packed:
            q, k, v = self.wqkv(x).split(self.qkv_split, dim=-1)
        elif self.fuse_qkv and fusable(self.wq, self.wk, self.wv):
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
        if isinstance(mask, PagedBatch):
            return self.wo(paged_attention(q, k, v, mask))
        if mask is None:  # plain causal attention: the fused kernels' fast path
            with sdpa_kernel(self.sdpa_backend) if self.sdpa_backend is not None else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif isinstance(mask, BlockMask):
            out = _flex(q)(q, k, v, block_mask=mask, enable_gqa=gqa)
        elif isinstance(mask, Varlen):
            return self.wo(_varlen_attention(q, k, v, mask).reshape(bsz, seqlen, -1))
        else:  # SDPA's dense document mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is HF's gate_proj, w3 up_proj, w2 down_proj."""

    def __init__(self, dim: int, hidden: int, options: ModelOptions = ModelOptions(), lora: LoRAArgs | None = None):
        super().__init__()
        self.packed = options.packed_projections
        if self.packed:  # gate rows first, then up (see ModelOptions.packed_projections)
            self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        else:
            self.w1 = linear(dim, hidden, False, lora, "gate_proj")
            self.w3 = linear(dim, hidden, False, lora, "up_proj")
        self.w2 = linear(hidden, dim, False, lora, "down_proj")
        self._body = compiled_body(self._mlp, options.compile == "parts", options.compile_dynamic)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._body(x)

    def _mlp(self, x):
        if self.packed:
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        # Gate and up stay two matmuls in training: each is wide enough to fill the GPU
        # alone, and one matmul over both was slower.
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def sparse_mlp(args: ModelArgs, options: ModelOptions) -> MoE:
    """A MoE layer's MLP. Its shared expert is a FeedForward (named, loaded and packed as a
    dense MLP) run inside the MoE body, so it compiles with it, never on its own."""
    shared = FeedForward(args.dim, args.shared_expert_intermediate_size, options.replace(compile="none"))
    return MoE(args.dim, args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size,
               args.norm_topk_prob, shared, options.moe_gemm)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, options: ModelOptions = ModelOptions(), layer_id: int = 0,
                 lora: LoRAArgs | None = None, routing: RoutingRecorder | None = None):
        """routing: where a MoE layer's routing statistics go (the model's recorder; None:
        dropped). A dense layer ignores it."""
        super().__init__()
        self.layer_id = layer_id  # which of a serving step's per-layer caches is this layer's
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, options, lora)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.sparse = args.is_moe_layer(layer_id)
        self.routing = routing if self.sparse else None
        self.feed_forward = sparse_mlp(args, options) if self.sparse else \
            FeedForward(args.dim, args.intermediate_size, options, lora)
        self._body = compiled_body(self._block, options.compile == "block", options.compile_dynamic)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask=None) -> torch.Tensor:
        if isinstance(mask, PagedBatch):
            mask = mask.for_layer(self.layer_id)
        if not self.sparse:
            return self._body(x, rope, mask)
        # Recorded here, outside the compiled body: the graph shared by all blocks neither
        # sees the layer's id nor mutates the recorder.
        h, stats = self._body(x, rope, mask)
        if self.routing is not None:
            self.routing.record(self.layer_id, stats)
        return h

    def _block(self, x, rope, mask):
        x = x + self.attention(self.attention_norm(x), rope=rope, mask=mask)
        if self.sparse:
            out, stats = self.feed_forward(self.ffn_norm(x))
            return x + out, stats
        return x + self.feed_forward(self.ffn_norm(x))

    def base_linears(self) -> tuple[nn.Linear, ...]:
        """The block's seven projections (q, k, v, o, gate, up, down): what QLoRA quantizes."""
        attention, mlp = self.attention, self.feed_forward
        return attention.wq, attention.wk, attention.wv, attention.wo, mlp.w1, mlp.w3, mlp.w2


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
    def __init__(self, args: ModelArgs, options: ModelOptions = ModelOptions(), stage: StageSlice | None = None,
                 lora: LoRAArgs | None = None):
        """lora: adapters on the targeted linear layers, and every other parameter frozen
        but the modules to save (duoka.models.lora)."""
        super().__init__()
        if lora is not None and options.packed_projections:
            raise ValueError("packed projections are for inference and take no adapters: merge the adapter into "
                             "the weights instead (duoka.models.qwen2.peft.merge_adapter)")
        if lora is not None and args.num_experts:
            raise ValueError("LoRA adapters on a mixture-of-experts model are not supported")
        self.args = args
        self.options = options
        self.stage = stage
        self.lora = lora
        start, stop = (0, args.n_layers) if stage is None else (stage.start, stage.stop)
        first = stage is None or stage.first
        last = stage is None or stage.last
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim) \
            if first or (last and args.tie_word_embeddings) else None
        # A MoE model's blocks hand their routing statistics to this recorder during forward.
        self.routing = RoutingRecorder() if args.num_experts else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, options, i, lora, self.routing)
                                     for i in range(start, stop)})
        self.norm = RMSNorm(args.dim, args.norm_eps) if last else None
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False) if last else None
        self.tie_weights()
        if lora is not None:
            saved = {"embed_tokens": self.tok_embeddings, "lm_head": self.output}
            freeze_base(self, {name: saved[name] for name in lora.modules_to_save})

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
    def init_weights(self, seed: int = 0, adapters_only: bool = False):
        """Random init as transformers' Qwen2PreTrainedModel: normal(0, initializer_range)
        for linear and embedding weights, zero biases, unit norms; LoRA adapters as PEFT
        (duoka.models.lora.adapter_init). adapters_only: the adapters of a base loaded
        from a checkpoint.

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
            if adapters_only and not is_adapter(name):
                continue
            # The plain model's name: activation checkpointing's wrapper must not change the values.
            name = name.replace("_checkpoint_wrapped_module.", "")
            local = param.to_local() if isinstance(param, DTensor) else param
            gen = torch.Generator(device=local.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if is_adapter(name):
                full = adapter_init(name, param.shape, local.device, gen)
            elif name.endswith("norm.weight"):
                full = torch.ones(param.shape, device=local.device, dtype=torch.float32)
            elif name.endswith(".bias"):
                full = torch.zeros(param.shape, device=local.device, dtype=torch.float32)
            else:
                full = torch.empty(param.shape, device=local.device, dtype=torch.float32).normal_(0.0, std, generator=gen)
            write_full_(param, full)

    def quantize_base_(self) -> None:
        """QLoRA (LoRAArgs.quantize): every decoder block's linear weights, once loaded or
        initialised, replaced layer by layer by their NF4 form (duoka.models.lora), each
        bf16 weight released as its replacement is set. The adapters, biases, norms, the
        embedding and the head keep their dtype. Before any parallel wrapper: FSDP2 then
        shards the NF4 tensors as torchao lays them out."""
        if self.lora is None or not self.lora.quantized:
            raise ValueError("quantize_base_ is for a model built with LoRAArgs(quantize=...)")
        for block in self.layers.values():
            for layer in block.base_linears():
                quantize_weight_(layer)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        paged: PagedBatch | None = None,
        with_router_aux: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """tokens: [batch, seq] -> logits [batch, seq, vocab] in the compute dtype, or with
        labels [batch, seq] the summed fp32 cross-entropy, computed chunk by chunk with the
        output head so the logits are never materialised (duoka.models.loss); for a MoE
        model whose config sets output_router_logits, plus its router's load-balancing term
        (router_aux_loss) times the target tokens, so that dividing by them gives
        transformers' loss: mean cross-entropy + router_aux_loss_coef x aux.
        with_router_aux (without labels): (logits, router_aux_loss), the term as a 0-d fp32
        tensor (zero where the model has none), for a caller that computes the loss itself.

        positions: [seq] or [batch, seq]; defaults to 0..seq-1.
        document_ids: [batch, seq] for packed sequences: a token attends only to earlier
        tokens of its own document (give positions restarting per document too, see
        duoka.data.dataset.document_layout). cu_seqlens: document_starts(document_ids)
        precomputed, for the varlen backend. paged: a serving step (duoka.models.qwen2.paged):
        tokens [1, T] with their context positions [T]; returns the logits [S, vocab] of the
        rows paged.logits_indices only, so a long prefill never materialises T x vocab."""
        h = self.tok_embeddings(tokens) if self.takes_tokens else tokens
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=h.device)
        rope = rope_cos_sin(positions, self.args.resolved_head_dim, self.args.rope_theta, h.dtype)
        mask = paged
        if document_ids is not None:
            mask = document_mask(document_ids, self.options.document_masking, cu_seqlens)
        h, routing = self._layers(h, rope, mask)
        aux = self.router_aux_loss(routing) if labels is not None or with_router_aux else None
        if paged is not None and self.norm is not None:
            h = h[0, paged.logits_indices]
        if self.norm is not None:
            h = self.norm(h)
        if labels is not None:
            loss = chunked_cross_entropy(h, self.output.weight, labels, compiled=self.options.compile_loss)
            return loss if aux is None else loss + aux * (labels != IGNORE_INDEX).sum()
        out = self.output(h) if self.output is not None else h
        if with_router_aux:
            return out, aux if aux is not None else torch.zeros((), device=h.device)
        return out

    def _layers(self, h: torch.Tensor, rope, mask) -> tuple[torch.Tensor, dict[int, RoutingStats]]:
        """The decoder layers; with them, a MoE model's routing statistics of this forward."""
        if self.routing is None:
            for layer in self.layers.values():
                h = layer(h, rope, mask=mask)
            return h, {}
        self.routing.start()
        try:
            for layer in self.layers.values():
                h = layer(h, rope, mask=mask)
        finally:
            routing = self.routing.finish()
        return h, routing

    def router_aux_loss(self, routing: dict[int, RoutingStats]) -> torch.Tensor | None:
        """router_aux_loss_coef x the load-balancing loss of one forward's routing, what
        transformers adds to the mean cross-entropy; None unless the config asks for it
        (output_router_logits) and the forward ran MoE layers."""
        if not (routing and self.args.output_router_logits):
            return None
        return self.args.router_aux_loss_coef * load_balancing_loss(list(routing.values()), self.args.num_experts)

    def expert_load(self) -> dict[int, torch.Tensor]:
        """The last forward's load per MoE layer: {layer id: [E] share of the top-k
        assignments each expert received} (each sums to 1; 1/E is perfect balance). Empty
        for a dense model or before any forward."""
        if self.routing is None:
            return {}
        return {layer: s.expert_counts / (s.tokens * self.args.num_experts_per_tok)
                for layer, s in self.routing.load.items()}

    def take_expert_counts(self) -> torch.Tensor | None:
        """The routed assignments per expert summed over the forwards since the last call:
        [len(args.moe_layers), E], one row per MoE layer of the whole model (zeros for the
        layers this model or pipeline stage did not run), so that every rank's tensor has the
        same shape for a sum over ranks. None for a dense model."""
        if self.routing is None:
            return None
        totals = self.routing.take_totals()
        rows = [totals.get(layer) for layer in self.args.moe_layers]
        device = next(iter(totals.values())).device if totals else next(self.parameters()).device
        return torch.stack([torch.zeros(self.args.num_experts, device=device) if r is None else r.float()
                            for r in rows])


def build_model(args: ModelArgs, options: ModelOptions = ModelOptions(), device: str | torch.device = "meta",
                dtype: torch.dtype | None = None, stage: StageSlice | None = None,
                lora: LoRAArgs | None = None) -> Qwen2:
    """Build with uninitialised storage on `device` (meta by default: no memory at all).

    On a real device call `init_weights()` or load a checkpoint next."""
    with torch.device(device):
        model = Qwen2(args, options, stage, lora)
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

