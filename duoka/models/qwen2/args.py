"""Qwen2 model shapes: the typed arguments, the named flavors, and the mapping to and
from a Hugging Face `config.json`.

A MoE model (Qwen1.5-MoE, Qwen2-57B-A14B: transformers' `qwen2_moe`) is the same decoder
with a sparse MLP in some or all layers (duoka.models.qwen2.moe); the `num_experts` family
of fields describes it, and `num_experts == 0` is a dense model.

Flavors carry the published shapes of the base models. Instruct variants share the
shape but sometimes differ in `rms_norm_eps` (e.g. Qwen2-72B uses 1e-5, its Instruct
1e-6) and `max_position_embeddings`; loading a checkpoint folder always takes the
values from its own `config.json`, so a flavor only matters when training from scratch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from duoka.errors import DuokaError
from duoka.models.lora import LoRAArgs
from duoka.models.qwen2.config_fields import (
    FIX,
    MAX_COUNT,
    MAX_LAYERS,
    check_float,
    read_bool,
    read_dict,
    read_dtype,
    read_float,
    read_int,
    read_layer_list,
    read_token_ids,
)
from duoka.models.qwen2.rope import NO_ROPE_SCALING, RopeScaling, read_rope_scaling


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 151936
    """Rows of the embedding and of the output head."""
    dim: int = 896
    """Hidden size."""
    n_layers: int = 24
    n_heads: int = 14
    """Query heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention: n_heads must be a multiple)."""
    head_dim: int | None = None
    """Per-head width; None means dim // n_heads, as in every published Qwen2."""
    intermediate_size: int = 4864
    """Width of the SwiGLU MLP."""
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling = NO_ROPE_SCALING
    """The config's rope_scaling (YaRN, linear, llama3; duoka.models.qwen2.rope); default: none."""
    norm_eps: float = 1e-6
    max_seq_len: int = 32768
    """HF max_position_embeddings; the longest sequence served or trained is context_len."""
    tie_word_embeddings: bool = True
    """Output head shares the input embedding matrix (Qwen2 up to 3B)."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    initializer_range: float = 0.02
    """Std of the normal init for weights, as transformers uses for Qwen2."""

    # ---- mixture of experts (transformers' Qwen2MoeConfig names); all unused when dense ----
    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model (every layer a SwiGLU MLP)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Width of one routed expert's SwiGLU MLP."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert, which every token passes through, scaled by its sigmoid gate."""
    norm_topk_prob: bool = False
    """Renormalise the top-k router probabilities to sum to 1 (False in every published Qwen2-MoE)."""
    decoder_sparse_step: int = 1
    """Layer i is a MoE layer when (i + 1) is a multiple of this (and i is not in mlp_only_layers)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP of intermediate_size."""
    router_aux_loss_coef: float = 0.0
    """Weight of the router's load-balancing loss in the training loss (with output_router_logits)."""
    output_router_logits: bool = False
    """Add router_aux_loss_coef x the load-balancing loss to the training loss, as transformers'
    Qwen2MoeForCausalLM does when its config sets output_router_logits."""

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise DuokaError(f"model argument {name}={getattr(self, name)} must be positive")
        # A list from JSON or a TOML file becomes the tuple a frozen dataclass compares and hashes;
        # a dict (asdict's form in a run's spec and checkpoints) the RopeScaling it was.
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.num_experts:
            self._check_moe()
        if self.n_heads % self.n_kv_heads:
            raise DuokaError(
                f"num_attention_heads={self.n_heads} is not a multiple of num_key_value_heads={self.n_kv_heads}",
                "grouped-query attention needs each KV head shared by a whole number of query heads",
            )
        if self.head_dim is None and self.dim % self.n_heads:
            raise DuokaError(
                f"hidden_size={self.dim} is not divisible by num_attention_heads={self.n_heads}",
                "set head_dim explicitly in config.json or pick a divisible hidden size",
            )
        if self.resolved_head_dim % 2:
            raise DuokaError(f"head_dim={self.resolved_head_dim} must be even for rotary embeddings")

    def _check_moe(self) -> None:
        def refuse(field: str, why: str, fix: str):
            raise DuokaError(f"model argument {field}={getattr(self, field)!r} {why}", fix)

        if self.num_experts < 0:
            refuse("num_experts", "is negative", "set num_experts to the routed experts per layer (0: a dense model)")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            refuse("num_experts_per_tok", f"must be between 1 and num_experts={self.num_experts}",
                   "set num_experts_per_tok to the experts each token is routed to (the published models use 4 or 8)")
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(self, name) <= 0:
                refuse(name, "must be positive in a MoE model", f"set {name} to the width of that expert's MLP")
        if self.decoder_sparse_step < 1:
            refuse("decoder_sparse_step", "must be 1 or more", "set decoder_sparse_step to 1 (every layer sparse)")
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if outside:
            refuse("mlp_only_layers", f"names layers {outside} outside 0..{self.n_layers - 1}",
                   "list layer indices counted from 0, below num_hidden_layers")
        if self.router_aux_loss_coef < 0:
            refuse("router_aux_loss_coef", "is negative", "set router_aux_loss_coef to 0 or more (published: 0.001)")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def context_len(self) -> int:
        """The longest sequence the positions serve: max_seq_len, or the scaled context that
        the rope scaling gives (Qwen's YaRN factor 4 over 32,768: 131,072)."""
        return self.rope_scaling.context_length(self.max_seq_len)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (from 0) has the sparse MLP: transformers' rule."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        if self.num_experts == 0:  # a dense model at once: the planner asks ~500K times a scaling table
            return ()
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def router_aux_loss(self) -> bool:
        """Whether the training loss includes the router's load-balancing loss."""
        return bool(self.moe_layers) and self.output_router_logits

    def replace(self, **changes: Any) -> "ModelArgs":
        return dataclasses.replace(self, **changes)

    # ---- sizes used by the planner and by MFU ----
    def mlp_params(self, active: bool = False) -> int:
        """The MLP weights of all layers: dense SwiGLUs, and in MoE layers the router, the
        routed experts (active: only the num_experts_per_tok a token uses), the shared
        expert and its gate."""
        dense = 3 * self.dim * self.intermediate_size
        n_moe = len(self.moe_layers)
        if not n_moe:
            return self.n_layers * dense
        experts = self.num_experts_per_tok if active else self.num_experts
        sparse = (self.dim * self.num_experts + experts * 3 * self.dim * self.moe_intermediate_size
                  + 3 * self.dim * self.shared_expert_intermediate_size + self.dim)
        return (self.n_layers - n_moe) * dense + n_moe * sparse

    def num_params(self) -> int:
        """Number of distinct parameters (a tied head is counted once)."""
        hd = self.resolved_head_dim
        attn = self.dim * hd * (self.n_heads + 2 * self.n_kv_heads) + hd * (self.n_heads + 2 * self.n_kv_heads)
        attn += self.n_heads * hd * self.dim
        per_layer = attn + 2 * self.dim
        emb = self.vocab_size * self.dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_layer + self.mlp_params() + emb + head + self.dim

    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token: every linear layer and the output
        head (counted even when tied, since the head matmul is done), not the embedding
        lookup, norms or biases; of a MoE layer's experts only those a token is routed to.
        This is N in the PaLM MFU convention (Chowdhery et al. 2022, appendix B)."""
        hd = self.resolved_head_dim
        attn = self.dim * hd * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * hd * self.dim
        return self.n_layers * attn + self.mlp_params(active=True) + self.vocab_size * self.dim

    def flops_per_token(self, seq_len: int, lora: LoRAArgs | None = None) -> float:
        """Training FLOPs per token, PaLM appendix B: 6N + 12·L·H·S (attention not halved
        for causality; the same convention as torchtitan and the peer baseline).

        With LoRA, the LoRA peer's convention (bench/peers/lora_peer.py in the repository): a
        frozen weight costs its forward and its input's gradient, 4 per weight; a trained
        one also its own gradient, 6 (the adapters, and the head when trained whole, tied
        or not); attention keeps its 12·L·H·S, as the adapters below it need its input
        gradients."""
        attention = 12 * self.n_layers * self.n_heads * self.resolved_head_dim * seq_len
        if lora is None:
            return 6 * self.matmul_params() + attention
        head = self.vocab_size * self.dim
        head_trains = "lm_head" in lora.modules_to_save or (self.tie_word_embeddings and
                                                            "embed_tokens" in lora.modules_to_save)
        trained = self.adapter_params(lora) + (head if head_trains else 0)
        frozen = self.matmul_params() - (head if head_trains else 0)
        return 4 * frozen + 6 * trained + attention

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """A decoder block's linear layers by their Hugging Face names: (in, out) features."""
        hd = self.resolved_head_dim
        return {"q_proj": (self.dim, self.n_heads * hd), "k_proj": (self.dim, self.n_kv_heads * hd),
                "v_proj": (self.dim, self.n_kv_heads * hd), "o_proj": (self.n_heads * hd, self.dim),
                "gate_proj": (self.dim, self.intermediate_size), "up_proj": (self.dim, self.intermediate_size),
                "down_proj": (self.intermediate_size, self.dim)}

    def adapter_params(self, lora: LoRAArgs) -> int:
        """Parameters of the LoRA adapters: rank x (in + out) per targeted layer."""
        shapes = self.linear_shapes()
        return self.n_layers * sum(lora.rank * sum(shapes[name]) for name in lora.targets)


DOCUMENT_MASKING = ("sdpa", "flex", "varlen")
SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")
COMPILE_MODES = ("none", "block", "parts")
MOE_GEMMS = ("auto", "grouped", "loop")


@dataclass(frozen=True)
class ModelOptions:
    """How a model instance runs (its kernels), not what it computes (that is ModelArgs):
    every choice here gives the same function, so checkpoints do not depend on them."""

    document_masking: str = "sdpa"
    """How packed documents are masked: "sdpa" (dense mask), "flex" (block mask) or
    "varlen" (flash attention over the concatenated documents, CUDA only)."""
    sdpa_backend: str | None = None
    """The one SDPA kernel for causal attention: None (PyTorch's order), "flash", "cudnn",
    "efficient" or "math"."""
    fuse_qkv: bool = True
    """q, k and v from one matmul over their concatenated weights where the layers allow it."""
    packed_projections: bool = False
    """Inference: q/k/v and gate/up held as one weight each (`attention.wqkv`,
    `feed_forward.w13`), filled from a Hugging Face folder by concatenating its tensors at
    load. One matmul each with no concatenation per step, which a batch-1 decode (bound by
    reading the weights) needs. The only option that changes parameter names: such a model
    loads Hugging Face checkpoints but is not trained, parallelized or saved."""
    compile: str = "none"
    """"none"; "block": each decoder block's body is one compiled graph; "parts": the
    attention and MLP bodies each (tensor parallelism, whose module hooks must stay eager)."""
    compile_loss: bool = False
    """The fused chunked loss's per-chunk softmax pass compiled."""
    compile_dynamic: bool = False
    """Compiled bodies take every size as symbolic from the first call: serving's steps differ
    in token count, sequences and block-table width from one step to the next."""
    moe_gemm: str = "auto"
    """A MoE layer's expert matmuls: "grouped" (one torch grouped GEMM per projection),
    "loop" (one matmul per expert), "auto" (grouped where the device and dtype have the
    kernel: duoka.models.qwen2.moe.grouped_mm_supported)."""

    def __post_init__(self):
        for name, value, allowed in (("document_masking", self.document_masking, DOCUMENT_MASKING),
                                     ("sdpa_backend", self.sdpa_backend, (None, *SDPA_BACKENDS)),
                                     ("compile", self.compile, COMPILE_MODES),
                                     ("moe_gemm", self.moe_gemm, MOE_GEMMS)):
            if value not in allowed:
                raise DuokaError(f"model option {name}={value!r} is not one of {allowed}")

    def replace(self, **changes: Any) -> "ModelOptions":
        return dataclasses.replace(self, **changes)


def _flavor(**kw) -> ModelArgs:
    return ModelArgs(bos_token_id=151643, eos_token_id=151643, **kw)


# Shapes of the published base checkpoints (Qwen/Qwen2-*, Qwen/Qwen2.5-* config.json).
# Vocab is 151936 up to 3B and 152064 from 7B; heads are 64-, 128-wide.
FLAVORS: dict[str, ModelArgs] = {
    # Tiny shape for tests and the built-in demo: every feature (GQA ratio 2, tied head,
    # QKV bias) is present, and it runs in milliseconds on a CPU. Its vocabulary fits the
    # tokenizer bundled in duoka/assets (4,096 entries), which the default run uses.
    "debug": ModelArgs(vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=384,
                       max_seq_len=2048, tie_word_embeddings=True),
    "qwen2-0.5b": _flavor(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, intermediate_size=4864,
                          vocab_size=151936, tie_word_embeddings=True, max_seq_len=131072),
    "qwen2-1.5b": _flavor(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, intermediate_size=8960,
                          vocab_size=151936, tie_word_embeddings=True, max_seq_len=131072),
    "qwen2-7b": _flavor(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, intermediate_size=18944,
                        vocab_size=152064, tie_word_embeddings=False, max_seq_len=131072),
    "qwen2-72b": _flavor(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, intermediate_size=29568,
                         vocab_size=152064, tie_word_embeddings=False, norm_eps=1e-5, max_seq_len=131072),
    "qwen2.5-0.5b": _flavor(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, intermediate_size=4864,
                            vocab_size=151936, tie_word_embeddings=True, max_seq_len=32768),
    "qwen2.5-1.5b": _flavor(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, intermediate_size=8960,
                            vocab_size=151936, tie_word_embeddings=True, max_seq_len=131072),
    "qwen2.5-3b": _flavor(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, intermediate_size=11008,
                          vocab_size=151936, tie_word_embeddings=True, max_seq_len=32768),
    "qwen2.5-7b": _flavor(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, intermediate_size=18944,
                          vocab_size=152064, tie_word_embeddings=False, max_seq_len=131072),
    "qwen2.5-14b": _flavor(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, intermediate_size=13824,
                           vocab_size=152064, tie_word_embeddings=False, norm_eps=1e-5, max_seq_len=131072),
    "qwen2.5-32b": _flavor(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, intermediate_size=27648,
                           vocab_size=152064, tie_word_embeddings=False, norm_eps=1e-5, max_seq_len=131072),
    "qwen2.5-72b": _flavor(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, intermediate_size=29568,
                           vocab_size=152064, tie_word_embeddings=False, norm_eps=1e-5, max_seq_len=131072),
    # Mixture of experts (Qwen/Qwen1.5-MoE-A2.7B, Qwen/Qwen2-57B-A14B config.json). Their files
    # set output_router_logits false (and are read as they are); a flavor trains from scratch,
    # where the router needs its load-balancing loss, so the flavors turn it on.
    # The tiny one is `debug` with a sparse MLP: 8 experts, top-2, a shared expert, layer 0
    # dense (mlp_only_layers), on the bundled tokenizer's vocabulary.
    "qwen2-moe-tiny": ModelArgs(vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=384,
                                max_seq_len=2048, tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=64, shared_expert_intermediate_size=128, mlp_only_layers=(0,),
                                router_aux_loss_coef=0.001, output_router_logits=True),
    "qwen2-moe-a2.7b": _flavor(dim=2048, n_layers=24, n_heads=16, n_kv_heads=16, intermediate_size=5632,
                               vocab_size=151936, tie_word_embeddings=False, max_seq_len=8192, num_experts=60,
                               num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                               router_aux_loss_coef=0.001, output_router_logits=True),
    "qwen2-57b-a14b": _flavor(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, intermediate_size=18944,
                              vocab_size=151936, tie_word_embeddings=False, max_seq_len=131072, num_experts=64,
                              num_experts_per_tok=8, moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
                              router_aux_loss_coef=0.001, output_router_logits=True),
}

# Flavors whose vocabulary is the bundled tokenizer's (duoka/assets): they train on the bundled
# corpus with no tokenizer given.
BUNDLED_TOKENIZER_FLAVORS = ("debug", "qwen2-moe-tiny")


def get_flavor(name: str) -> ModelArgs:
    key = name.lower()
    if key not in FLAVORS and f"qwen2-{key}" in FLAVORS:  # "7b" is shorthand for qwen2-7b
        key = f"qwen2-{key}"
    if key not in FLAVORS:
        raise DuokaError(f"unknown model flavor {name!r}", f"choose one of: {', '.join(FLAVORS)}")
    return FLAVORS[key]


# ---- Hugging Face config.json <-> ModelArgs ----

_SUPPORTED_ARCH = "Qwen2ForCausalLM"
_MOE_ARCH = "Qwen2MoeForCausalLM"
_ARCH = {"qwen2": _SUPPORTED_ARCH, "qwen2_moe": _MOE_ARCH}


def from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """Validate a Hugging Face Qwen2 config and turn it into ModelArgs.

    Anything the model cannot reproduce exactly is refused, naming the field: a
    silent approximation would give a model that loads but is not the same model. Every
    field is type- and range-checked first (config_fields): the file is untrusted input.
    """

    def refuse(field: str, why: str, fix: str) -> DuokaError:
        return DuokaError(f"{source}: {field} {why}", fix)

    if not isinstance(cfg, dict):
        raise DuokaError(f"{source} is not a JSON object", FIX)

    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if not isinstance(model_type, str) or model_type not in _ARCH:
        raise refuse("model_type", f"is {model_type!r}; duoka runs Qwen2/Qwen2.5 models (model_type 'qwen2') and "
                     "their mixture-of-experts form (model_type 'qwen2_moe')",
                     "use a Qwen2, Qwen2.5, Qwen1.5-MoE or Qwen2-MoE checkpoint")
    if not isinstance(archs, list):
        raise refuse("architectures", f"is {archs!r}, not a list", FIX)
    if archs and _ARCH[model_type] not in archs:
        raise refuse("architectures", f"is {archs}; expected {_ARCH[model_type]} for model_type {model_type!r}",
                     "use a causal-LM checkpoint (not a classification or reward head) whose model_type and "
                     "architectures agree")
    if cfg.get("use_sliding_window"):
        raise refuse("use_sliding_window", "is true; sliding-window attention is not implemented",
                     "set use_sliding_window to false (all published Qwen2/Qwen2.5 checkpoints ship it off)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", f"is {cfg['hidden_act']!r}; Qwen2's SwiGLU uses 'silu'", "use a standard Qwen2 config")
    if cfg.get("attention_dropout", 0.0):
        raise refuse("attention_dropout", f"is {cfg['attention_dropout']}; duoka trains without attention dropout",
                     "set attention_dropout to 0.0")

    # transformers >= 5 writes rope_parameters; older files write rope_theta + rope_scaling.
    rope = read_dict(cfg, "rope_parameters", refuse)
    scaling_cfg = read_dict(cfg, "rope_scaling", refuse)
    field = "rope_scaling" if scaling_cfg else "rope_parameters"
    rope_scaling = read_rope_scaling(scaling_cfg or rope, f"{source}: {field}")
    theta = check_float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), "rope_theta", refuse, low_open=True)
    read_dtype(cfg, refuse)
    n_layers = read_int(cfg, "num_hidden_layers", refuse, high=MAX_LAYERS)
    n_heads = read_int(cfg, "num_attention_heads", refuse)
    moe = _moe_fields(cfg, refuse, n_layers) if model_type == "qwen2_moe" else {}
    args = ModelArgs(
        vocab_size=read_int(cfg, "vocab_size", refuse),
        dim=read_int(cfg, "hidden_size", refuse),
        n_layers=n_layers,
        n_heads=n_heads,
        # 0 or null has always meant "as many as the query heads"
        n_kv_heads=read_int(cfg, "num_key_value_heads", refuse) if cfg.get("num_key_value_heads") else n_heads,
        head_dim=None if cfg.get("head_dim") is None else read_int(cfg, "head_dim", refuse),
        intermediate_size=read_int(cfg, "intermediate_size", refuse),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        norm_eps=read_float(cfg, "rms_norm_eps", refuse, 1e-6, high=1.0, low_open=True),
        max_seq_len=read_int(cfg, "max_position_embeddings", refuse, default=32768),
        tie_word_embeddings=read_bool(cfg, "tie_word_embeddings", refuse, False),
        bos_token_id=read_token_ids(cfg, "bos_token_id", refuse),
        eos_token_id=read_token_ids(cfg, "eos_token_id", refuse),
        initializer_range=read_float(cfg, "initializer_range", refuse, 0.02),
        **moe,
    )
    if args.context_len > MAX_COUNT:
        raise refuse(field, f"extends the context to {args.context_len:,} positions, more than {MAX_COUNT:,}", FIX)
    return args


def _moe_fields(cfg: dict[str, Any], refuse, n_layers: int) -> dict[str, Any]:
    """A qwen2_moe config's MoE fields as ModelArgs keywords. The shape-giving ones are required;
    the others take transformers' defaults when absent, as Qwen2MoeConfig does."""
    if not read_bool(cfg, "qkv_bias", refuse, True):
        raise refuse("qkv_bias", "is false; Qwen2-MoE's attention has biases on q, k and v",
                     "use a Qwen2-MoE checkpoint (qkv_bias true or absent)")
    if not read_int(cfg, "num_experts", refuse, low=0):
        raise refuse("num_experts", "is 0: a qwen2_moe config without experts is a dense Qwen2",
                     "set model_type to 'qwen2' and architectures to ['Qwen2ForCausalLM']")
    return {"num_experts": read_int(cfg, "num_experts", refuse),
            "num_experts_per_tok": read_int(cfg, "num_experts_per_tok", refuse),
            "moe_intermediate_size": read_int(cfg, "moe_intermediate_size", refuse),
            "shared_expert_intermediate_size": read_int(cfg, "shared_expert_intermediate_size", refuse),
            "norm_topk_prob": read_bool(cfg, "norm_topk_prob", refuse, False),
            "decoder_sparse_step": read_int(cfg, "decoder_sparse_step", refuse, default=1),
            "mlp_only_layers": read_layer_list(cfg, "mlp_only_layers", refuse, n_layers),
            "router_aux_loss_coef": read_float(cfg, "router_aux_loss_coef", refuse, 0.001),
            "output_router_logits": read_bool(cfg, "output_router_logits", refuse, False)}


def to_hf_config(args: ModelArgs, dtype: str | None = None) -> dict[str, Any]:
    """The config.json that transformers' Qwen2ForCausalLM (Qwen2MoeForCausalLM for a MoE
    model) reads back as the same model.

    Both the old (rope_theta) and new (rope_parameters) spellings are written, so
    transformers 4.x and 5.x read it alike."""
    moe = args.num_experts > 0
    cfg: dict[str, Any] = {
        "architectures": [_MOE_ARCH if moe else _SUPPORTED_ARCH],
        "model_type": "qwen2_moe" if moe else "qwen2",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "initializer_range": args.initializer_range,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": args.rope_scaling.to_config(args.rope_theta),
        "tie_word_embeddings": args.tie_word_embeddings,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": args.bos_token_id,
        "eos_token_id": args.eos_token_id,
    }
    if args.head_dim is not None:
        cfg["head_dim"] = args.head_dim
    if moe:
        cfg.update({"num_experts": args.num_experts, "num_experts_per_tok": args.num_experts_per_tok,
                    "moe_intermediate_size": args.moe_intermediate_size,
                    "shared_expert_intermediate_size": args.shared_expert_intermediate_size,
                    "norm_topk_prob": args.norm_topk_prob, "decoder_sparse_step": args.decoder_sparse_step,
                    "mlp_only_layers": list(args.mlp_only_layers), "router_aux_loss_coef": args.router_aux_loss_coef,
                    "output_router_logits": args.output_router_logits, "qkv_bias": True})
    if dtype is not None:
        cfg["torch_dtype"] = dtype  # transformers 4.x name
        cfg["dtype"] = dtype  # transformers 5.x name
    return cfg
