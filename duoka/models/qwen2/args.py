"""Qwen2 model shapes: the typed arguments, the named flavors, and the mapping to and
from a Hugging Face `config.json`.

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
    norm_eps: float = 1e-6
    max_seq_len: int = 32768
    """Longest position the model was trained for (HF max_position_embeddings)."""
    tie_word_embeddings: bool = True
    """Output head shares the input embedding matrix (Qwen2 up to 3B)."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    initializer_range: float = 0.02
    """Std of the normal init for weights, as transformers uses for Qwen2."""

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise DuokaError(f"model argument {name}={getattr(self, name)} must be positive")
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

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    def replace(self, **changes: Any) -> "ModelArgs":
        return dataclasses.replace(self, **changes)

    # ---- sizes used by the planner and by MFU ----
    def num_params(self) -> int:
        """Number of distinct parameters (a tied head is counted once)."""
        hd = self.resolved_head_dim
        attn = self.dim * hd * (self.n_heads + 2 * self.n_kv_heads) + hd * (self.n_heads + 2 * self.n_kv_heads)
        attn += self.n_heads * hd * self.dim
        mlp = 3 * self.dim * self.intermediate_size
        per_layer = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_layer + emb + head + self.dim

    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token: every linear layer and the output
        head (counted even when tied, since the head matmul is done), not the embedding
        lookup, norms or biases. This is N in the PaLM MFU convention (Chowdhery et al. 2022, appendix B)."""
        hd = self.resolved_head_dim
        attn = self.dim * hd * (self.n_heads + 2 * self.n_kv_heads) + self.n_heads * hd * self.dim
        mlp = 3 * self.dim * self.intermediate_size
        return self.n_layers * (attn + mlp) + self.vocab_size * self.dim

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

    def __post_init__(self):
        for name, value, allowed in (("document_masking", self.document_masking, DOCUMENT_MASKING),
                                     ("sdpa_backend", self.sdpa_backend, (None, *SDPA_BACKENDS)),
                                     ("compile", self.compile, COMPILE_MODES)):
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
}


def get_flavor(name: str) -> ModelArgs:
    key = name.lower()
    if key not in FLAVORS and f"qwen2-{key}" in FLAVORS:  # "7b" is shorthand for qwen2-7b
        key = f"qwen2-{key}"
    if key not in FLAVORS:
        raise DuokaError(f"unknown model flavor {name!r}", f"choose one of: {', '.join(FLAVORS)}")
    return FLAVORS[key]


# ---- Hugging Face config.json <-> ModelArgs ----

_SUPPORTED_ARCH = "Qwen2ForCausalLM"


def from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """Validate a Hugging Face Qwen2 config and turn it into ModelArgs.

    Anything the model cannot reproduce exactly is refused, naming the field: a
    silent approximation would give a model that loads but is not the same model.
    """

    def refuse(field: str, why: str, fix: str) -> DuokaError:
        return DuokaError(f"{source}: {field} {why}", fix)

    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type != "qwen2":
        raise refuse("model_type", f"is {model_type!r}; duoka runs dense Qwen2/Qwen2.5 models (model_type 'qwen2')",
                     "use a Qwen2 or Qwen2.5 checkpoint (MoE models such as qwen2_moe are not supported)")
    if archs and _SUPPORTED_ARCH not in archs:
        raise refuse("architectures", f"is {archs}; expected {_SUPPORTED_ARCH}",
                     "use a causal-LM Qwen2 checkpoint (not a classification or reward head)")
    if cfg.get("use_sliding_window"):
        raise refuse("use_sliding_window", "is true; sliding-window attention is not implemented",
                     "set use_sliding_window to false (all published Qwen2/Qwen2.5 checkpoints ship it off)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", f"is {cfg['hidden_act']!r}; Qwen2's SwiGLU uses 'silu'", "use a standard Qwen2 config")
    if cfg.get("attention_dropout", 0.0):
        raise refuse("attention_dropout", f"is {cfg['attention_dropout']}; duoka trains without attention dropout",
                     "set attention_dropout to 0.0")

    # transformers >= 5 writes rope_parameters; older files write rope_theta + rope_scaling.
    rope = cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = cfg.get("rope_scaling")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        field = "rope_scaling" if scaling else "rope_parameters"
        raise refuse(field, f"asks for {rope_type!r} RoPE scaling, which is not implemented",
                     f"remove {field} (or set its rope_type to 'default') to run at the native context length")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))

    try:
        n_heads = int(cfg["num_attention_heads"])
        return ModelArgs(
            vocab_size=int(cfg["vocab_size"]),
            dim=int(cfg["hidden_size"]),
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=cfg.get("head_dim"),
            intermediate_size=int(cfg["intermediate_size"]),
            rope_theta=float(theta),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_seq_len=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
        )
    except KeyError as e:
        raise refuse(e.args[0], "is missing", "the file is not a complete Qwen2 config.json") from None
    except (TypeError, ValueError) as e:
        raise DuokaError(f"{source}: a value has the wrong type ({e})", "compare with a config.json that transformers wrote") from None


def to_hf_config(args: ModelArgs, dtype: str | None = None) -> dict[str, Any]:
    """The config.json that transformers' Qwen2ForCausalLM reads back as the same model.

    Both the old (rope_theta) and new (rope_parameters) spellings are written, so
    transformers 4.x and 5.x read it alike."""
    cfg: dict[str, Any] = {
        "architectures": [_SUPPORTED_ARCH],
        "model_type": "qwen2",
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
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
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
    if dtype is not None:
        cfg["torch_dtype"] = dtype  # transformers 4.x name
        cfg["dtype"] = dtype  # transformers 5.x name
    return cfg
