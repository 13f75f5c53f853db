"""paged_mixed's Triton kernel (a mixed serving step's attention for CUDA graphs) equals the
reference paged attention: decodes and prefill chunks after cached context side by side,
blocks scattered, GQA groups of 1 to 7 heads, tiles crossing sequence boundaries, and a
graph's padding rows (zero) and padding sequences (no rows). Run by Triton's interpreter on
the CPU (TRITON_INTERPRET=1 must be set before Triton is imported: a process of its own);
the GPU runs the same comparison in bf16 (bench/serve_gpu_check.py)."""

import json
import random

import pytest
import torch

pytest.importorskip("triton")

# (heads, kv heads, head_dim, decode contexts, prefill chunks (cached, new), padding rows,
# padding sequences, dtype)
CASES = [
    (4, 1, 16, [5, 70], [(0, 20), (33, 9)], 0, 0, "float32"),
    (7, 1, 32, [], [(0, 40)], 0, 0, "float32"),
    (6, 2, 16, [1, 17, 130], [(100, 3), (0, 1)], 5, 3, "float32"),
    (2, 2, 16, [3] * 9, [(64, 35), (0, 17), (15, 16)], 7, 2, "float32"),
    (4, 2, 32, [40, 2], [(70, 66)], 0, 0, "float16"),
]
TOLERANCE = {"float32": 1e-5, "float16": 3e-3}


def _case(heads, kv, dim, decodes, prefills, pad_rows, pad_seqs, dtype, seed, page=16):
    from duoka.models import paged_mixed
    from duoka.models.qwen2.paged import PagedBatch, reference_attention

    dtype = getattr(torch, dtype)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    contexts = decodes + [cached + new for cached, new in prefills]
    q_lens = [1] * len(decodes) + [new for _, new in prefills]
    num_blocks = sum(-(-c // page) for c in contexts) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // page))] for c in contexts]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad_seqs,
                                dtype=torch.int32)
    k_cache = torch.randn(num_blocks, page, kv, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, page, kv, dim, generator=g).to(dtype)
    rows = sum(q_lens)
    q = torch.randn(rows + pad_rows, heads, dim, generator=g).to(dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    got = paged_mixed.mixed_attention(q, k_cache, v_cache, block_tables,
                                      torch.tensor(contexts + [0] * pad_seqs, dtype=torch.int32),
                                      torch.tensor(starts + [rows] * pad_seqs, dtype=torch.int32))
    batch = PagedBatch([k_cache.float()], [v_cache.float()], torch.zeros(rows, dtype=torch.long),
                       block_tables[:len(contexts)], torch.tensor(contexts, dtype=torch.int32),
                       torch.tensor(starts, dtype=torch.int32), max(q_lens), torch.zeros(0, dtype=torch.long))
    want = reference_attention(q[:rows].float(), k_cache.float(), v_cache.float(), batch)
    return {"error": (got[:rows].float() - want).abs().max().item(),
            "padding": got[rows:].abs().max().item() if pad_rows else 0.0}


@pytest.fixture(scope="module")
def results(triton_interpreted):
    return triton_interpreted(__file__)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_the_mixed_kernel_equals_the_reference(results, index):
    got = results[index]
    assert got["error"] < TOLERANCE[CASES[index][-1]], (CASES[index], got)
    assert got["padding"] == 0.0, "a padding row is written"


if __name__ == "__main__":
    print(json.dumps([_case(*case, seed=i) for i, case in enumerate(CASES)]))
