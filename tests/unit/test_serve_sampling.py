"""Sampler: draws follow the (penalised, tempered, truncated) distribution; a seeded row's
token depends only on (seed, output index), never on the batch; greedy and its limits are
argmax; penalties and logprobs follow OpenAI's definitions; SamplingParams rejects bad values."""

import math
import random
import warnings

import pytest
import torch

from duoka.errors import DuokaError
from duoka.serve.params import MAX_LOGPROBS, SamplingParams
from duoka.serve.sampling import Sampler, SampleRow, _mix64_, _signed, log_exponential_noise, mix64, row_key

V = 8


def rows_of(params, n, seed=0, output_ids=()):
    return [SampleRow(params, seed, i, list(output_ids)) for i in range(n)]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token outside the kept set was drawn"
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target distribution, written independently of the sampler (float64, no batching)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = p.argsort(descending=True).tolist()
    if top_k:  # top-p then measures mass within the top k, renormalised (as vLLM and transformers)
        p[order[top_k:]] = 0
        p /= p.sum()
    keep, mass = [], 0.0
    for i in order:
        if p[i] == 0 or mass >= top_p:
            break
        keep.append(i)
        mass += p[i].item()
    out = torch.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()


# 1% critical values of chi-square by degrees of freedom: the draws are a fixed function of
# the seeds, so a pass is deterministic, not a matter of luck each run.
CHI2_1PCT = {1: 6.63, 2: 9.21, 3: 11.34, 4: 13.28, 5: 15.09, 6: 16.81, 7: 18.48}


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8),
                                                     (0.8, 6, 0.9)])
def test_draws_follow_the_distribution(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 20000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    # Many output indices of a few seeds: the same rows a long generation would use.
    rows = [SampleRow(params, seed, i, []) for seed in range(4) for i in range(n // 4)]
    tokens = Sampler().sample(logits.expand(n, V), rows).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    probs = reference_probs(logits, temperature, top_k, top_p)
    dof = int((probs > 0).sum()) - 1
    assert chi_square(counts, probs) < CHI2_1PCT[dof]


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    rng = random.Random(0)
    vocab = 64
    choices = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_k=5),
               SamplingParams(top_p=0.6, temperature=1.5), SamplingParams(temperature=0),
               SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, top_k=20)]
    logits = torch.randn(60, vocab, generator=torch.Generator().manual_seed(1)) * 2
    rows = [SampleRow(rng.choice(choices), rng.randrange(2**63), rng.randrange(100),
                      [rng.randrange(vocab) for _ in range(rng.randrange(5))]) for _ in range(60)]
    sampler = Sampler()
    together = sampler.sample(logits, rows).token_ids
    # Alone, a row without top-k/top-p takes the path without a sort: same token all the same.
    alone = [sampler.sample(logits[i:i + 1], [row]).token_ids[0] for i, row in enumerate(rows)]
    assert together == alone
    perm = list(range(60))
    rng.shuffle(perm)
    shuffled = sampler.sample(logits[perm], [rows[i] for i in perm]).token_ids
    assert shuffled == [together[i] for i in perm]
    assert len(set(together)) > 10  # not one token everywhere


def test_the_noise_depends_on_the_output_index_and_the_seed():
    logits = torch.zeros(1, 1000)  # uniform
    sampler = Sampler()
    params = SamplingParams()
    by_index = [sampler.sample(logits, [SampleRow(params, 7, i, [])]).token_ids[0] for i in range(50)]
    by_seed = [sampler.sample(logits, [SampleRow(params, s, 0, [])]).token_ids[0] for s in range(50)]
    assert len(set(by_index)) > 40 and len(set(by_seed)) > 40
    assert by_index == [sampler.sample(logits, [SampleRow(params, 7, i, [])]).token_ids[0] for i in range(50)]


def test_hash_is_splitmix64_with_wraparound():
    rng = random.Random(3)
    xs = [rng.getrandbits(64) for _ in range(2000)] + [0, 1, 2**63 - 1, 2**63, 2**64 - 1]
    out = _mix64_(torch.tensor([_signed(x) for x in xs])).tolist()
    assert [o & (2**64 - 1) for o in out] == [mix64(x) for x in xs]
    # The noise: element (r, i) is output i + 1 of SplitMix64 seeded with the row's key.
    key = row_key(123, 4)
    vocab_ids = torch.tensor([[0, 5, 99]])
    got = log_exponential_noise(torch.tensor([[_signed(key)]]), vocab_ids)[0].tolist()
    for v, g in zip(vocab_ids[0].tolist(), got):
        z = mix64(key + (v + 1) * 0x9E3779B97F4A7C15)
        u = min(max((z >> 1) * 2.0**-63, 2.0**-63), 1 - 2.0**-24)
        assert g == pytest.approx(math.log(-math.log1p(-u)), rel=1e-5)


def test_greedy_and_its_limits_are_argmax():
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(2)) * 3
    argmax = logits.argmax(dim=-1).tolist()
    sampler = Sampler()
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
                   SamplingParams(temperature=1.5, top_p=1e-6), SamplingParams(temperature=1e-30)):
        assert sampler.sample(logits, rows_of(params, 200)).token_ids == argmax, params
    # Greedy rows mixed with sampled ones keep their argmax.
    mixed = [SampleRow(SamplingParams(temperature=0 if i % 2 else 1.0), i, 0, []) for i in range(200)]
    tokens = sampler.sample(logits, mixed).token_ids
    assert tokens[1::2] == argmax[1::2] and tokens[::2] != argmax[::2]


def test_penalties_follow_openai_and_logprobs_are_raw():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    outputs = [[3, 3, 3, 7], [], [3, 5]]
    params = [SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=1.25, logprobs=16),
              SamplingParams(temperature=0.7, presence_penalty=-2, logprobs=16),
              SamplingParams(temperature=2.0, top_k=3, frequency_penalty=-0.5, logprobs=16)]
    rows = [SampleRow(p, 9, 0, o) for p, o in zip(params, outputs)]
    result = Sampler().sample(logits, rows)
    assert torch.equal(logits, before)  # the caller's logits are not touched
    for r, (p, out) in enumerate(zip(params, outputs)):
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=16).float()
        expected = logits[r] - p.presence_penalty * (counts > 0) - p.frequency_penalty * counts
        lp = torch.log_softmax(expected, dim=-1)  # before temperature and top-k
        got = result.logprobs[r]
        assert got.token_id == result.token_ids[r]
        assert got.logprob == pytest.approx(lp[got.token_id].item(), abs=1e-6)
        assert dict(got.top) == pytest.approx({i: v for i, v in enumerate(lp.tolist())}, abs=1e-6)
    assert result.token_ids[0] == int((logits[0] - 0.5 * torch.tensor([0, 0, 0, 1, 0, 0, 0, 1] + [0] * 8)
                                       - 1.25 * torch.tensor([0, 0, 0, 3, 0, 0, 0, 1] + [0] * 8)).argmax())


def test_logprobs_only_for_rows_that_ask():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(logprobs=5), SamplingParams(), SamplingParams(logprobs=0, temperature=0),
              SamplingParams(logprobs=MAX_LOGPROBS, top_p=0.5)]
    result = Sampler().sample(logits, [SampleRow(p, 1, 0, []) for p in params])
    assert result.logprobs[1] is None
    assert result.logprobs[2].top == [] and result.logprobs[2].token_id == int(logits[2].argmax())
    for r, k in ((0, 5), (3, MAX_LOGPROBS)):
        got = result.logprobs[r]
        lp = torch.log_softmax(logits[r], dim=-1)
        assert len(got.top) == k
        assert [v for _, v in got.top] == sorted((v for _, v in got.top), reverse=True)
        assert [i for i, _ in got.top] == lp.topk(k).indices.tolist()
        assert got.logprob == pytest.approx(lp[result.token_ids[r]].item(), abs=1e-6)


@pytest.mark.parametrize("fields,names", [
    (dict(temperature=float("nan")), "temperature=nan"), (dict(temperature=-0.1), "temperature=-0.1"),
    (dict(top_p=0), "(0, 1]"), (dict(top_p=1.5), "(0, 1]"), (dict(top_k=-2), "top_k=-2"),
    (dict(max_tokens=0), "max_tokens=0"), (dict(logprobs=21), "[0, 20]"), (dict(logprobs=-1), "logprobs=-1"),
    (dict(presence_penalty=2.5), "[-2, 2]"), (dict(frequency_penalty=float("nan")), "frequency_penalty=nan"),
    (dict(stop=["ok", ""]), "empty string"), (dict(stop=["s"] * 17), "at most 16"),
    (dict(stop_token_ids=[-1]), "negative"), (dict(seed=2**64), "seed="), (dict(max_tokens=1.5), "max_tokens=1.5"),
    (dict(temperature="hot"), "temperature='hot'"),
])
def test_bad_params_name_field_value_and_range(fields, names):
    with pytest.raises(DuokaError) as e:
        SamplingParams(**fields)
    assert names in e.value.cause and e.value.fix


def test_params_normalise():
    p = SamplingParams(top_k=-1, stop="\n\n", stop_token_ids=[5, 6], temperature=1)
    assert p.top_k == 0 and p.stop == ("\n\n",) and p.stop_token_ids == (5, 6) and isinstance(p.temperature, float)
    assert SamplingParams(temperature=0).greedy and not p.greedy
    hash(p)  # frozen and hashable


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_with_one_host_sync():
    rng = random.Random(6)
    vocab = 1000
    choices = [SamplingParams(), SamplingParams(temperature=0.7, top_k=50), SamplingParams(top_p=0.9, logprobs=3),
               SamplingParams(temperature=0), SamplingParams(presence_penalty=1.0, logprobs=0)]
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(7)) * 3
    rows = [SampleRow(rng.choice(choices), rng.randrange(2**63), rng.randrange(1000),
                      [rng.randrange(vocab) for _ in range(rng.randrange(10))]) for _ in range(64)]
    sampler = Sampler()
    cpu = sampler.sample(logits, rows)
    gpu_logits = logits.cuda()
    sampler.sample(gpu_logits, rows)  # warm-up: first-use allocations
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            gpu = sampler.sample(gpu_logits, rows)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert gpu.token_ids == cpu.token_ids
    for a, b in zip(gpu.logprobs, cpu.logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and [i for i, _ in a.top] == [i for i, _ in b.top]
