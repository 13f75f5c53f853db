"""The published Qwen2 shapes the transformers peers build (random weights, seed 0), and the
PaLM training-FLOPs convention their MFU uses. Imported by the peer scripts beside this file
(each puts its own folder first on sys.path when run as a script, under torchrun too) and by
the duoka benches of bench/ (the same shapes on both sides).

A shape with `num_experts` is a mixture of experts (transformers' `qwen2_moe`: Qwen2MoeConfig,
Qwen2MoeForCausalLM); the others are dense Qwen2 (Qwen2Config, Qwen2ForCausalLM). `hf_config`
and `hf_model` pick the class."""

# config.json fields of Qwen/Qwen2-0.5B, -1.5B and -7B; `tiny` only checks a peer on a CPU.
CONFIGS = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000, tie_word_embeddings=True),
    # Qwen/Qwen1.5-MoE-A2.7B's config.json (duoka flavor qwen2-moe-a2.7b): every layer sparse,
    # 60 routed experts of width 1408, 4 per token, and a shared expert of 5632 behind its gate
    # (intermediate_size is only used by dense layers, of which it has none).
    "moe-a2.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                      intermediate_size=5632, vocab_size=151936, tie_word_embeddings=False, num_experts=60,
                      num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
    # Qwen/Qwen2-57B-A14B's config.json (duoka flavor qwen2-57b-a14b): 64 experts of 2560, 8 per
    # token, a shared expert of 20480. Its bf16 weights are 115 GB: benches build it on the device.
    "moe-57b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                    intermediate_size=18944, vocab_size=151936, tie_word_embeddings=False, num_experts=64,
                    num_experts_per_tok=8, moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
                    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
    # duoka's qwen2-moe-tiny flavor (its `debug` with a sparse MLP: layer 0 dense), for CPU checks.
    "moe-tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=384, vocab_size=4096, tie_word_embeddings=True, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                     norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0]),
}
# The fields every peer adds to the shape (Qwen2's published values).
COMMON = dict(rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768)
# What a MoE trained from scratch adds: the router's load-balancing loss, as duoka's MoE flavors
# turn it on (the published files ship output_router_logits false, for fine-tuning and serving)
# with the published coefficient. transformers' Qwen2MoeForCausalLM then adds coef x aux loss.
MOE_TRAINING = dict(output_router_logits=True, router_aux_loss_coef=0.001)


def is_moe(c: dict) -> bool:
    return c.get("num_experts", 0) > 0


def shape(name: str, layers: int = 0) -> dict:
    """CONFIGS[name], with `layers` decoder layers instead of the published count when > 0 (a
    cut model of the real layer shape, for a GPU too small for all of them)."""
    c = dict(CONFIGS[name])
    if layers:
        c["num_hidden_layers"] = layers
        c["mlp_only_layers"] = [i for i in c.get("mlp_only_layers", []) if i < layers]
    return c


def hf_config(c: dict, **extra):
    """transformers' config of shape `c` (Qwen2MoeConfig for a MoE shape), COMMON added."""
    from transformers import Qwen2Config, Qwen2MoeConfig

    return (Qwen2MoeConfig if is_moe(c) else Qwen2Config)(**c, **{**COMMON, **extra})


def hf_model(c: dict, **extra):
    """Qwen2ForCausalLM or Qwen2MoeForCausalLM of shape `c` on the current default device, fp32,
    from the current torch seed."""
    from transformers import Qwen2ForCausalLM, Qwen2MoeForCausalLM

    return (Qwen2MoeForCausalLM if is_moe(c) else Qwen2ForCausalLM)(hf_config(c, **extra))


def moe_layers(c: dict) -> list[int]:
    """The sparse layers: transformers' rule (not in mlp_only_layers, (i + 1) % decoder_sparse_step == 0)."""
    if not is_moe(c):
        return []
    step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers", []))
    return [i for i in range(c["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0]


def matmul_params(c: dict) -> int:
    """Weights one token's forward multiplies by: every projection, the output head (counted even
    when tied), of a MoE layer the router, the shared expert and its gate and only the
    num_experts_per_tok routed experts a token goes to (its active weights); no embedding
    lookup, norms or biases. duoka's ModelArgs.matmul_params, for the peer's MFU."""
    h, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = h // nh
    attention = h * (nh * hd) + 2 * h * (nkv * hd) + (nh * hd) * h
    sparse = moe_layers(c)
    dense_mlp = 3 * h * c["intermediate_size"]
    moe_mlp = (h * c["num_experts"] + c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]
               + 3 * h * c["shared_expert_intermediate_size"] + h) if sparse else 0
    return L * attention + (L - len(sparse)) * dense_mlp + len(sparse) * moe_mlp + h * V


def num_params(c: dict) -> int:
    """Every parameter (a tied head once): what the weights, gradients and optimizer state hold."""
    h, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = h // nh
    attention = h * (nh * hd) + 2 * h * (nkv * hd) + (nh * hd) * h + (nh + 2 * nkv) * hd  # q/k/v biases
    sparse = moe_layers(c)
    moe_mlp = (h * c["num_experts"] + c["num_experts"] * 3 * h * c["moe_intermediate_size"]
               + 3 * h * c["shared_expert_intermediate_size"] + h) if sparse else 0
    mlp = (L - len(sparse)) * 3 * h * c["intermediate_size"] + len(sparse) * moe_mlp
    head = 0 if c["tie_word_embeddings"] else h * V
    return L * (attention + 2 * h) + mlp + h * V + head + h


def flops_per_token(c: dict, seq: int) -> float:
    """Training FLOPs per token, PaLM's convention (Chowdhery et al. 2022, arXiv:2204.02311,
    appendix B; torchtitan's too): 6 x every matmul weight a token passes through (a MoE's
    active weights, matmul_params), the output head included, plus 12 x layers x hidden x seq
    for attention (not halved for the causal mask). duoka's ModelArgs.flops_per_token."""
    return 6 * matmul_params(c) + 12 * c["num_hidden_layers"] * c["hidden_size"] * seq
