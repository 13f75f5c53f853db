"""Generation: greedy parity with transformers' generate, cache vs no cache, sampling."""

import pytest
import torch

from duoka.errors import DuokaError
from duoka.models.qwen2.hf_adapter import load_hf_model
from duoka.serve.generate import Generator, SamplingParams, TextStream, sample

CONFIGS = [
    dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2, vocab_size=1001),
    dict(tie_word_embeddings=False, num_attention_heads=7, num_key_value_heads=1, hidden_size=56, vocab_size=513),
]


def hf_greedy(hf, prompt, n, eos=None):
    out = hf.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0,
                      use_cache=True, attention_mask=torch.ones_like(prompt))
    return out[:, prompt.shape[1]:]


@pytest.mark.parametrize("overrides", CONFIGS, ids=["tied-gqa2", "untied-gqa7"])
def test_greedy_matches_transformers_token_for_token(hf_folder, overrides):
    hf, folder = hf_folder(seed=5, **overrides)
    model, _ = load_hf_model(folder)
    prompt = torch.randint(0, overrides["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(2))
    theirs = hf_greedy(hf, prompt, 40)
    ours = Generator(model).generate(prompt, SamplingParams(max_new_tokens=40))
    assert ours.tolist() == theirs.tolist()
    assert len(set(ours[0].tolist())) > 3  # a degenerate single-token loop would prove little


def test_batch_greedy_matches_transformers(hf_folder):
    hf, folder = hf_folder(seed=6)
    model, _ = load_hf_model(folder)
    prompt = torch.randint(0, 1001, (3, 8), generator=torch.Generator().manual_seed(3))
    ours = Generator(model).generate(prompt, SamplingParams(max_new_tokens=20))
    assert ours.tolist() == hf_greedy(hf, prompt, 20).tolist()


def test_stops_at_eos_like_transformers(hf_folder):
    hf, folder = hf_folder(seed=7)
    model, _ = load_hf_model(folder)
    prompt = torch.randint(0, 1001, (1, 10), generator=torch.Generator().manual_seed(4))
    free = Generator(model).generate(prompt, SamplingParams(max_new_tokens=30))[0].tolist()
    eos = free[5]  # a token greedy decoding reaches at step 6 becomes the stop token
    first = free.index(eos)
    ours = Generator(model).generate(prompt, SamplingParams(max_new_tokens=30), stop_ids={eos})
    assert ours[0].tolist() == free[: first + 1]
    assert ours[0].tolist() == hf_greedy(hf, prompt, 30, eos=eos)[0].tolist()


def test_cached_and_uncached_paths_agree(hf_folder):
    _, folder = hf_folder(seed=8, tie_word_embeddings=False, vocab_size=997)
    model, _ = load_hf_model(folder)
    prompt = torch.randint(0, 997, (2, 9), generator=torch.Generator().manual_seed(5))
    gen = Generator(model)
    params = SamplingParams(max_new_tokens=30)
    cached = gen.generate(prompt, params)
    uncached = gen.generate(prompt, params, use_cache=False)
    assert torch.equal(cached, uncached)

    # Logits too, not just argmax: run the cache step by step against full forwards (made
    # first: with the caches set up, every forward decodes into them).
    with torch.no_grad():
        full = model(prompt)
        seqs = [torch.cat([prompt, cached[:, : i + 1]], dim=1) for i in range(5)]
        full_last = [model(seq)[:, -1] for seq in seqs]
        model.setup_kv_cache(2, 9 + 30)
        step_logits = model(prompt, positions=torch.arange(9))
        assert torch.allclose(step_logits, full, rtol=1e-5, atol=1e-5)
        for i in range(5):
            one = model(cached[:, i : i + 1], positions=torch.tensor([9 + i]))[:, -1]
            assert torch.allclose(one, full_last[i], rtol=1e-5, atol=1e-5)
        model.clear_kv_cache()


def test_sampling_is_seeded_and_limits_work(hf_folder):
    _, folder = hf_folder(seed=9)
    model, _ = load_hf_model(folder)
    gen = Generator(model)
    prompt = torch.randint(0, 1001, (1, 6))
    greedy = gen.generate(prompt, SamplingParams(max_new_tokens=15))
    a = gen.generate(prompt, SamplingParams(max_new_tokens=15, temperature=1.0, seed=11))
    b = gen.generate(prompt, SamplingParams(max_new_tokens=15, temperature=1.0, seed=11))
    c = gen.generate(prompt, SamplingParams(max_new_tokens=15, temperature=1.0, seed=12))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(gen.generate(prompt, SamplingParams(max_new_tokens=15, temperature=0.8, top_k=1, seed=1)), greedy)
    assert torch.equal(gen.generate(prompt, SamplingParams(max_new_tokens=15, temperature=0.8, top_p=1e-6, seed=1)),
                       greedy)


def test_sample_draws_from_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).expand(20000, 5).contiguous()
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample(logits, SamplingParams(temperature=0.7), gen), minlength=5).float() / 20000
    assert torch.allclose(counts, (logits[0] / 0.7).softmax(-1), atol=0.015)

    top2 = torch.bincount(sample(logits, SamplingParams(temperature=1.0, top_k=2), gen), minlength=5).float() / 20000
    assert top2[2:].sum() == 0 and torch.allclose(top2[:2], logits[0, :2].softmax(-1), atol=0.015)

    # top_p=0.8: probabilities are .57 .21 .13 .08 .03 -> the first three reach 0.8.
    nucleus = torch.bincount(sample(logits, SamplingParams(temperature=1.0, top_p=0.8), gen), minlength=5).float()
    assert nucleus[3:].sum() == 0 and nucleus[2] > 0


def test_bad_sampling_parameters():
    with pytest.raises(DuokaError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(DuokaError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(DuokaError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_context_limit_is_a_clear_error(hf_folder):
    _, folder = hf_folder(max_position_embeddings=32)
    model, _ = load_hf_model(folder)
    with pytest.raises(DuokaError, match="exceeds the model's context of 32"):
        Generator(model).generate(torch.zeros(1, 30, dtype=torch.long), SamplingParams(max_new_tokens=5))


def test_text_stream_holds_back_partial_characters(tokenizer_dir):
    from duoka.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    text = "emoji 🙂 and 中文 done"
    ids = tok.encode(text)
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)
