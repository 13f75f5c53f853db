"""The runner's CUDA graphs, mixed steps (prefill chunks beside decodes) and decode steps, give
the reference runner's logits step after step: the static buffers' bookkeeping (padding rows
and sequences, a smaller bucket after a larger one's stale values, block tables of several
widths) checked on the CPU. A stand-in for the graph replays the captured forward eagerly
(the same input buffers, written into the same output tensor, as a replay does); the cuda
backend's Triton kernels run in Triton's interpreter, so the run is a process of its own
(TRITON_INTERPRET=1 must be set before Triton is imported). The GPU runs the real graphs
against the plain forward in bench/serve_gpu_check.py."""

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

BLOCK = 16
# Each step: (sequence, first token, tokens, sample) per item; a sequence's prompt is long
# enough for all its steps (a decode reads its next token from the prompt: teacher forcing).
STEPS = [
    [(0, 0, 40, True), (1, 0, 17, True), (2, 0, 70, True)],  # 127 tokens: the 128 bucket
    [(0, 40, 1, True), (1, 17, 1, True), (2, 70, 60, True), (3, 0, 100, True)],  # 162 tokens: the 256 bucket
    [(0, 41, 1, True), (1, 18, 1, True), (2, 130, 1, True), (3, 100, 1, True)],  # the decode graph of 4
    [(0, 42, 1, True), (2, 131, 1, True), (3, 101, 1, True)],  # the graph of 4 with a padding row
    [(1, 19, 1, True), (4, 0, 9, True)],  # after the 256 bucket: stale rows and logits indices past 128
    [(4, 9, 30, False), (0, 43, 1, True)],  # a chunk inside its prompt (no logits row) beside a decode
]
PROMPT = 200


def _run() -> dict:
    from duoka.models.qwen2 import build_model, get_flavor
    from duoka.models.qwen2.model import materialize
    from duoka.serve import runner as runner_module
    from duoka.serve.params import SamplingParams
    from duoka.serve.runner import CacheShape, ModelRunner, decode_first, prepare_inputs
    from duoka.serve.scheduler import ScheduledItem, Sequence

    class EagerGraph:
        def __init__(self, forward, out):
            self.forward, self.out = forward, out

        def replay(self):
            self.out.copy_(self.forward())

    def capture(forward, pool):
        out = forward()
        return EagerGraph(forward, out), out, None

    runner_module.capture_graph = capture
    torch.manual_seed(0)
    # Two layers: the bookkeeping is every layer's, and each costs the interpreter's kernels.
    model = materialize(build_model(dataclasses.replace(get_flavor("debug"), n_layers=2)), "cpu", torch.float32)
    model.init_weights(seed=3)
    model.eval()
    args = model.args
    shape = CacheShape(args.n_layers, 80, BLOCK, args.n_kv_heads, args.resolved_head_dim, torch.float32)
    graphs = ModelRunner(model, shape, torch.device("cpu"), 512, max_num_seqs=4, cuda_graphs=True,
                         max_num_batched_tokens=256, backend="cuda")
    reference = ModelRunner(model, shape, torch.device("cpu"), 512, max_num_seqs=4, cuda_graphs=False)
    rng = random.Random(0)
    free = list(range(80))
    rng.shuffle(free)
    seqs = []
    for i in range(5):
        seq = Sequence(f"s{i}", [rng.randrange(1, args.vocab_size) for _ in range(PROMPT)],
                       SamplingParams(max_tokens=1))
        seq.block_table = [free.pop() for _ in range(-(-PROMPT // BLOCK) if i < 3 else 8)]
        seq.block_array = np.array(seq.block_table, dtype=np.int32)
        seqs.append(seq)
    result = {"graphs": {"decode": sorted(graphs.graphs), "mixed": sorted(graphs.mixed_graphs)}, "steps": []}
    for step in STEPS:
        items = decode_first([ScheduledItem(seqs[i], start, count, sample) for i, start, count, sample in step])
        inputs = prepare_inputs(items, BLOCK)
        got, want = graphs.execute(inputs), reference.execute(inputs)
        result["steps"].append({"rows": list(got.shape), "want_rows": list(want.shape),
                                "error": (got - want).abs().max().item(), "scale": want.abs().max().item()})
    return result


@pytest.fixture(scope="module")
def result(triton_interpreted):
    return triton_interpreted(__file__)


def test_the_runner_captured_both_kinds_of_graph(result):
    assert result["graphs"] == {"decode": [1, 2, 4], "mixed": [128, 256]}


@pytest.mark.parametrize("index", range(len(STEPS)))
def test_each_step_from_a_graph_gives_the_reference_logits(result, index):
    step = result["steps"][index]
    assert step["rows"] == step["want_rows"]
    assert step["error"] < 1e-4 * max(1.0, step["scale"]), step


if __name__ == "__main__":
    print(json.dumps(_run()))
