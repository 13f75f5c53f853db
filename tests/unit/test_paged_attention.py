"""Attention over the paged KV cache equals the plain causal forward: sequences cut into
chunks of any size, blocks scattered anywhere in the cache, several sequences per step."""

import random

import torch

from duoka.models.qwen2 import build_model, get_flavor
from duoka.models.qwen2.model import materialize
from duoka.models.qwen2.paged import PagedBatch

BLOCK = 4


def _model():
    torch.manual_seed(0)
    model = materialize(build_model(get_flavor("debug")), "cpu", torch.float32)
    model.init_weights(seed=3)
    return model.eval()


def _caches(model, num_blocks):
    args = model.args
    shape = (num_blocks, BLOCK, args.n_kv_heads, args.resolved_head_dim)
    return [torch.zeros(shape) for _ in range(args.n_layers)], [torch.zeros(shape) for _ in range(args.n_layers)]


@torch.no_grad()
def test_chunked_steps_over_scattered_blocks_equal_the_plain_forward():
    model = _model()
    rng = random.Random(0)
    lengths = [13, 7, 21]
    seqs = [torch.randint(0, model.args.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    expected = [model(s[None])[0] for s in seqs]  # [n, vocab] each

    num_blocks = 32
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n in lengths]
    k_caches, v_caches = _caches(model, num_blocks)
    done = [0, 0, 0]
    got = [[] for _ in seqs]
    while any(d < n for d, n in zip(done, lengths)):
        chunks = []
        for i, n in enumerate(lengths):
            if done[i] < n:
                chunks.append((i, done[i], min(n - done[i], rng.randint(1, 6))))
        tokens, positions, slots, starts, ctx = [], [], [], [0], []
        for i, start, count in chunks:
            for p in range(start, start + count):
                tokens.append(int(seqs[i][p]))
                positions.append(p)
                slots.append(tables[i][p // BLOCK] * BLOCK + p % BLOCK)
            starts.append(starts[-1] + count)
            ctx.append(start + count)
        width = max(len(tables[i]) for i, _, _ in chunks)
        block_tables = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i, _, _ in chunks], dtype=torch.int32)
        batch = PagedBatch(k_caches, v_caches, torch.tensor(slots), block_tables, torch.tensor(ctx, dtype=torch.int32),
                           torch.tensor(starts, dtype=torch.int32), max(c for _, _, c in chunks),
                           logits_indices=torch.arange(len(tokens)))
        logits = model(torch.tensor([tokens]), positions=torch.tensor(positions), paged=batch)
        for j, (i, start, count) in enumerate(chunks):
            got[i].append(logits[starts[j]:starts[j + 1]])
            done[i] += count
    for want, parts in zip(expected, got):
        torch.testing.assert_close(torch.cat(parts), want, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_logits_only_at_the_asked_rows():
    model = _model()
    k_caches, v_caches = _caches(model, 4)
    tokens = torch.arange(1, 9)
    batch = PagedBatch(k_caches, v_caches, torch.arange(8), torch.tensor([[0, 1]], dtype=torch.int32),
                       torch.tensor([8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), 8,
                       logits_indices=torch.tensor([7]))
    logits = model(tokens[None], positions=torch.arange(8), paged=batch)
    assert logits.shape == (1, model.args.vocab_size)
    torch.testing.assert_close(logits[0], model(tokens[None])[0, -1], atol=2e-5, rtol=1e-4)


def test_the_prefill_gather_index_reads_each_chunks_context_in_order():
    """The cuda backend's per-step index (made once, read by every layer): the chunks' query and
    context offsets, then each context token's slot through its table, position by position."""
    from duoka.models.qwen2.paged import prefill_gather_index

    rng = random.Random(1)
    free = list(range(64))
    rng.shuffle(free)
    # Two decodes, then three prefill chunks of (context, new tokens).
    contexts, news = [9, 30, 17, 5, 40], [1, 1, 6, 5, 12]
    tables = [[free.pop() for _ in range(-(-c // BLOCK))] for c in contexts]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query_start = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32)
    index = prefill_gather_index(block_tables, torch.tensor(contexts, dtype=torch.int32), query_start, 2,
                                 sum(contexts[2:]), BLOCK)
    assert index.dtype == torch.int32
    want_q = [0, 6, 11, 23]
    want_k = [0, 17, 22, 62]
    want_slots = [tables[i][p // BLOCK] * BLOCK + p % BLOCK for i in (2, 3, 4) for p in range(contexts[i])]
    assert index.tolist() == want_q + want_k + want_slots
