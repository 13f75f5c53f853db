"""Issue 48: scoring requests (prompt logprobs) share the prefix cache through the entries kept
with its blocks (serve.logprob_cache). On the bundled tiny model in fp32, every prompt token's
entry with the cache equals the one computed without it (token, rank and top-k ids exactly,
values within 1e-6 relative; read back from a block, bit for bit what was computed): lm-eval's four
choices after one shared context one after another, together and as one API prompt list,
block-aligned or not, max_tokens 0 and 1, a larger k than stored (computed again, counted as a
bypass), blocks a plain request cached (no entries: bypass), and an eviction in between."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_serve_prompt_logprobs import TEXTS, Served, engine_config, quiet, reference  # noqa: F401 (fixture)

from duoka.serve.blocks import BlockManager
from duoka.serve.engine import LLMEngine
from duoka.serve.logprob_columns import EntryRows
from duoka.serve.params import RequestOutput, SamplingParams
from duoka.serve.scheduler import Sequence

BLOCK = 16
# Relative: rows computed in another batch composition (a choice's tail over its cached context
# beside other tails) may differ by a few fp32 ulps on CPU (3.3e-6 measured at a logprob of
# -5.8); the same composition gives the same bits.
EXACT = 1e-6


def close(a: float, b: float) -> bool:
    return abs(a - b) <= EXACT * max(1.0, abs(b))
CONTINUATIONS = [" and so it goes.", " but not today", " then it ran away quickly, very", " yes"]


def scoring(k: int, max_tokens: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, prompt_logprobs=k, ignore_eos=True)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, together: bool,
        tag: str) -> list[RequestOutput]:
    """Each prompt's first output (which holds its prompt logprobs): added all at once (one
    step admits them together) or one after another, each finished before the next arrives."""
    firsts: dict[str, RequestOutput] = {}

    def drain():
        while engine.has_unfinished():
            for out in engine.step():
                firsts.setdefault(out.request_id, out)

    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
        if not together:
            drain()
    drain()
    return [firsts[rid] for rid in ids]


def check_equal(got: list[RequestOutput], want: list[RequestOutput], k: int) -> None:
    """Entries with the cache against those without: the same tokens, ranks and top-k ids,
    values close."""
    for g, w in zip(got, want):
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) and g.prompt_logprobs[0] is None
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
            assert len(a.top) == k and close(a.logprob, b.logprob)
            assert all(close(x, y) for (_, x), (_, y) in zip(a.top, b.top))


def check_records(engine: LLMEngine) -> None:
    """Entries live only with cached blocks: an evicted block's went with it."""
    bm = engine.blocks
    assert set(bm.logprobs.records) <= set(bm.cached)


@pytest.fixture(scope="module")
def engines():
    """(with the prefix cache, without it); one step may hold every test's prompts."""
    config = {"max_model_len": 256, "num_kv_blocks": 96, "max_num_batched_tokens": 1024}
    return (LLMEngine(engine_config(**config), log=quiet),
            LLMEngine(engine_config(enable_prefix_caching=False, **config), log=quiet))


def mc_question(engine: LLMEngine, tag: str, texts: list[str], context_len: int | None = None) -> list[list[int]]:
    """lm-eval's multiple choice: one context (token ids, cut to context_len; its tag keeps it
    apart from the other tests' in the module's engines) and each continuation's ids after it,
    as lm-eval sends them."""
    context = engine.tokenizer.encode(f"{tag}: " + " ".join(texts))[:context_len]
    return [context + engine.tokenizer.encode(c) for c in CONTINUATIONS]


def computed(engine: LLMEngine, prompts, params, together, tag) -> tuple[list[RequestOutput], int]:
    before = engine.stats().prompt_tokens
    outs = run(engine, prompts, params, together, tag)
    return outs, engine.stats().prompt_tokens - before


@pytest.mark.parametrize("together", [False, True], ids=["one-after-another", "together"])
@pytest.mark.parametrize("aligned", [False, True], ids=["unaligned", "block-aligned"])
def test_choices_share_the_context_with_equal_logprobs(engines, together, aligned):
    cache, plain = engines
    tag = f"share {together} {aligned}"
    prompts = mc_question(cache, tag, TEXTS if aligned else TEXTS[:2], 4 * BLOCK if aligned else None)
    context = len(prompts[0]) - len(cache.tokenizer.encode(CONTINUATIONS[0]))
    assert context >= 3 * BLOCK and (context % BLOCK == 0) == aligned
    bypass = cache.stats().logprob_bypass_tokens
    got, n_cache = computed(cache, prompts, scoring(1, max_tokens=int(together)), together, f"share-{together}-{aligned}")
    # Without the cache the choices are computed alike however they come: in one step here.
    want, n_plain = computed(plain, prompts, scoring(1, max_tokens=int(together)), True, f"share-{together}-{aligned}")
    check_equal(got, want, 1)
    # The first choice computes everything; each other one reads the context's full blocks
    # but the last (computed again: its last row scores that choice's first token).
    read = (context // BLOCK - 1) * BLOCK
    assert [o.num_cached_tokens for o in got] == [0, read, read, read]
    assert n_plain == sum(map(len, prompts)) and n_cache == n_plain - 3 * read
    assert cache.stats().logprob_bypass_tokens == bypass  # no block lacked entries
    # Rows read back from the blocks are the first choice's, bit for bit.
    for other in got[1:]:
        assert other.prompt_logprobs[1:read + 1] == got[0].prompt_logprobs[1:read + 1]
    check_records(cache)


def test_a_larger_k_than_stored_computes_again_then_a_smaller_one_reads(engines):
    cache, plain = engines
    prompts = mc_question(cache, "k", TEXTS[1:])[:2]
    run(cache, prompts[:1], scoring(1), False, "k1")  # entries of k = 1 kept
    stats = cache.stats()
    got5 = run(cache, prompts[1:], scoring(5), False, "k5")
    after = cache.stats()
    assert got5[0].num_cached_tokens == 0
    assert after.logprob_bypass_requests == stats.logprob_bypass_requests + 1
    assert after.logprob_bypass_tokens > stats.logprob_bypass_tokens
    check_equal(got5, run(plain, prompts[1:], scoring(5), False, "k5"), 5)
    # The k = 5 request kept its entries (its blocks replaced the k = 1 records): k = 3 reads them.
    got3 = run(cache, prompts[:1], scoring(3), False, "k3")
    assert got3[0].num_cached_tokens > 0
    check_equal(got3, run(plain, prompts[:1], scoring(3), False, "k3"), 3)
    check_records(cache)


def test_blocks_a_plain_request_cached_carry_no_logprobs(engines):
    cache, plain = engines
    prompt = cache.tokenizer.encode("plain: " + TEXTS[1] + " " + TEXTS[0])
    run(cache, [prompt], SamplingParams(max_tokens=1, temperature=0), False, "plain")
    stats = cache.stats()
    got = run(cache, [prompt], scoring(2), False, "after-plain")
    assert got[0].num_cached_tokens == 0
    assert cache.stats().logprob_bypass_tokens - stats.logprob_bypass_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    check_equal(got, run(plain, [prompt], scoring(2), False, "after-plain"), 2)
    # Its own blocks now carry entries: the next scoring request reads them.
    again = run(cache, [prompt], scoring(2), False, "again")
    assert again[0].num_cached_tokens > 0
    check_equal(again, got, 2)


def test_entries_are_evicted_with_their_blocks(reference):  # noqa: F811 (the imported fixture)
    """A cache of 12 blocks: the context's blocks (and their entries) are evicted by other
    prompts between two choices, which then computes its context again, still right."""
    engine = LLMEngine(engine_config(num_kv_blocks=12, max_model_len=128, max_num_batched_tokens=256), log=quiet)
    prompts = mc_question(engine, "evicted", TEXTS[::2])
    run(engine, prompts[:1], scoring(1), False, "first")
    assert len(engine.blocks.logprobs) >= 3
    for i in range(3):  # other prompts' blocks take the whole cache, one after another
        run(engine, [engine.tokenizer.encode(f"other {i}: " + " ".join(TEXTS))], scoring(1), False, f"evict-{i}")
    check_records(engine)
    got = run(engine, prompts[1:2], scoring(1), False, "second")
    assert got[0].num_cached_tokens == 0
    ids = prompts[1]
    want = reference(ids)
    values = torch.tensor([e.logprob for e in got[0].prompt_logprobs[1:]])
    torch.testing.assert_close(values, want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=1e-4, rtol=0)


def test_prompt_list_through_the_api_reads_the_shared_context():
    """lm-eval's local-completions: one request, the four choices as a prompt list, echo with
    logprobs and max_tokens 1, chunked prefill (24-token steps): equal with and without the cache."""
    bodies = []
    for enabled in (True, False):
        served = Served(enable_prefix_caching=enabled)
        prompts = mc_question(served.engine, "api", TEXTS[1:])
        bodies.append(served.post("/v1/completions", prompt=prompts, max_tokens=1, echo=True, logprobs=1,
                                  return_tokens_as_token_ids=True))
        served.close()
    cached, plain = bodies
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for a, b in zip(cached["choices"], plain["choices"]):
        la, lb = a["logprobs"], b["logprobs"]
        assert la["tokens"] == lb["tokens"] and la["token_logprobs"][0] is None
        assert all(close(x, y) for x, y in zip(la["token_logprobs"][1:], lb["token_logprobs"][1:]))
        for ta, tb in zip(la["top_logprobs"][1:], lb["top_logprobs"][1:]):
            assert ta.keys() == tb.keys() and all(close(ta[t], tb[t]) for t in ta)


def test_mc_workload_computes_fewer_prompt_tokens(engines, capsys):
    """A small multiple-choice eval (3 questions of 4 choices, sent together as lm-eval's batch
    does): the prompt tokens computed with the cache against without it."""
    cache, plain = engines
    prompts = [p for i in range(3) for p in mc_question(cache, f"Question {i}", TEXTS[i:] + TEXTS[:i] + ["Answer:"])]
    got, n_cache = computed(cache, prompts, scoring(1, max_tokens=1), True, "mc")
    want, n_plain = computed(plain, prompts, scoring(1, max_tokens=1), True, "mc")
    check_equal(got, want, 1)
    with capsys.disabled():
        print(f"\nMC workload: {n_plain} prompt tokens computed without sharing, {n_cache} with: "
              f"{n_plain / n_cache:.2f}x fewer")
    assert n_plain == sum(map(len, prompts)) and n_cache < n_plain / 2


def scored_sequence(bm: BlockManager, name: str, ids: list[int], k: int = 1) -> Sequence:
    """A scoring sequence admitted and computed whole, as the engine would: its prompt's
    entries (token t's logprob -t / 64, fp32 as the head's; rank t; top [(t, -t / 64)] * k)
    landed, its blocks registered."""
    seq = Sequence(name, ids, scoring(k))
    assert bm.allocate(seq, len(ids)) == len(ids) - seq.num_computed
    t = np.asarray(ids[seq.prompt_logprob_rows + 1:], dtype=np.int64)
    value = np.float32(-t / 64).astype(np.float64)
    top_ids, top_values = np.repeat(t[:, None], k, 1), np.repeat(value[:, None], k, 1)
    seq.prompt_logprob_entries.append(EntryRows(t, value, t, top_ids, top_values))
    seq.num_computed = seq.prompt_logprob_rows = len(ids) - 1
    bm.register_computed(seq)
    return seq


def test_a_token_entry_is_kept_with_the_block_that_holds_the_token():
    """Blocks of 4: a shared context of 10 tokens (2 full blocks); the second prompt reads block 0
    only, its rows 0..3 from the records (row 3 scores token 4, the first of block 1), and
    computes from token 4 on; a larger k reads nothing (a bypass of the 2 cached blocks)."""
    bm = BlockManager(32, 4)
    context = list(range(100, 110))
    first = scored_sequence(bm, "a", context + [1, 2, 3])
    assert len(bm.logprobs) == 3  # blocks 0..2 are all prompt tokens with landed rows
    second = Sequence("b", context + [7, 8, 9], scoring(1))
    bm.allocate(second, 64)
    assert second.num_computed == 4 and second.prompt_logprob_rows == 4
    assert second.prompt_logprob_entries.entries() == first.prompt_logprob_entries.entries()[:4]
    assert [e.token_id for e in second.prompt_logprob_entries.entries()] == context[1:5]
    wider = Sequence("c", context + [5, 5, 5], scoring(2))
    bm.allocate(wider, 64)
    assert wider.num_computed == 0 and not wider.prompt_logprob_entries
    assert (bm.logprob_bypass_requests, bm.logprob_bypass_tokens) == (1, 8)


def test_a_scoring_request_waits_only_where_waiting_lets_it_read_more():
    """In flight: another scoring request's blocks not yet cached. Waiting pays when its entries
    would let this one read a block (two blocks shared: it needs one past what it reads)."""
    bm = BlockManager(32, 4)
    running = Sequence("running", list(range(100, 113)), scoring(1))
    bm.allocate(running, 64)  # admitted, nothing computed yet
    in_flight = bm.entries_in_flight([running])
    assert len(in_flight) == 3
    two = Sequence("two", list(range(100, 108)) + [1, 2], scoring(1))
    one = Sequence("one", list(range(100, 104)) + [1, 2, 3, 4, 5], scoring(1))
    wider = Sequence("wider", list(range(100, 108)) + [1, 2], scoring(2))
    assert bm.waits_for_entries(two, in_flight)
    assert not bm.waits_for_entries(one, in_flight)  # one shared block: it would read nothing more
    assert not bm.waits_for_entries(wider, in_flight)  # entries of k 1 would not serve k 2


def test_a_run_of_blocks_is_kept_and_read_back_at_once():
    """BlockLogprobs.put keeps a run of blocks from one conversion (block 0 one entry short, a
    block not to keep skipped, each record its own arrays) and read gives back any slots of
    consecutive blocks with k cut, exactly the rows put."""
    from duoka.serve.logprob_cache import BlockLogprobs

    cache, bs, k = BlockLogprobs(4), 4, 2
    rng = np.random.default_rng(0)
    n = 3 * bs - 1  # blocks 0..2, block 0 without its first token
    rows = EntryRows(np.arange(1, n + 1), rng.standard_normal(n).astype(np.float32).astype(np.float64),
                     np.arange(n) + 1, rng.integers(0, 1000, (n, k)), rng.standard_normal((n, k)).astype(np.float32))
    cache.put([b"b0", None, b"b2"], rows, k)
    assert len(cache) == 2 and not cache.has(b"b1", 1) and cache.has(b"b2", 2) and not cache.has(b"b2", 3)
    cache.put([b"b1"], EntryRows(*(column[bs - 1:2 * bs - 1] for column in rows)), k)  # the skipped one, alone
    got = cache.read([b"b0", b"b1", b"b2"], list(range(2, 11)), 2, 1)  # tokens 2..10: slot 2 of block 0 on
    assert got.token_ids.tolist() == list(range(2, 11))
    for name in ("logprobs", "ranks"):
        assert np.array_equal(getattr(got, name), getattr(rows, name)[1:10]), name
    assert np.array_equal(got.top_ids, rows.top_ids[1:10, :1]) and np.array_equal(got.top_values, rows.top_values[1:10, :1])
    # Each record owns its arrays: no view keeps the run's conversion (or the request's rows) alive.
    assert all(array.base is None for r in cache.records.values()
               for array in (r.logprobs, r.ranks, r.top_ids, r.top_values))
    with pytest.raises(AssertionError, match="without an entry"):
        cache.read([b"b0"], [0, 1], 0, 1)  # block 0's token 0 has none
