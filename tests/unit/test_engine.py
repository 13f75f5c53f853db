"""The serving engine against transformers and against itself: greedy tokens equal
transformers' generate; batching, chunked prefill, the prefix cache and preemption change
no output (fp32 on CPU); seeds reproduce; limits are clear errors."""

import shutil

import pytest
import torch

from duoka.errors import DuokaError
from duoka.serve.config import EngineConfig
from duoka.serve.engine import LLM, LLMEngine
from duoka.serve.params import SamplingParams

VOCAB = 600  # the tokenizer_dir fixture's vocabulary
CONFIGS = [
    dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2),
    dict(tie_word_embeddings=False, num_attention_heads=7, num_key_value_heads=1, hidden_size=56),
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture
def model_folder(hf_folder, tokenizer_dir):
    def make(seed=5, **overrides):
        hf, folder = hf_folder(seed=seed, vocab_size=VOCAB, **overrides)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, folder / name)
        return hf, folder
    return make


def hf_greedy(hf, prompt: list[int], n: int, eos=None) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0, use_cache=True,
                      attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g)
    return [torch.randint(1, VOCAB, (int(k),), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("overrides", CONFIGS, ids=["tied-gqa2", "untied-gqa7"])
def test_greedy_matches_transformers_token_for_token(model_folder, overrides):
    hf, folder = model_folder(**overrides)
    llm = LLM(folder, device="cpu", block_size=4)
    batch = prompts(3, seed=1)
    for prompt, got in zip(batch, llm.generate(batch, GREEDY)):
        assert got.token_ids == hf_greedy(hf, prompt, 24)
        assert got.finish_reason == "length"
    assert len(set(got.token_ids)) > 3  # a degenerate single-token loop would prove little


def test_batching_chunking_prefix_cache_and_preemption_change_nothing(model_folder):
    _, folder = model_folder(seed=6)
    shared = prompts(1, seed=9, lo=30, hi=31)[0]
    batch = prompts(16, seed=2) + [shared + p for p in prompts(4, seed=3)]
    solo = LLM(folder, device="cpu", block_size=4, max_num_seqs=1)
    want = [solo.generate([p], GREEDY)[0].token_ids for p in batch]

    # All at once, prefills cut into chunks of at most 7 tokens beside the decodes.
    chunked = LLM(folder, device="cpu", block_size=4, max_num_batched_tokens=7)
    assert [c.token_ids for c in chunked.generate(batch, GREEDY)] == want
    stats = chunked.engine.stats()
    assert stats.prefix_hits >= 3 * 28  # the shared 30-token prefix: seven full blocks reused per later request
    assert stats.kv_usage == 0

    # A cache of 40 blocks (160 tokens) for 20 requests of up to 94 tokens: preemption.
    tight = LLM(folder, device="cpu", block_size=4, num_kv_blocks=40, max_model_len=128)
    assert [c.token_ids for c in tight.generate(batch, GREEDY)] == want
    assert tight.engine.stats().num_preemptions > 0


def test_stop_ids_stop_strings_and_text(model_folder):
    hf, folder = model_folder(seed=7)
    llm = LLM(folder, device="cpu")
    prompt = prompts(1, seed=4)[0]
    free = llm.generate([prompt], GREEDY)[0]
    eos = free.token_ids[5]
    first = free.token_ids.index(eos)
    stopped = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(eos,)))[0]
    assert stopped.token_ids == free.token_ids[: first + 1] == hf_greedy(hf, prompt, 24, eos=eos)
    assert stopped.finish_reason == "stop"

    tok = llm.engine.tokenizer
    assert free.text == tok.decode(free.token_ids, skip_special_tokens=True)
    stop = free.text[len(free.text) // 2:][:3]
    cut = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=(stop,), ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]


def test_seeded_sampling_reproduces_whatever_the_batch(model_folder):
    _, folder = model_folder(seed=8)
    llm = LLM(folder, device="cpu")
    prompt = prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].token_ids
    crowd = llm.generate(prompts(5, seed=6) + [prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=11,
                                                                       ignore_eos=True))[-1].token_ids
    other = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=12, ignore_eos=True))[0]
    assert alone == crowd and alone != other.token_ids
    greedy = llm.generate([prompt], GREEDY)[0].token_ids[:16]
    top1 = SamplingParams(max_tokens=16, temperature=0.8, top_k=1, seed=1, ignore_eos=True)
    assert llm.generate([prompt], top1)[0].token_ids == greedy


def test_limits_are_clear_errors(model_folder):
    _, folder = model_folder(seed=9, max_position_embeddings=32)
    engine = LLMEngine(EngineConfig(model=folder, device="cpu"))
    with pytest.raises(DuokaError, match="maximum context of 32"):
        engine.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=5))
    with pytest.raises(DuokaError, match="outside the vocabulary"):
        engine.add_request("b", [VOCAB + 5], SamplingParams(max_tokens=5))
    with pytest.raises(DuokaError, match="empty"):
        engine.add_request("c", [], SamplingParams(max_tokens=5))
    with pytest.raises(DuokaError, match="longer than the model's context"):
        LLMEngine(EngineConfig(model=folder, device="cpu", max_model_len=64))


def test_abort_frees_blocks_at_once(model_folder):
    _, folder = model_folder(seed=10)
    engine = LLMEngine(EngineConfig(model=folder, device="cpu", block_size=4))
    engine.add_request("x", prompts(1, seed=7, lo=30, hi=31)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.stats().kv_usage > 0
    engine.abort("x")
    assert engine.stats().kv_usage == 0
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "abort" and not engine.has_unfinished()


def test_compiled_blocks_stay_within_the_recompile_limit(model_folder):
    """Steps of every shape (single decodes, prefill chunks, mixed, one-block tables) through
    the compiled decoder blocks: the same tokens as uncompiled, and few enough compiled graphs
    that torch never hits its recompile limit (a hard error under fullgraph)."""
    import random

    _, folder = model_folder(seed=11)
    rng = random.Random(0)
    batch = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(10)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=0, ignore_eos=True) for _ in batch]
    steps_between = [rng.randint(0, 2) for _ in batch]  # requests arrive while others run
    torch._dynamo.reset()
    options = dict(device="cpu", max_model_len=64, block_size=4, max_num_batched_tokens=13)
    results = {}
    for compiled in (False, True):
        engine = LLMEngine(EngineConfig(model=folder, compile=compiled, **options), log=lambda m: None)
        tokens = {}

        def step():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

        for i, (prompt, p, wait) in enumerate(zip(batch, params, steps_between)):
            engine.add_request(str(i), prompt, p)
            for _ in range(wait):
                step()
        while engine.has_unfinished():
            step()
        results[compiled] = tokens
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()  # later tests count their own compilations
    assert results[True] == results[False]
    assert 0 < graphs <= torch._dynamo.config.recompile_limit - 2, graphs


def _drive(engine, requests, rng=None):
    """Run requests to the end (joining a few per step and aborting now and then when rng is
    given); -> {id: (text, token ids, finish reason)}."""
    got, pending, live = {}, list(requests), []
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3) if rng else len(pending)):
            if pending:
                rid, prompt, params = pending.pop(0)
                engine.add_request(rid, prompt, params)
                live.append(rid)
        if rng and live and rng.random() < 0.04:
            engine.abort(rng.choice(live))
        for out in engine.step():
            text, ids, _ = got.get(out.request_id, ("", [], None))
            got[out.request_id] = (text + out.new_text, ids + out.new_token_ids, out.finish_reason)
    return got


def _random_workload(trial: int):
    """10 requests with random sampling settings (greedy or seeded, top-k/p, penalties, stop
    strings, eos or not), half of them sharing a prefix."""
    import random

    rng = random.Random(trial)
    shared = [rng.randrange(1, 4096) for _ in range(rng.randint(8, 40))]
    requests = []
    for i in range(10):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1, 4096) for _ in range(rng.randint(1, 40))]
        kw = dict(max_tokens=rng.randint(1, 16), temperature=rng.choice([0.0, 0.7, 1.0]), seed=rng.randrange(1000),
                  ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.3:
            kw.update(top_p=rng.choice([0.3, 0.9]), top_k=rng.choice([1, 5, 50]))
        if rng.random() < 0.4:
            kw["stop"] = rng.sample(["the", " of", "\n", ".", "s "], 2)
        if rng.random() < 0.3:
            kw.update(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2))
        requests.append((f"q{i}", prompt, SamplingParams(**kw)))
    return requests


def test_random_workloads_give_each_request_its_solo_result():
    """Two random workloads joining at random steps, some requests aborted, in a cache of 32 blocks
    of 4 tokens (room for one 128-token request) with small chunks: every request that was
    not aborted gets what it gets alone; some of them went through preemption."""
    import random

    options = dict(device="cpu", max_model_len=128, block_size=4)
    quiet = dict(log=lambda m: None)
    solo = LLMEngine(EngineConfig(max_num_seqs=1, **options), **quiet)
    preemptions = 0
    for trial in range(2):  # one with 7-token prefill chunks, one with 64
        requests = _random_workload(trial)
        engine = LLMEngine(EngineConfig(max_num_seqs=8, max_num_batched_tokens=[7, 64][trial % 2], num_kv_blocks=32,
                                        **options), **quiet)
        busy = _drive(engine, requests, random.Random(1000 + trial))
        preemptions += engine.stats().num_preemptions
        compared = 0
        for rid, prompt, params in requests:
            if busy[rid][2] != "abort":
                assert busy[rid] == _drive(solo, [(rid, prompt, params)])[rid], (trial, rid)
                compared += 1
        assert compared >= 6
    assert preemptions > 0
