"""Sampler: draws follow the (penalised, tempered, truncated) distribution; a seeded row's
token depends only on (seed, output index), never on the batch; greedy and its limits are
argmax; penalties and logprobs follow OpenAI's definitions; repetition_penalty and min_p
follow transformers'; masks, logit_bias and min_tokens remove exactly the tokens they name;
SamplingParams rejects bad values."""

import dataclasses
import math
import random
import warnings

import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from duoka.errors import DuokaError
from duoka.serve.engine import RequestLimits
from duoka.serve.params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, StructuredOutput
from duoka.serve.sampling import Sampler, SampleRow, TokenMasks, _mix64_, _signed, log_exponential_noise, mix64, row_key

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
    ({"temperature": float("nan")}, "temperature=nan"), ({"temperature": -0.1}, "temperature=-0.1"),
    ({"top_p": 0}, "(0, 1]"), ({"top_p": 1.5}, "(0, 1]"), ({"top_k": -2}, "top_k=-2"),
    ({"max_tokens": -1}, "max_tokens=-1"), ({"logprobs": 21}, "[0, 20]"), ({"logprobs": -1}, "logprobs=-1"),
    ({"prompt_logprobs": 21}, "prompt_logprobs=21"),
    ({"presence_penalty": 2.5}, "[-2, 2]"), ({"frequency_penalty": float("nan")}, "frequency_penalty=nan"),
    ({"stop": ["ok", ""]}, "empty string"), ({"stop": ["s"] * 17}, "at most 16"),
    ({"stop_token_ids": [-1]}, "negative"), ({"seed": 2**64}, "seed="), ({"max_tokens": 1.5}, "max_tokens=1.5"),
    ({"temperature": "hot"}, "temperature='hot'"),
    ({"repetition_penalty": 0}, "repetition_penalty=0.0"), ({"repetition_penalty": -1.5}, "repetition_penalty=-1.5"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty=nan"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty=inf"),
    ({"repetition_penalty": None}, "repetition_penalty=None"),
    ({"min_p": -0.1}, "min_p=-0.1"), ({"min_p": 1.5}, "min_p=1.5"), ({"min_p": float("nan")}, "min_p=nan"),
    ({"logit_bias": {"x": 1}}, "logit_bias key 'x'"), ({"logit_bias": {"1.5": 1}}, "logit_bias key '1.5'"),
    ({"logit_bias": {1.5: 1}}, "logit_bias key 1.5"), ({"logit_bias": {True: 1}}, "logit_bias key True"),
    ({"logit_bias": {-1: 1}}, "logit_bias key -1"), ({"logit_bias": {"-3": 1}}, "logit_bias key '-3'"),
    ({"logit_bias": {5: 100.5}}, "logit_bias[5]=100.5"), ({"logit_bias": {5: -101}}, "logit_bias[5]=-101"),
    ({"logit_bias": {5: "a"}}, "logit_bias[5]='a'"), ({"logit_bias": {5: float("nan")}}, "logit_bias[5]=nan"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias[5]=inf"), ({"logit_bias": {5: None}}, "logit_bias[5]=None"),
    ({"logit_bias": {5: 1, "5": 2}}, "logit_bias names token id 5 twice"), ({"logit_bias": 5}, "logit_bias=5"),
    ({"logit_bias": {i: 1 for i in range(MAX_LOGIT_BIAS + 1)}}, f"at most {MAX_LOGIT_BIAS}"),
    ({"min_tokens": -1}, "min_tokens=-1"), ({"min_tokens": 17}, "min_tokens=17"),
    ({"min_tokens": 2.0}, "min_tokens=2.0"),
    ({"structured": "json"}, "structured='json'"),
])
def test_bad_params_name_field_value_and_range(fields, names):
    with pytest.raises(DuokaError) as e:
        SamplingParams(**fields)
    assert names in e.value.cause and e.value.fix


@pytest.mark.parametrize("fields,names", [
    ({"kind": "xml", "spec": ""}, "kind='xml'"), ({"kind": "ebnf", "spec": None}, "spec=None"),
    ({"kind": "json_schema", "spec": "{}", "name": 3}, "name=3"),
    ({"kind": "json_object", "spec": "{}"}, "kind=json_object"),
    ({"kind": "json_schema", "spec": " "}, "kind=json_schema needs a spec"),
    ({"kind": "ebnf", "spec": ""}, "kind=ebnf"),
])
def test_bad_structured_output_names_field_and_value(fields, names):
    with pytest.raises(DuokaError) as e:
        StructuredOutput(**fields)
    assert names in e.value.cause and e.value.fix


def test_new_params_normalise():
    p = SamplingParams(logit_bias={"7": 1, 3: -2.5, " 12 ": 100}, min_tokens=16, repetition_penalty=2, min_p=1)
    assert p.logit_bias == ((3, -2.5), (7, 1.0), (12, 100.0)) and isinstance(p.repetition_penalty, float)
    assert dataclasses.replace(p, max_tokens=20) == dataclasses.replace(p, max_tokens=20, logit_bias=p.logit_bias)
    assert SamplingParams(logit_bias=None).logit_bias == () == SamplingParams(logit_bias={}).logit_bias
    assert p.has_penalties and not SamplingParams(repetition_penalty=1).has_penalties
    structured = StructuredOutput("json_schema", '{"type": "object"}', "answer")
    hash(p), hash(SamplingParams(structured=structured))  # frozen and hashable
    assert StructuredOutput("json_object", "").name == ""
    with pytest.raises(DuokaError, match="min_tokens=3"):
        dataclasses.replace(SamplingParams(min_tokens=3), max_tokens=2)


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
    assert len(syncs) <= 1, [str(w.message) for w in syncs]  # the result comes back through an event
    assert gpu.token_ids == cpu.token_ids
    for a, b in zip(gpu.logprobs, cpu.logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and [i for i, _ in a.top] == [i for i, _ in b.top]


# ---------------------------------------------------------------- masks, logit_bias, min_tokens, min_p, repetition
def bitmask(allowed: list[set[int]], words: int) -> torch.Tensor:
    """xgrammar's format, written independently: bit j of word w allows token 32 * w + j."""
    bits = torch.zeros(len(allowed), words, dtype=torch.int32)
    for r, tokens in enumerate(allowed):
        for w in range(words):
            word = sum(1 << (t - 32 * w) for t in tokens if 32 * w <= t < 32 * w + 32)
            bits[r, w] = word - 2**32 if word >= 2**31 else word  # bit 31 is int32's sign bit
    return bits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_masked_rows_only_take_allowed_tokens_and_others_are_unaffected(temperature):
    vocab, n = 70, 400  # 3 words; the third holds tokens 64..95, of which 70..95 are beyond the logits
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(n, vocab, generator=g) * 3
    params = SamplingParams(temperature=temperature, logprobs=5)
    rows = [SampleRow(params, 3, i, []) for i in range(n)]
    constrained = list(range(0, n, 2))
    rng = random.Random(12)
    allowed = [set(rng.sample(range(vocab), rng.randrange(1, 6))) | {90, 95} for _ in constrained]
    allowed[0] = {31, 63, 95}  # sign bits of words 0 and 1; 95 is beyond the vocabulary
    sampler = Sampler()
    free = sampler.sample(logits, rows)
    before = logits.clone()
    got = sampler.sample(logits, rows, TokenMasks(constrained, bitmask(allowed, 3)))
    assert torch.equal(logits, before)
    for j, r in enumerate(constrained):
        assert got.token_ids[r] in allowed[j] - {90, 95}
        lp = torch.log_softmax(logits[r].masked_fill(~torch.isin(torch.arange(vocab), torch.tensor(sorted(allowed[j]))),
                                                     float("-inf")), dim=-1)
        assert got.logprobs[r].logprob == pytest.approx(lp[got.token_ids[r]].item(), abs=1e-5)
        if temperature == 0:
            assert got.token_ids[r] == int(lp.argmax())
    assert got.token_ids[0] in (31, 63)
    unconstrained = [r for r in range(n) if r % 2]
    assert [got.token_ids[r] for r in unconstrained] == [free.token_ids[r] for r in unconstrained]
    assert [got.logprobs[r].top for r in unconstrained] == [free.logprobs[r].top for r in unconstrained]
    if temperature:  # the draws spread over the allowed tokens, not only the most likely
        assert sum(got.token_ids[r] != int(logits[r].argmax()) for r in constrained) > 20


def test_a_narrow_mask_disallows_the_rest_and_an_empty_one_is_ignored():
    logits = torch.zeros(3, 40)
    logits[:, 35] = 5  # the favourite lies beyond one word
    bits = bitmask([{2, 3}, set(), {36}], 1)  # row 1 allows nothing; row 2 only a token beyond 32 bits
    result = Sampler().sample(logits, [SampleRow(SamplingParams(temperature=0, logprobs=2), 0, 0, [])] * 3,
                              TokenMasks([0, 1, 2], bits))
    assert result.token_ids == [2, 35, 35]  # 2 and 3 tie: the first; rows 1 and 2: nothing allowed, unconstrained
    assert all(math.isfinite(lp.logprob) for lp in result.logprobs)
    with pytest.raises(ValueError, match="int32"):
        TokenMasks([0], bits.long())
    with pytest.raises(ValueError, match="not all rows"):
        Sampler().sample(logits, [SampleRow(SamplingParams(), 0, 0, [])] * 3, TokenMasks([3], bits[:1]))


def test_logit_bias_forces_and_bans_tokens():
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(300, 50, generator=g)
    argmax = logits.argmax(dim=-1)
    sampler = Sampler()
    forced = sampler.sample(logits, [SampleRow(SamplingParams(temperature=t, logit_bias={"17": 100}), i, i, [])
                                     for i, t in enumerate([0.0, 1.0] * 150)]).token_ids
    assert forced == [17] * 300
    banned = [SampleRow(SamplingParams(temperature=0, logit_bias={int(argmax[i]): -100}, logprobs=3), i, 0, [])
              for i in range(300)]
    result = sampler.sample(logits, banned)
    for i, (token, lp) in enumerate(zip(result.token_ids, result.logprobs)):
        biased = logits[i].clone()
        biased[argmax[i]] -= 100
        assert token == int(biased.argmax()) != int(argmax[i])
        assert lp.logprob == pytest.approx(torch.log_softmax(biased, -1)[token].item(), abs=1e-5)
    # Sampled with the favourite banned: never drawn (its probability is e^-100 of the rest).
    top = int(logits[0].argmax())
    drawn = sampler.sample(logits[:1].expand(2000, -1), rows_of(SamplingParams(logit_bias={top: -100}), 2000))
    assert top not in drawn.token_ids and len(set(drawn.token_ids)) > 20
    limits = RequestLimits(vocab_size=50, max_model_len=64, block_size=4, num_blocks=100)
    limits.check([1], SamplingParams(logit_bias={49: 1}))
    with pytest.raises(DuokaError, match="logit_bias token id 50 is outside the vocabulary"):
        limits.check([1], SamplingParams(logit_bias={3: 1, 50: 1}))


def test_min_tokens_blocks_the_stop_ids_until_reached():
    vocab, eos, stop = 30, 7, 9
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(14))
    logits[0, eos] = 20  # by far the most likely
    logits[0, stop] = 19
    sampler = Sampler()
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, min_tokens=3, logprobs=2)
        rows = [SampleRow(params, 5, i, [], blocked_ids=(eos, stop, 500)) for i in range(5)]  # 500: beyond the logits
        result = sampler.sample(logits.expand(5, -1), rows)
        assert eos not in result.token_ids[:3] and stop not in result.token_ids[:3]
        assert result.token_ids[3:] == [eos, eos]
        assert result.logprobs[0].top[0][0] not in (eos, stop) and result.logprobs[3].top[0][0] == eos
    # A row without min_tokens, or without blocked ids, is not affected.
    plain = [SampleRow(SamplingParams(temperature=0), 0, 0, [], blocked_ids=(eos,)),
             SampleRow(SamplingParams(temperature=0, min_tokens=2), 0, 0, [])]
    assert sampler.sample(logits.expand(2, -1), plain).token_ids == [eos, eos]
    # Where a mask leaves only the blocked ids, they stay: the constraint wins.
    row = SampleRow(SamplingParams(temperature=1.0, min_tokens=3, logprobs=0), 5, 0, [], blocked_ids=(eos,))
    result = sampler.sample(logits, [row], TokenMasks([0], bitmask([{eos}], 1)))
    assert result.token_ids == [eos] and result.logprobs[0].logprob == 0


def min_p_reference(logits: torch.Tensor, temperature: float, min_p: float, top_k: int) -> torch.Tensor:
    """transformers' warpers in vLLM's order: temperature, min-p, top-k (float64)."""
    scores = MinPLogitsWarper(min_p)(None, logits.double()[None] / temperature)[0]
    if top_k:
        scores[scores < scores.topk(top_k).values[-1]] = float("-inf")
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("temperature,min_p,top_k", [(1.0, 0.1, 0), (0.7, 0.3, 0), (1.5, 0.05, 4)])
def test_min_p_draws_follow_transformers_warper(temperature, min_p, top_k):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 20000
    params = SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k)
    rows = [SampleRow(params, seed, i, []) for seed in range(4) for i in range(n // 4)]
    tokens = Sampler().sample(logits.expand(n, V), rows).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    probs = min_p_reference(logits, temperature, min_p, top_k)
    assert 1 < int((probs > 0).sum()) < V  # min-p removes some tokens, not all but one
    assert chi_square(counts, probs) < CHI2_1PCT[int((probs > 0).sum()) - 1]
    # min_p=1 keeps only the most likely token.
    assert Sampler().sample(logits[None], [SampleRow(SamplingParams(min_p=1.0), 1, 0, [])]).token_ids == [0]


def test_repetition_penalty_matches_transformers():
    g = torch.Generator().manual_seed(15)
    vocab = 20
    logits = torch.randn(6, vocab, generator=g) * 3
    prompts = [[1, 2, 3, 3], [5], [0, 19, 4], [], [7, 8], [2]]
    outputs = [[4, 4, 6], [], [19, 10], [11, 12, 11], [], [2, 3]]
    pens = [1.3, 0.7, 2.0, 1.1, 1.0, 1.25]
    params = [SamplingParams(temperature=t, repetition_penalty=p, logprobs=MAX_LOGPROBS, top_k=k,
                             frequency_penalty=f, presence_penalty=f / 2)
              for p, t, k, f in zip(pens, [0, 0.8, 0, 1.2, 0, 0], [0, 3, 0, 0, 0, 0], [0, 0, 0.5, 0, 0, -1])]
    rows = [SampleRow(p, 3, 0, o, pr) for p, o, pr in zip(params, outputs, prompts)]
    before = logits.clone()
    result = Sampler().sample(logits, rows)
    assert torch.equal(logits, before)
    for r, p in enumerate(params):
        ids = torch.tensor([prompts[r] + outputs[r]], dtype=torch.long)
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[r:r + 1].clone())[0]
        counts = torch.bincount(torch.tensor(outputs[r], dtype=torch.long), minlength=vocab).float()
        want = want - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        lp = torch.log_softmax(want, dim=-1)
        got = result.logprobs[r]
        assert dict(got.top) == pytest.approx(dict(enumerate(lp.tolist())), abs=1e-6)
        if p.greedy:
            assert got.token_id == int(want.argmax())
    changed = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[1, 2, 3, 4, 6]]), logits[:1].clone())
    assert not torch.equal(changed, logits[:1])  # the reference did penalise something


def test_seeded_rows_with_every_new_parameter_draw_the_same_tokens_in_any_batch():
    rng = random.Random(16)
    vocab, n = 64, 60
    choices = [SamplingParams(min_p=0.1), SamplingParams(repetition_penalty=1.5, top_p=0.8),
               SamplingParams(logit_bias={3: 5, 9: -100}, temperature=0.7), SamplingParams(min_tokens=4, top_k=10),
               SamplingParams(temperature=0, repetition_penalty=0.8, min_tokens=2), SamplingParams()]
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(17)) * 2
    rows = [SampleRow(rng.choice(choices), rng.randrange(2**63), rng.randrange(6),
                      [rng.randrange(vocab) for _ in range(rng.randrange(5))],
                      [rng.randrange(vocab) for _ in range(rng.randrange(8))], (0, 1, 2)) for _ in range(n)]
    constrained = sorted(rng.sample(range(n), 20))
    bits = bitmask([set(rng.sample(range(vocab), 12)) for _ in constrained], 2)
    sampler = Sampler()
    together = sampler.sample(logits, rows, TokenMasks(constrained, bits)).token_ids

    def alone(i):
        masks = TokenMasks([0], bits[constrained.index(i)][None]) if i in constrained else None
        return sampler.sample(logits[i:i + 1], [rows[i]], masks).token_ids[0]

    assert together == [alone(i) for i in range(n)]
    perm = list(range(n))
    rng.shuffle(perm)
    where = {old: new for new, old in enumerate(perm)}
    masks = TokenMasks([where[i] for i in constrained], bits)
    shuffled = sampler.sample(logits[perm], [rows[i] for i in perm], masks).token_ids
    assert shuffled == [together[i] for i in perm]
    assert len(set(together)) > 10


def test_bias_then_repetition_then_frequency_and_presence():
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0, -0.5, 2.0]])
    params = SamplingParams(temperature=0, logit_bias={1: 3.0, 4: -1.0, 5: 1.0}, repetition_penalty=2.0,
                            frequency_penalty=0.5, presence_penalty=0.25, logprobs=6)
    row = SampleRow(params, 0, 0, [4, 4, 1], prompt_ids=[0, 2])
    got = dict(Sampler().sample(logits, [row]).logprobs[0].top)
    biased = logits[0] + torch.tensor([0, 3.0, 0, 0, -1.0, 1.0])  # 1 becomes positive, 4 more negative
    seen = torch.tensor([1, 1, 1, 0, 1, 0], dtype=torch.bool)
    repeated = torch.where(seen, torch.where(biased > 0, biased / 2, biased * 2), biased)
    want = repeated - 0.5 * torch.tensor([0, 1, 0, 0, 2, 0]) - 0.25 * torch.tensor([0, 1, 0, 0, 1, 0])
    assert got == pytest.approx(dict(enumerate(torch.log_softmax(want, -1).tolist())), abs=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_with_one_host_sync_with_every_new_parameter():
    rng = random.Random(18)
    vocab, n = 1000, 64
    choices = [SamplingParams(min_p=0.05, logprobs=2), SamplingParams(repetition_penalty=1.3, top_k=50),
               SamplingParams(logit_bias={5: 10, 7: -100}, top_p=0.9), SamplingParams(temperature=0, min_tokens=3),
               SamplingParams(frequency_penalty=0.5, repetition_penalty=0.9, logprobs=5), SamplingParams()]
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(19)) * 3
    rows = [SampleRow(rng.choice(choices), rng.randrange(2**63), rng.randrange(6),
                      [rng.randrange(vocab) for _ in range(rng.randrange(10))],
                      [rng.randrange(vocab) for _ in range(rng.randrange(30))], (0, 1, 2)) for _ in range(n)]
    constrained = sorted(rng.sample(range(n), 16))
    masks = TokenMasks(constrained, bitmask([set(rng.sample(range(vocab), 40)) for _ in constrained], 32))
    sampler = Sampler()
    cpu = sampler.sample(logits, rows, masks)
    gpu_logits = logits.cuda()
    sampler.sample(gpu_logits, rows, masks)  # warm-up: first-use allocations
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            gpu = sampler.sample(gpu_logits, rows, masks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]  # the result comes back through an event
    assert gpu.token_ids == cpu.token_ids
    for a, b in zip(gpu.logprobs, cpu.logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and [i for i, _ in a.top] == [i for i, _ in b.top]
