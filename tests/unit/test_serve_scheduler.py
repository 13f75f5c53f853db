"""Scheduler and block manager, driven by a fake model (pure Python, no torch).

The fake model keeps a token-level "KV cache" (one slot per block slot) and, for each scheduled
chunk, first checks that every earlier position of the sequence reads back its own token
through the block table (what attention would see), then writes the chunk. It samples
token = f(position), so a finished request's output is known in advance whatever the
batching, chunking, prefix sharing or preemption did.
"""

import random

import pytest

from duoka.serve.blocks import BlockManager
from duoka.serve.params import SamplingParams
from duoka.serve.scheduler import ScheduledBatch, Scheduler, SeqStatus, Sequence

EOS = 2
NEVER_EOS = frozenset({-1})


def f(position: int) -> int:
    """The fake model's next token after `position` tokens; never EOS (2) or a test stop id."""
    return 1000 + (position * 7) % 97


def expected_output(prompt_len: int, n: int) -> list[int]:
    return [f(prompt_len + k) for k in range(n)]


class FakeModel:
    def __init__(self, bm: BlockManager, token_fn=f):
        self.bm = bm
        self.slots: list[int | None] = [None] * (bm.num_blocks * bm.block_size)
        self.token_fn = token_fn

    def slot(self, seq: Sequence, pos: int) -> int:
        bs = self.bm.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def step(self, batch: ScheduledBatch) -> dict[str, int]:
        sampled = {}
        for item in batch.items:
            seq = item.seq
            assert item.start == seq.num_computed and item.num_new >= 1
            assert item.start + item.num_new <= seq.num_tokens
            assert len(seq.block_table) * self.bm.block_size >= item.start + item.num_new
            for pos in range(item.start):  # the context attention reads
                assert self.slots[self.slot(seq, pos)] == seq.all_ids[pos], (seq, pos)
            for pos in range(item.start, item.start + item.num_new):
                block = seq.block_table[pos // self.bm.block_size]
                # a shared or cached block is never written: others read it
                assert self.bm.ref_counts[block] == 1 and self.bm.hash_of[block] is None, (seq, pos)
                self.slots[self.slot(seq, pos)] = seq.all_ids[pos]
            assert item.sample == (item.start + item.num_new == seq.num_tokens and seq.params.max_tokens > 0)
            if item.sample:
                sampled[seq.request_id] = self.token_fn(seq.num_tokens)
        return sampled


def check_invariants(sched: Scheduler):
    bm = sched.block_manager
    refs = [0] * bm.num_blocks
    for seq in sched.running:
        assert seq.status is SeqStatus.RUNNING and seq.num_computed < seq.num_tokens
        for b in seq.block_table:
            refs[b] += 1
    for seq in sched.waiting:
        assert seq.status is SeqStatus.WAITING and not seq.block_table and seq.num_computed == 0
    assert refs == bm.ref_counts
    assert set(bm.free_queue) == {b for b in range(bm.num_blocks) if refs[b] == 0}
    assert all(bm.hash_of[b] == h for h, b in bm.cached.items())
    assert sum(h is not None for h in bm.hash_of) == len(bm.cached)
    assert len(sched.running) <= sched.max_num_seqs


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=256, eos=NEVER_EOS, caching=True,
         prefill_cap=0):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    sched = Scheduler(bm, max_num_seqs, budget, max_model_len, eos, max_prefill_beside_decodes=prefill_cap)
    return sched, FakeModel(bm)


def decodes_and_prefill(batch: ScheduledBatch) -> tuple[int, int]:
    """(decodes, prompt tokens) of a batch just scheduled (before update appends the tokens)."""
    decodes = [item.seq.num_tokens - item.start == 1 for item in batch.items]
    return sum(decodes), sum(item.num_new for item, d in zip(batch.items, decodes) if not d)


def prompt(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def run(sched: Scheduler, model: FakeModel, max_steps=10_000, on_step=None, counts=None):
    """Step until nothing is left; returns the batches (and each one's decodes_and_prefill in counts)."""
    batches = []
    while sched.has_unfinished():
        assert len(batches) < max_steps, "no progress"
        batch = sched.schedule()
        assert batch.num_tokens <= sched.max_num_batched_tokens
        decodes, prefill = decodes_and_prefill(batch)
        if decodes and sched.max_prefill_beside_decodes:
            assert prefill <= sched.max_prefill_beside_decodes
        if counts is not None:
            counts.append((decodes, prefill))
        assert batch.items or batch.preempted
        sched.update(batch, model.step(batch))
        check_invariants(sched)
        batches.append(batch)
        if on_step:
            on_step(len(batches), batch)
    return batches


def test_fcfs_continuous_batching():
    sched, model = make(max_num_seqs=2)
    seqs = [Sequence(f"r{i}", prompt(5, 10 * i), SamplingParams(max_tokens=n)) for i, n in enumerate([2, 5, 3])]
    for seq in seqs:
        sched.add(seq)
    batches = run(sched, model)
    ids = [[item.seq.request_id for item in b.items] for b in batches]
    # r2 waits (max_num_seqs=2) until r0 leaves after its 2nd token, then joins the very next step
    assert ids[:4] == [["r0", "r1"], ["r0", "r1"], ["r1", "r2"], ["r1", "r2"]]
    first_step_of = {rid: next(i for i, b in enumerate(ids) if rid in b) for rid in ("r0", "r1", "r2")}
    assert first_step_of == {"r0": 0, "r1": 0, "r2": 2}
    for seq, n in zip(seqs, [2, 5, 3]):
        assert seq.status is SeqStatus.FINISHED and seq.finish_reason == "length"
        assert seq.output_ids == expected_output(5, n)
    assert sched.block_manager.num_free == 64 and sched.block_manager.usage == 0.0


def test_chunked_prefill_respects_budget_and_covers_every_token():
    sched, model = make(budget=8, max_num_seqs=4)
    seqs = [Sequence("long", prompt(21), SamplingParams(max_tokens=4)),
            Sequence("short", prompt(5, 500), SamplingParams(max_tokens=6))]
    for seq in seqs:
        sched.add(seq)
    covered = {s.request_id: [] for s in seqs}
    batches = run(sched, model)
    for b in batches:
        assert b.num_tokens <= 8
        for item in b.items:
            covered[item.seq.request_id].append((item.start, item.num_new, item.sample))
    # the long prompt goes in chunks of the whole budget; the short one waits for leftover budget
    assert covered["long"][:3] == [(0, 8, False), (8, 8, False), (16, 5, True)]
    assert [n for _, n, _ in covered["long"][3:]] == [1, 1, 1]
    for seq in seqs:  # contiguous chunks from 0 to the last token, each token computed once
        pos = 0
        for start, n, _ in covered[seq.request_id]:
            assert start == pos
            pos += n
        assert pos == seq.num_tokens - 1
        assert seq.output_ids == expected_output(seq.num_prompt_tokens, seq.params.max_tokens)
    # "short" (5 tokens) joins in step 3, next to the 5-token last chunk of "long"
    assert [(i.seq.request_id, i.num_new) for i in batches[2].items] == [("long", 5), ("short", 3)]


def test_prefix_cache_hit_counts_tokens_and_computes_the_last_prompt_token():
    sched, model = make(block_size=4)
    bm = sched.block_manager
    shared = prompt(8, 100)  # two full blocks
    a = Sequence("a", shared + [1, 2, 3], SamplingParams(max_tokens=3))
    sched.add(a)
    sched.update(b := sched.schedule(), model.step(b))  # a's prompt computed; its 2 full blocks registered
    assert a.num_cached_tokens == 0 and (bm.prefix_queries, bm.prefix_hits) == (11, 0)
    c = Sequence("c", shared + [7], SamplingParams(max_tokens=3))
    d = Sequence("d", list(shared), SamplingParams(max_tokens=3))  # the whole prompt is cached blocks
    sched.add(c)
    sched.add(d)
    batch = sched.schedule()
    new = {i.seq.request_id: (i.start, i.num_new) for i in batch.items}
    assert new["c"] == (8, 1)
    assert new["d"] == (4, 4)  # never the whole prompt: the last block is recomputed for its logits
    assert c.block_table[:2] == a.block_table[:2] and d.block_table[0] == a.block_table[0]
    assert d.block_table[1] != a.block_table[1]
    assert (c.num_cached_tokens, d.num_cached_tokens) == (8, 4)
    assert (bm.prefix_queries, bm.prefix_hits) == (11 + 9 + 8, 12)
    assert bm.ref_counts[a.block_table[0]] == 3
    sched.update(batch, model.step(batch))
    run(sched, model)
    for seq in (a, c, d):
        assert seq.output_ids == expected_output(seq.num_prompt_tokens, 3)


def test_prompt_rows_owed_are_computed_not_read_from_the_cache():
    """A request that wants prompt logprobs computes every prompt row not yet scored, cached or
    not; max_tokens 0 samples nothing and finishes with its prompt; a recompute (preemption)
    reads from the cache only the rows already scored."""
    sched, model = make(block_size=4)
    sched.add(Sequence("plain", prompt(13), SamplingParams(max_tokens=1)))
    run(sched, model)  # its 3 full blocks are cached
    scored = Sequence("scored", prompt(13), SamplingParams(max_tokens=0, prompt_logprobs=1))
    sched.add(scored)
    items = [(i.start, i.num_new, i.sample) for b in run(sched, model) for i in b.items]
    assert items == [(0, 13, False)] and scored.num_cached_tokens == 0
    assert (scored.finish_reason, scored.output_ids, scored.prompt_logprob_rows) == ("length", [], 12)
    again = Sequence("again", prompt(13), SamplingParams(max_tokens=2, prompt_logprobs=0))
    again.prompt_logprob_rows = 9  # rows 0..8 scored before a preemption: two blocks may come from the cache
    sched.add(again)
    items = [(i.start, i.num_new, i.sample) for b in run(sched, model) for i in b.items]
    assert items[0] == (8, 5, True) and again.prompt_logprob_rows == 12
    assert again.output_ids == expected_output(13, 2)


def test_equal_blocks_after_different_prefixes_do_not_match():
    sched, model = make(block_size=4)
    a = Sequence("a", [1, 1, 1, 1, 5, 6, 7, 8, 9], SamplingParams(max_tokens=1))
    b = Sequence("b", [2, 2, 2, 2, 5, 6, 7, 8, 9], SamplingParams(max_tokens=1))
    sched.add(a)
    run(sched, model)
    sched.add(b)
    run(sched, model)
    assert b.num_cached_tokens == 0
    assert a.all_ids[4:8] == b.all_ids[4:8] and a.block_hashes[1] != b.block_hashes[1]


def test_freed_blocks_keep_their_hash_until_reused():
    sched, model = make(num_blocks=8, block_size=4, budget=64)
    bm = sched.block_manager
    shared = prompt(8, 300)
    first = Sequence("first", shared + [1], SamplingParams(max_tokens=2))
    sched.add(first)
    run(sched, model)
    assert bm.num_free == 8 and len(bm.cached) == 2  # prompt blocks of "first", still cached
    # a later user of the prefix hits the freed blocks: they leave the free list (ref 0 -> 1)
    second = Sequence("second", shared + [2, 3], SamplingParams(max_tokens=1))
    sched.add(second)
    batch = sched.schedule()
    assert second.num_cached_tokens == 8 and batch.items[0].start == 8
    assert all(bm.ref_counts[b] == 1 and b not in bm.free_queue for b in second.block_table[:2])
    sched.update(batch, model.step(batch))
    check_invariants(sched)
    assert not sched.has_unfinished()
    # other prompts fill the cache: allocation takes the least recently freed blocks first and
    # drops their hashes, so the shared prefix is evicted
    for i in range(3):
        sched.add(Sequence(f"filler{i}", prompt(15, 1000 + 50 * i), SamplingParams(max_tokens=1)))
        run(sched, model)
    third = Sequence("third", shared + [4], SamplingParams(max_tokens=1))
    sched.add(third)
    run(sched, model)
    assert third.num_cached_tokens == 0


def test_eviction_takes_least_recently_freed_and_tail_blocks_first():
    sched, model = make(num_blocks=6, block_size=4, budget=64)
    old = Sequence("old", prompt(9, 100), SamplingParams(max_tokens=1))  # 2 cached blocks + 1 partial
    sched.add(old)
    run(sched, model)
    new = Sequence("new", prompt(9, 200), SamplingParams(max_tokens=1))
    sched.add(new)
    run(sched, model)
    # 3 blocks for a 9-token prompt: the free partial blocks and old's blocks go first
    sched.add(Sequence("filler", prompt(9, 900), SamplingParams(max_tokens=1)))
    run(sched, model)
    again_old = Sequence("old2", prompt(9, 100), SamplingParams(max_tokens=1))
    again_new = Sequence("new2", prompt(9, 200), SamplingParams(max_tokens=1))
    sched.add(again_new)
    sched.add(again_old)
    run(sched, model)
    assert again_new.num_cached_tokens == 8  # freed later: survived
    assert again_old.num_cached_tokens == 4  # its second block went first, its first survived


def test_preemption_under_a_tiny_cache_finishes_every_request_correctly():
    # 6 blocks of 4 = 24 slots; each request needs up to 10 + 8 - 1 = 17 of them
    sched, model = make(num_blocks=6, block_size=4, max_num_seqs=4, budget=16)
    lens = [10, 7, 9, 6, 8]
    seqs = [Sequence(f"r{i}", prompt(n, 100 * i), SamplingParams(max_tokens=8)) for i, n in enumerate(lens)]
    for seq in seqs:
        sched.add(seq)
    preempted = []
    batches = run(sched, model)
    for b in batches:
        preempted += [s.request_id for s in b.preempted]
        assert not {s.request_id for s in b.preempted} & {i.seq.request_id for i in b.items}
    assert preempted, "the cache is too small to run these without preemption"
    for seq in seqs:
        assert seq.status is SeqStatus.FINISHED and seq.finish_reason == "length"
        assert seq.output_ids == expected_output(seq.num_prompt_tokens, 8)
        assert seq.num_cached_tokens == 0  # distinct prompts: nothing to share at first admission
    assert sum(s.num_preemptions for s in seqs) == len(preempted)
    assert sched.block_manager.num_free == 6


def test_preempted_sequences_return_to_the_front_in_order():
    # 3 blocks of 4; three 4-token prompts fill one block each, then all need a second one
    sched, model = make(num_blocks=3, block_size=4, max_num_seqs=4, budget=64)
    seqs = [Sequence(f"r{i}", prompt(4, 100 * i), SamplingParams(max_tokens=8)) for i in range(3)]
    late = Sequence("late", prompt(4, 900), SamplingParams(max_tokens=1))
    for seq in seqs:
        sched.add(seq)
    sched.update(b := sched.schedule(), model.step(b))
    sched.add(late)
    # r0 takes r2's block; r1 then finds none and, being the last one running, yields itself
    batch = sched.schedule()
    assert [s.request_id for s in batch.preempted] == ["r2", "r1"]
    assert [i.seq.request_id for i in batch.items] == ["r0"]
    assert [s.request_id for s in sched.waiting] == ["r1", "r2", "late"]
    assert all(s.num_computed == 0 and not s.block_table and s.status is SeqStatus.WAITING for s in batch.preempted)
    sched.update(batch, model.step(batch))
    check_invariants(sched)
    run(sched, model)
    for seq in seqs:
        assert seq.output_ids == expected_output(4, 8)
    assert late.output_ids == expected_output(4, 1)


def test_abort_frees_blocks_at_once_and_is_not_resurrected_by_update():
    sched, model = make(num_blocks=16, max_num_seqs=2)
    bm = sched.block_manager
    a, b, c = (Sequence(r, prompt(9, 100 * i), SamplingParams(max_tokens=5)) for i, r in enumerate("abc"))
    for seq in (a, b, c):
        sched.add(seq)
    sched.update(batch := sched.schedule(), model.step(batch))
    used = bm.num_blocks - bm.num_free
    assert sched.abort("a") is a
    assert a.status is SeqStatus.FINISHED and a.finish_reason == "abort" and not a.block_table
    assert bm.num_free == bm.num_blocks - used + 3
    assert sched.abort("c") is c and sched.num_waiting == 0  # a waiting one leaves the queue
    assert sched.abort("a") is None and sched.abort("nope") is None
    # aborted between schedule() and update(): the model's token for it is dropped
    batch = sched.schedule()
    sampled = model.step(batch)
    sched.abort("b")
    assert sched.update(batch, sampled) == []
    assert b.status is SeqStatus.FINISHED and b.finish_reason == "abort" and b.num_output_tokens == 1
    assert not sched.has_unfinished() and bm.num_free == bm.num_blocks
    check_invariants(sched)


def test_max_model_len_finishes_with_length():
    sched, model = make(max_model_len=12)
    seq = Sequence("r", prompt(9), SamplingParams(max_tokens=100))
    sched.add(seq)
    run(sched, model)
    assert seq.finish_reason == "length" and seq.num_tokens == 12 and seq.num_output_tokens == 3


def test_stop_token_ids_eos_and_ignore_eos():
    def token_fn(position):  # 5 at position 12, eos at 14, else f
        return {12: 5, 14: EOS}.get(position, f(position))

    def go(params):
        bm = BlockManager(32, 4)
        sched = Scheduler(bm, 4, 64, 256, frozenset({EOS}))
        seq = Sequence("r", prompt(10), params)
        sched.add(seq)
        run(sched, FakeModel(bm, token_fn))
        return seq

    seq = go(SamplingParams(max_tokens=20))
    assert seq.finish_reason == "stop" and seq.output_ids[-1] == EOS and seq.num_output_tokens == 5
    seq = go(SamplingParams(max_tokens=20, stop_token_ids=(5,)))
    assert seq.finish_reason == "stop" and seq.output_ids[-1] == 5 and seq.num_output_tokens == 3
    seq = go(SamplingParams(max_tokens=20, ignore_eos=True))
    assert seq.finish_reason == "length" and seq.num_output_tokens == 20 and EOS in seq.output_ids
    seq = go(SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(EOS,)))  # explicit ids still stop
    assert seq.finish_reason == "stop" and seq.num_output_tokens == 5
    seq = go(SamplingParams(max_tokens=5))  # eos on the max_tokens-th token: "stop" wins
    assert seq.finish_reason == "stop"


def test_finish_from_the_engine_and_reason_override():
    sched, model = make()
    a, b = Sequence("a", prompt(5), SamplingParams(max_tokens=1)), Sequence("b", prompt(5, 99), SamplingParams())
    sched.add(a)
    sched.add(b)
    sched.update(batch := sched.schedule(), model.step(batch))
    assert a.finish_reason == "length"
    sched.finish(a, "stop")  # a stop string in the token that also hit max_tokens
    assert a.finish_reason == "stop"
    sched.finish(b, "stop")
    assert b.status is SeqStatus.FINISHED and not sched.has_unfinished()
    check_invariants(sched)


def test_prefix_caching_off():
    sched, model = make(caching=False)
    bm = sched.block_manager
    for r in ("a", "b"):
        sched.add(Sequence(r, prompt(12), SamplingParams(max_tokens=2)))
        run(sched, model)
    assert not bm.cached and bm.prefix_hits == 0 and bm.prefix_queries == 0


def test_waiting_head_is_never_overtaken():
    sched, model = make(num_blocks=5, block_size=4, max_num_seqs=4, budget=64)
    sched.add(Sequence("running", prompt(8), SamplingParams(max_tokens=4)))  # holds 3 blocks at most
    sched.update(batch := sched.schedule(), model.step(batch))
    big = Sequence("big", prompt(13, 100), SamplingParams(max_tokens=2))  # needs 4 blocks, 2 free
    small = Sequence("small", prompt(2, 200), SamplingParams(max_tokens=2))  # would fit
    sched.add(big)
    sched.add(small)
    batch = sched.schedule()
    assert [i.seq.request_id for i in batch.items] == ["running"]
    sched.update(batch, model.step(batch))
    run(sched, model)
    assert big.status is SeqStatus.FINISHED and small.status is SeqStatus.FINISHED


def test_add_asserts_a_request_fits_alone():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(AssertionError):
        sched.add(Sequence("r", prompt(10), SamplingParams(max_tokens=7)))  # 17 > 16 slots
    sched.add(Sequence("ok", prompt(10), SamplingParams(max_tokens=6)))
    with pytest.raises(AssertionError):
        sched.add(Sequence("ok", prompt(3), SamplingParams(max_tokens=1)))  # id in flight


def test_prefill_beside_decodes_is_capped_and_an_idle_step_takes_the_whole_budget():
    sched, model = make(budget=64, prefill_cap=6)
    seqs = [Sequence("a", prompt(40), SamplingParams(max_tokens=30)),
            Sequence("b", prompt(20, 300), SamplingParams(max_tokens=2)),
            Sequence("c", prompt(5, 600), SamplingParams(max_tokens=2))]
    sched.add(seqs[0])

    def on_step(step, batch):
        if step == 2:  # "a" decodes now: a long prompt arrives, then a short one
            sched.add(seqs[1])
            sched.add(seqs[2])

    counts = []
    batches = run(sched, model, on_step=on_step, counts=counts)
    assert counts[0] == (0, 40)  # nobody decodes: the whole prompt in one step
    assert all(p <= 6 for d, p in counts if d) and any(d and p == 6 for d, p in counts)
    chunks = [(i.seq.request_id, i.num_new) for b in batches[2:6] for i in b.items if i.seq.request_id != "a"]
    # b goes in chunks of the cap; c is admitted with what b leaves of it, behind b (FCFS)
    assert chunks == [("b", 6), ("b", 6), ("b", 6), ("b", 2), ("c", 4)]
    for seq in seqs:
        assert seq.output_ids == expected_output(seq.num_prompt_tokens, seq.params.max_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_with_aborts(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    num_blocks = rng.randint(40, 80) // block_size + 3
    capacity = num_blocks * block_size
    cap = (0, 1, 3, 8)[seed]  # prompt tokens beside decodes: uncapped, then tighter and looser caps
    sched, model = make(num_blocks=num_blocks, block_size=block_size, max_num_seqs=rng.randint(1, 6),
                        budget=rng.randint(1, 40), max_model_len=64, prefill_cap=cap)
    prefixes = [[rng.randrange(50, 60) for _ in range(rng.randint(0, 20))] for _ in range(3)]
    seqs, aborted, arrivals = [], set(), 0

    def on_step(step, batch):
        nonlocal arrivals
        if arrivals < 30 and rng.random() < 0.6:
            p = rng.choice(prefixes) + [rng.randrange(60, 70) for _ in range(rng.randint(1, 12))]
            max_tokens = rng.randint(1, min(20, capacity - len(p)))
            seqs.append(Sequence(f"q{arrivals}", p, SamplingParams(max_tokens=max_tokens)))
            sched.add(seqs[-1])
            arrivals += 1
        if rng.random() < 0.05 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            aborted.add(rid)
            sched.abort(rid)
            check_invariants(sched)

    sched.add(Sequence("first", prompt(3), SamplingParams(max_tokens=3)))
    while arrivals < 30:
        run(sched, model, on_step=on_step)
        on_step(0, None)
    run(sched, model, on_step=on_step)
    bm = sched.block_manager
    assert bm.num_free == num_blocks and not sched.requests
    for seq in seqs:
        assert seq.status is SeqStatus.FINISHED
        if seq.request_id in aborted:
            continue
        n = min(seq.params.max_tokens, 64 - seq.num_prompt_tokens)
        assert seq.output_ids == expected_output(seq.num_prompt_tokens, n)
    assert bm.prefix_hits <= bm.prefix_queries
