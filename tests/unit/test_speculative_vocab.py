"""Speculative decoding with a draft whose vocabulary is not the model's (Qwen2-7B has 152,064
rows, its natural draft Qwen2-0.5B 151,936): context ids past the draft's vocabulary (the model
sampled them, or a client sent them in a token-id prompt) never reach the draft's embedding, and
a wider draft never proposes an id past the model's. Greedy output stays plain decoding's, token
for token (fp32 on CPU, tiny models; the drafts are the target with its vocabulary cut or grown)."""

from __future__ import annotations

import shutil

import pytest
import torch

from duoka.serve.engine import LLM
from duoka.serve.params import SamplingParams

VOCAB = 600  # the target's (the tokenizer_dir fixture's vocabulary)
SMALL, LARGE = 512, 700  # the drafts'
K = 3
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def draft_of(target, tokenizer_dir, folder, vocab: int, noise: float):
    """The target with its (tied) embedding cut or grown to `vocab` rows and every weight
    perturbed by `noise` (so that some drafts are rejected); a grown one's extra rows are twice
    rows 0.. of the target, so that the draft's own argmax often lies past the target's ids."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    model.resize_token_embeddings(vocab)
    torch.manual_seed(vocab)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
        rows = model.get_input_embeddings().weight
        if vocab > VOCAB:
            rows[VOCAB:] = 2 * rows[:vocab - VOCAB]
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def folders(saved_hf_model, tokenizer_dir, tmp_path_factory):
    target = tmp_path_factory.mktemp("vocab-target")
    shutil.copytree(saved_hf_model(vocab_size=VOCAB, seed=5), target, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, target / name)
    return {"target": target,
            "small": draft_of(target, tokenizer_dir, tmp_path_factory.mktemp("vocab-small"), SMALL, 0.03),
            "large": draft_of(target, tokenizer_dir, tmp_path_factory.mktemp("vocab-large"), LARGE, 0.03)}


@pytest.fixture(scope="module")
def plain(folders):
    return LLM(folders["target"], device="cpu", block_size=4)


def prompts() -> list[list[int]]:
    """Token-id prompts of different lengths, each with ids past the small draft's vocabulary
    (one ends with such an id: the draft's first catch-up row is one)."""
    g = torch.Generator().manual_seed(1)
    out = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 19)]
    out[0][-1], out[1][3], out[2][0] = VOCAB - 1, SMALL, SMALL + 40
    return out


def recording(llm: LLM) -> tuple[list, list]:
    """Wraps the draft proposer of llm: (its proposals, the raw draft logits of its forwards)."""
    proposer = llm.engine.speculator.proposer
    proposals, raw = [], []
    propose, execute = proposer.propose, proposer.execute

    def record_propose(requests):
        proposal = propose(requests)
        proposals.append(proposal)
        return proposal

    def record_execute(inputs):
        logits = execute(inputs)
        raw.append(logits)
        return logits

    proposer.propose, proposer.execute = record_propose, record_execute
    return proposals, raw


def test_context_ids_past_a_smaller_draft_vocabulary(folders, plain):
    batch = prompts()
    want = [c.token_ids for c in plain.generate(batch, GREEDY)]
    # The ids the draft lacks are in the prompts and among the model's own greedy tokens.
    assert all(max(p) >= SMALL for p in batch)
    assert sum(t >= SMALL for out in want for t in out) >= 2, want
    llm = LLM(folders["target"], device="cpu", block_size=4, max_num_batched_tokens=16,
              speculative_model=str(folders["small"]), num_speculative_tokens=K)
    proposals, _ = recording(llm)
    assert [c.token_ids for c in llm.generate(batch, GREEDY)] == want
    stats = llm.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats
    # q: a distribution over the model's ids, none past the draft's.
    for p in (p.probs for p in proposals if p.probs is not None):
        assert p.shape[1] == VOCAB and not p[:, SMALL:].any()
        assert torch.allclose(p.sum(dim=1), torch.ones(len(p)))
    # Sampled requests (Leviathan's test with the draft's q) complete too.
    sampled = llm.generate(batch, SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True))
    assert all(len(c.token_ids) == 24 and max(c.token_ids) < VOCAB for c in sampled)


def test_a_larger_draft_vocabulary_never_reaches_the_verification(folders, plain):
    batch = prompts()
    want = [c.token_ids for c in plain.generate(batch, GREEDY)]
    llm = LLM(folders["target"], device="cpu", block_size=4, speculative_model=str(folders["large"]),
              num_speculative_tokens=K)
    proposals, raw = recording(llm)
    assert [c.token_ids for c in llm.generate(batch, GREEDY)] == want
    # The draft's own argmax lay past the model's ids (else this proves little), yet none was proposed.
    assert any((logits.argmax(dim=1) >= VOCAB).any() for logits in raw)
    drafted = [t for p in proposals for draft in p.drafts for t in draft]
    assert drafted and max(drafted) < VOCAB
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens == len(drafted), stats
