"""The published Qwen2 shapes the transformers peers build (random weights, seed 0), and the
PaLM training-FLOPs convention their MFU uses. Imported by the peer scripts beside this file
(each puts its own folder first on sys.path when run as a script, under torchrun too)."""

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
}
# The fields every peer adds to the shape (Qwen2's published values).
COMMON = dict(rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768)


def flops_per_token(c: dict, seq: int) -> float:
    """Training FLOPs per token, PaLM's convention (Chowdhery et al. 2022, arXiv:2204.02311,
    appendix B; torchtitan's too): 6 x every matmul weight, the output head included, plus
    12 x layers x hidden x seq for attention (not halved for the causal mask)."""
    h, L, inter, V = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = h // nh
    per_layer = h * (nh * hd) + 2 * h * (nkv * hd) + (nh * hd) * h + 3 * h * inter
    dense = L * per_layer + h * V  # the head's matmul counts even when tied
    return 6 * dense + 12 * L * h * seq
