"""Speculative decoding's sampling: the tokens it emits have plain sampling's distribution
(Leviathan et al.'s rejection sampling for a draft model's drawn tokens, its point-mass form
for ngram's), checked by chi-square tests over many seeds (fixed seeds: deterministic, and far
inside the bound), both on the verification alone against distributions computed here by hand
and through the engine against the model's exact probabilities; seeds repeat; prompt lookup."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from transformers import Qwen2ForCausalLM

from duoka.serve.engine import LLM
from duoka.serve.params import SamplingParams
from duoka.serve.proposers import ngram_proposal
from duoka.serve.sampling import Sampler, SampleRow
from duoka.serve.spec_verify import VerifyRows, launch_verify

V = 6
# A chi-square statistic whose p-value is below this fails: with fixed seeds a test is either
# always right or always wrong, and a right one sits far above it (asserted values print).
P_FLOOR = 1e-6


def chi_square_p(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """The p-value of observed counts against probabilities (cells expected below min_expected
    merged into one), from the chi-square survival function Q(df / 2, x / 2); 0 when a count
    falls where the distribution has no mass."""
    n = counts.sum()
    expected = probs * n
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return 0.0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def processed_by_hand(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """vLLM's order, written out: temperature, top-k, then the smallest most-likely set whose
    mass reaches top_p, renormalised."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    keep[order[:top_k]] = True
    kept = np.where(keep, p, 0) / p[keep].sum()
    before = np.cumsum(kept[order]) - kept[order]
    keep[order[before >= top_p]] = False
    out = np.where(keep, p, 0)
    return out / out.sum()


PARAMS = dict(temperature=0.8, top_k=5, top_p=0.95)
TARGET = np.array([[1.0, 0.2, -0.5, 0.7, -1.5, 0.1], [-0.3, 0.9, 0.4, -1.0, 0.2, 0.6], [0.5, 0.5, -0.2, 0.1, 0.0, -2.0]])
DRAFT = np.array([[0.1, 1.1, -0.2, 0.3, 0.5, -1.0], [0.4, 0.2, 0.9, -0.6, 0.1, 0.0]])


def verify_many(n: int, point_mass: tuple[int, int] | None, seed0: int = 0, greedy: bool = False):
    """n sequences, each with 2 drafts and a bonus row over the fixed TARGET logits; drafts drawn
    from the processed DRAFT distributions (or the same two for all: point_mass). Returns
    (drafts [n, 2], emitted token lists)."""
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, max_tokens=8) if greedy else SamplingParams(max_tokens=8, **PARAMS)
    rows, draft_rows, drafts, spans = [], [], [], []
    q = torch.tensor(np.stack([processed_by_hand(d, **PARAMS) for d in DRAFT]), dtype=torch.float32)
    for s in range(n):
        seq_rows = [SampleRow(params, seed0 + s, j, []) for j in range(3)]
        spans.append((len(rows), 3))
        rows += seq_rows
        draft_rows += [SampleRow(params, 10**9 + seed0 + s, j, []) for j in range(2)]
    if point_mass is None:
        drawn = sampler.race_log(q.repeat(n, 1).log(), draft_rows).view(n, 2)
    else:
        drawn = torch.tensor([point_mass] * n)
    for s in range(n):
        drafts += drawn[s].tolist() + [-1]
    lev = [] if point_mass is not None or greedy else [i for i in range(3 * n) if i % 3 != 2]
    plan = VerifyRows(rows, drafts, spans, lev, q.repeat(n, 1) if lev else None)
    logits = torch.tensor(TARGET, dtype=torch.float32).repeat(n, 1)
    return drawn.numpy(), launch_verify(sampler, logits, plan).result().token_ids


@pytest.mark.parametrize("point_mass", [None, (3, 1)], ids=["drawn-draft", "point-mass"])
def test_verification_emits_the_target_distribution(point_mass):
    n = 6000
    drafts, emitted = verify_many(n, point_mass)
    p = [processed_by_hand(t, **PARAMS) for t in TARGET]
    firsts = np.bincount([e[0] for e in emitted], minlength=V)
    seconds = np.bincount([e[1] for e in emitted if len(e) > 1], minlength=V)
    thirds = np.bincount([e[2] for e in emitted if len(e) > 2], minlength=V)
    # Position j's randomness is its own: given that the drafts before it were accepted, the
    # token at j still has p_j's distribution.
    for counts, probs in ((firsts, p[0]), (seconds, p[1]), (thirds, p[2])):
        assert counts.sum() > 500 and chi_square_p(counts, probs) > P_FLOOR, (counts, probs * counts.sum())
    if point_mass is None:
        # The test has the power to see a wrong distribution: the drafts' own (q) fails it.
        assert chi_square_p(np.bincount(drafts[:, 0], minlength=V), p[0]) < 1e-30
        accepted = [len(e) - 1 for e in emitted]
        # Leviathan's acceptance rate: sum over tokens of min(p, q).
        want = np.minimum(p[0], processed_by_hand(DRAFT[0], **PARAMS)).sum()
        assert abs(np.mean([a >= 1 for a in accepted]) - want) < 0.02
    else:
        assert abs(np.mean([len(e) > 1 for e in emitted]) - p[0][point_mass[0]]) < 0.02


def test_greedy_verification_accepts_exactly_the_argmax():
    best = [int(np.argmax(t)) for t in TARGET]
    _, emitted = verify_many(4, point_mass=(best[0], best[1]), greedy=True)
    assert all(e == best for e in emitted)
    _, emitted = verify_many(4, point_mass=(best[0], (best[1] + 1) % V), greedy=True)
    assert all(e == best[:2] for e in emitted)
    _, emitted = verify_many(4, point_mass=((best[0] + 1) % V, best[1]), greedy=True)
    assert all(e == best[:1] for e in emitted)


def test_seeds_repeat_whatever_the_batch():
    _, alone = verify_many(3, None, seed0=40)
    _, crowd = verify_many(50, None, seed0=0)
    assert alone == crowd[40:43]
    _, other = verify_many(3, None, seed0=90)
    assert alone != other


# ---------------------------------------------------------------- through the engine
ENGINE_VOCAB = 600
PROMPT = [17, 250, 33, 402, 17, 250, 33]
SAMPLED = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def models(saved_hf_model, tokenizer_dir, tmp_path_factory):
    """The target (and its transformers model, for exact probabilities) and a near draft."""
    out = {}
    for name, extra in (("target", {}), ("near", {"noise": 0.3})):
        folder = tmp_path_factory.mktemp(f"spec-{name}")
        shutil.copytree(saved_hf_model(seed=5, vocab_size=ENGINE_VOCAB, **extra), folder, dirs_exist_ok=True)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / file, folder / file)
        out[name] = folder
    out["hf"] = Qwen2ForCausalLM.from_pretrained(out["target"]).eval()
    return out


def exact_joint(hf) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) under temperature 1 and top-k 3, from the transformers model's logits."""
    joint = {(): 1.0}
    for _ in range(3):
        nxt = {}
        for prefix, mass in joint.items():
            with torch.no_grad():
                logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double()
            top = logits.topk(3)
            for token, prob in zip(top.indices.tolist(), top.values.softmax(-1).tolist()):
                nxt[prefix + (token,)] = mass * prob
        joint = nxt
    return joint


def test_engine_samples_the_models_distribution(models):
    """1,024 seeded requests of 3 tokens through a draft model (the second token drafted, the
    third a bonus or the next step's); the joint distribution of their tokens (27 cells)
    against the model's exact one."""
    llm = LLM(models["target"], device="cpu", speculative_model=str(models["near"]), num_speculative_tokens=2,
              speculative_disable_by_batch_size=256)
    engine = llm.engine
    n = 1024
    for s in range(n):
        engine.add_request(str(s), PROMPT, SamplingParams(seed=s, **SAMPLED))
    tokens = {str(s): [] for s in range(n)}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    joint = exact_joint(models["hf"])
    cells = sorted(joint)
    counts = np.zeros(len(cells) + 1)
    for t in tokens.values():
        counts[cells.index(tuple(t)) if tuple(t) in joint else -1] += 1
    assert counts[-1] == 0  # every sequence inside top-k 3's support
    stats = engine.stats()
    assert stats.spec_draft_tokens == n and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats
    p = chi_square_p(counts[:-1], np.array([joint[c] for c in cells]))
    assert p > P_FLOOR, p


def test_ngram_sampling_is_plain_seeded_sampling(models):
    """A point-mass draft is verified against the request's own draw, so a seeded request gives
    the very tokens it gives without speculation (its distribution, then, too: the chi-square
    tests above check the point-mass rule on its own)."""
    prompt = PROMPT * 2
    batch = [SamplingParams(seed=s, temperature=t, top_p=0.9, max_tokens=16, ignore_eos=True)
             for s, t in ((7, 1.0), (8, 1.0), (9, 0.6), (10, 1.3))]
    plain = LLM(models["target"], device="cpu")
    llm = LLM(models["target"], device="cpu", speculative_method="ngram", num_speculative_tokens=3,
              prompt_lookup_min=1, prompt_lookup_max=3)
    for params in batch:
        assert llm.generate([prompt], params)[0].token_ids == plain.generate([prompt], params)[0].token_ids
    stats = llm.engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats


def test_ngram_proposal_takes_the_latest_longest_match():
    ids = np.array([1, 2, 3, 9, 1, 2, 4, 5, 7, 1, 2])
    assert ngram_proposal(ids, 1, 2, 3) == [4, 5, 7]  # the latest "1 2", not the first
    ids = np.array([8, 1, 2, 3, 6, 2, 3, 7, 1, 2, 3])
    assert ngram_proposal(ids, 1, 3, 2) == [6, 2]  # "1 2 3" beats the later "2 3"
    assert ngram_proposal(ids, 1, 3, 9) == [6, 2, 3, 7, 1, 2, 3]  # as far as the sequence goes
    assert ngram_proposal(np.array([5, 6, 7]), 1, 3, 4) == []
    assert ngram_proposal(np.array([4, 4, 4]), 2, 2, 3) == [4]  # overlapping the suffix, one token follows
    assert ngram_proposal(np.array([4, 5, 6, 4, 5]), 3, 5, 3) == []  # under prompt_lookup_min


def test_chi_square_helper():
    probs = np.array([0.5, 0.3, 0.2])
    assert chi_square_p(np.array([500, 300, 200]), probs) == pytest.approx(1.0)
    assert chi_square_p(np.array([600, 250, 150]), probs) < 1e-6
    assert math.isclose(chi_square_p(np.array([520, 290, 190]), probs), 0.4419, abs_tol=1e-3)
