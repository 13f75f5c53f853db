"""Speculative decoding in the engine (fp32 on CPU, tiny models): greedy output equals plain
decoding token for token with a draft model and with ngram prompt lookup, through concurrent
sequences of different lengths, the prefix cache (generated blocks reused by a later prompt),
preemption, max_tokens, stop ids, an eos and stop strings that fall inside a run of accepted
tokens, logprobs, and the switch-off by batch size; a draft of another tokenizer is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from duoka.errors import DuokaError
from duoka.hub import bundled_model_dir
from duoka.serve.config import EngineConfig
from duoka.serve.engine import LLM, LLMEngine
from duoka.serve.params import SamplingParams

VOCAB = 600  # the tokenizer_dir fixture's vocabulary
K = 3
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def model_copy(saved_hf_model, tokenizer_dir, tmp_path_factory, **overrides):
    """saved_hf_model's folder, copied with the test tokenizer (the shared folder stays as it is)."""
    folder = tmp_path_factory.mktemp("spec-model")
    shutil.copytree(saved_hf_model(vocab_size=VOCAB, **overrides), folder, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def folders(saved_hf_model, tokenizer_dir, tmp_path_factory):
    """target; near: the same model with more noise (accepts some drafts, rejects others);
    same: an exact copy of the target (a draft that is always accepted)."""
    return {"target": model_copy(saved_hf_model, tokenizer_dir, tmp_path_factory, seed=5),
            "near": model_copy(saved_hf_model, tokenizer_dir, tmp_path_factory, seed=5, noise=0.22),
            "same": model_copy(saved_hf_model, tokenizer_dir, tmp_path_factory, seed=5)}


@pytest.fixture(scope="module")
def plain(folders):
    return LLM(folders["target"], device="cpu", block_size=4)


@pytest.fixture(scope="module")
def exact_draft(folders):
    """Every draft accepted: each step adds K + 1 tokens per sequence."""
    return LLM(folders["target"], device="cpu", block_size=4, speculative_model=str(folders["same"]),
               num_speculative_tokens=4)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g)
    return [torch.randint(1, VOCAB, (int(k),), generator=g).tolist() for k in lengths]


def repetitive(seed: int) -> list[int]:
    """A prompt that repeats itself: prompt lookup finds its n-grams."""
    base = prompts(1, seed=seed, lo=5, hi=6)[0]
    return base * 3 + base[:2]


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_equals_plain_decoding_token_for_token(folders, plain, method):
    """Six sequences of different lengths at once, prefills cut into chunks of at most 24 tokens
    (the draft catches up on a long context over several steps), two sharing a prefix (the
    prefix cache); then, in a 30-block cache, preemption."""
    shared = prompts(1, seed=9, lo=13, hi=14)[0]
    batch = [shared + [7, 8]] + prompts(3, seed=2) + [repetitive(3), shared + [9, 10, 11]]
    want = plain.generate(batch, GREEDY)
    spec = (dict(speculative_model=str(folders["near"])) if method == "draft_model"
            else dict(speculative_method="ngram", prompt_lookup_min=1, prompt_lookup_max=3))
    llm = LLM(folders["target"], device="cpu", block_size=4, max_num_batched_tokens=24, num_speculative_tokens=K,
              **spec)
    got = llm.generate(batch, GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.text for c in got] == [c.text for c in want]
    stats = llm.engine.stats()
    # Both outcomes happened: drafts accepted and drafts rejected (else the test proves little).
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats
    assert stats.prefix_hits >= 12 and stats.kv_usage == 0

    tight = LLM(folders["target"], device="cpu", block_size=4, num_kv_blocks=30, max_model_len=64,
                num_speculative_tokens=K, **spec)
    assert [c.token_ids for c in tight.generate(batch, GREEDY)] == [c.token_ids for c in want]
    assert tight.engine.stats().num_preemptions > 0 and tight.engine.stats().spec_accepted_tokens > 0


def test_logprobs_are_plain_decodings(folders, plain):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    engine = LLMEngine(EngineConfig(model=folders["target"], device="cpu", block_size=4,
                                    speculative_model=str(folders["same"]), num_speculative_tokens=4))
    prompt = prompts(1, seed=4)[0]
    engine.add_request("a", prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert max(len(o.new_token_ids) for o in outs) == 5  # K + 1 tokens in one output
    got = [lp for o in outs for lp in o.new_logprobs]
    want = plain.engine
    want.add_request("a", prompt, params)
    ref = []
    while want.has_unfinished():
        ref += [lp for o in want.step() for lp in o.new_logprobs]
    assert [lp.token_id for lp in got] == [lp.token_id for lp in ref]
    for a, b in zip(got, ref):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_prefix_cache_holds_no_rejected_tokens(folders, plain):
    """A later prompt made of an earlier request's prompt and output reads the blocks its
    speculative steps filled (rejected drafts were written there too, then overwritten): its
    output is plain decoding's."""
    llm = LLM(folders["target"], device="cpu", block_size=4, speculative_model=str(folders["near"]),
              num_speculative_tokens=K)
    first = prompts(1, seed=11, lo=10, hi=11)[0]
    out = llm.generate([first], GREEDY)[0].token_ids
    follow = first + out + [3, 4]
    before = llm.engine.stats()
    got = llm.generate([follow], GREEDY)[0].token_ids
    hits = llm.engine.stats().prefix_hits - before.prefix_hits
    assert hits >= 24  # the blocks of the first prompt and of most of its output
    assert got == plain.generate([follow], GREEDY)[0].token_ids
    assert before.spec_accepted_tokens < before.spec_draft_tokens  # some drafts were rejected


def test_max_tokens_stop_ids_and_stop_strings_inside_accepted_runs(plain, exact_draft):
    """With every draft accepted a step adds 5 tokens: max_tokens 7, a stop id and a stop
    string in the middle of a run end the output exactly where plain decoding ends it."""
    prompt = prompts(1, seed=4)[0]
    free = plain.generate([prompt], GREEDY)[0]
    for params in (SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(free.token_ids[7],)),
                   SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(free.text[9:12],))):
        want, got = plain.generate([prompt], params)[0], exact_draft.generate([prompt], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert len(got.token_ids) < 20
    stats = exact_draft.engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0 and stats.generation_tokens > 0


def test_eos_inside_accepted_tokens_ends_the_sequence(folders, plain, tmp_path):
    """generation_config.json names a token the output makes in the middle of a run as eos."""
    prompt = prompts(1, seed=4)[0]
    free = plain.generate([prompt], GREEDY)[0].token_ids
    at = next(i for i in (2, 3, 4, 7, 8) if free[i] not in free[:i])  # not a run's last token (1-5, 6-10)
    folder = tmp_path / "eos"
    shutil.copytree(folders["target"], folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": free[at]}))
    llm = LLM(folder, device="cpu", block_size=4, speculative_model=str(folders["same"]), num_speculative_tokens=4)
    got = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert got.token_ids == free[:at + 1] and got.finish_reason == "stop"
    assert llm.engine.stats().spec_accepted_tokens > at  # the eos came inside an accepted run


def test_speculation_switches_off_above_the_batch_size(folders, plain):
    """Four requests with --speculative-disable-by-batch-size 2: plain steps while more than
    two run, speculative ones once the short requests are done; the same tokens."""
    batch = prompts(4, seed=6)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 3, 10, 10)]
    engine = LLM(folders["target"], device="cpu", block_size=4, speculative_model=str(folders["near"]),
                 num_speculative_tokens=K, speculative_disable_by_batch_size=2).engine
    for i, (prompt, p) in enumerate(zip(batch, params)):
        engine.add_request(str(i), prompt, p)
    got = {str(i): [] for i in range(4)}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert [got[str(i)] for i in range(4)] == [plain.generate([b], p)[0].token_ids for b, p in zip(batch, params)]
    stats = engine.stats()
    assert stats.spec_steps_off > 0 and stats.spec_drafts > 0, stats


def test_a_draft_with_another_tokenizer_is_refused(folders, tmp_path):
    folder = tmp_path / "other-tokenizer"
    shutil.copytree(folders["near"], folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_model_dir() / name, folder / name)
    with pytest.raises(DuokaError, match="another tokenizer") as err:
        LLM(folders["target"], device="cpu", speculative_model=str(folder), num_speculative_tokens=2)
    assert "same family" in err.value.fix


@pytest.mark.parametrize("options, match", [
    (dict(num_speculative_tokens=2), "without a speculative method"),
    (dict(speculative_method="ngram"), "num-speculative-tokens of at least 1"),
    (dict(speculative_method="draft_model", num_speculative_tokens=2), "needs the draft model"),
    (dict(speculative_model="d", speculative_method="ngram", num_speculative_tokens=2), "is a draft model"),
    (dict(speculative_model="d", num_speculative_tokens=2, tp=2), "tensor parallelism"),
    (dict(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2),
     "1 <= min <= max"),
    (dict(speculative_model="d", num_speculative_tokens=2, prompt_lookup_max=3), "ngram only"),
])
def test_config_refusals_name_the_fix(options, match):
    with pytest.raises(DuokaError, match=match) as err:
        EngineConfig(**options)
    assert err.value.fix


def test_prompt_lookup_defaults_are_vllms():
    assert EngineConfig(speculative_method="ngram", num_speculative_tokens=2).prompt_lookup == (5, 5)
    assert EngineConfig(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_max=3).prompt_lookup == (3, 3)
    assert EngineConfig(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=2,
                        prompt_lookup_max=4).prompt_lookup == (2, 4)
    assert EngineConfig(speculative_model="d", num_speculative_tokens=2).speculation == "draft_model"
    assert EngineConfig().speculation is None
