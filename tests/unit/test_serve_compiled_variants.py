"""A served model's compiled decoder blocks stay at two compiled variants a model (one-token
steps, which torch specialises, and every other size), whatever a step holds: decodes alone,
prefill chunks, a graph's mixed step, on the eager path or in a capture, on the worker's
profiling runner and on the serving one (caches of other sizes). Every block of every
served model (a speculative draft's too) shares one compiled code object, and torch's limit
of 8 compiled variants a code object is a hard error under fullgraph: a 7B target with a
0.5B draft once hit it mid-workload (bench/NOTES.md 38), when the attention's backend and a
None-or-tensor argument each doubled the variants.

The cuda backend's bookkeeping runs on the CPU (Triton's interpreter, a process of its own),
the blocks compiled by dynamo with the aot_eager backend: the guards, and so the variants,
are dynamo's whichever backend compiles the graphs."""

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

BLOCK = 16
PROMPT = 160
# The eager steps, each: (sequence, first token, tokens) per item, every one sampled. The
# captures before them run decodes of 1 and of 2-4 sequences and mixed steps of 128 tokens.
STEPS = [
    [(0, 0, 1)],  # one token (run for its hidden states, prompt logprobs' path: eager always)
    [(0, 1, 129), (1, 0, 20)],  # 149 tokens: past the mixed graph, prefill chunks
    [(0, 130, 1), (1, 20, 1), (2, 0, 1), (3, 0, 1), (4, 0, 1)],  # five decodes: past the graphs' 4
]


def _run() -> dict:
    import functools

    from duoka.models.qwen2 import build_model, get_flavor
    from duoka.models.qwen2 import paged as paged_module
    from duoka.models.qwen2.model import ModelOptions, materialize
    from duoka.serve import runner as runner_module
    from duoka.serve.params import SamplingParams
    from duoka.serve.runner import (CacheShape, ModelRunner, StepInputs, decode_first, prepare_inputs,
                                    profile_step)
    from duoka.serve.scheduler import ScheduledItem, Sequence

    torch.compile = functools.partial(torch.compile, backend="aot_eager")

    def capture(forward, pool):  # a graph stand-in: the capture runs the forward once, as torch's does
        out = forward()
        return None, out, None

    runner_module.capture_graph = capture
    # A step's inputs reach a GPU packed in one copy (StepInputs.to); on the CPU they stay as
    # made. Packed here too, so the arrays the blocks see are the GPU's.
    StepInputs.to = lambda self, device: StepInputs.unpack(self.packed().clone(), self.sizes(), self.scalars())
    # Flash attention, which the CPU lacks, for the eager prefill chunks: their values are not
    # what this counts (test_paged_attention checks them).
    paged_module.causal_varlen = lambda q, *rest: torch.zeros_like(q)
    options = ModelOptions(compile="block", compile_dynamic=True, packed_projections=True)  # as the worker serves
    debug = dataclasses.replace(get_flavor("debug"), n_layers=2)  # the blocks share one compiled code
    result = {}
    for name, args in (("target", debug), ("draft", dataclasses.replace(debug, dim=64, n_heads=2, n_kv_heads=1))):
        model = materialize(build_model(args, options), "cpu", torch.float32)
        model.init_weights(seed=3)
        model.eval()
        # First the worker's profiled step (Worker._profile): one sequence of a whole budget, on
        # a runner of its own whose cache is just large enough. The budget equals the target's
        # hidden size: duck sizing would tie the two, and every other length compile anew.
        profile_step(model, 128, 4, BLOCK, torch.float32, torch.device("cpu"), 512, backend="cuda")
        shape = CacheShape(args.n_layers, 200, BLOCK, args.n_kv_heads, args.resolved_head_dim, torch.float32)
        runner = ModelRunner(model, shape, torch.device("cpu"), 512, max_num_seqs=4, cuda_graphs=True,
                             max_num_batched_tokens=128, backend="cuda")
        rng = random.Random(0)
        seqs = []
        for i in range(5):
            seq = Sequence(f"s{i}", [rng.randrange(1, args.vocab_size) for _ in range(PROMPT)],
                           SamplingParams(max_tokens=1))
            seq.block_table = list(range(i * 10, i * 10 + 10))
            seq.block_array = np.array(seq.block_table, dtype=np.int32)
            seqs.append(seq)
        for step in STEPS:
            inputs = prepare_inputs(decode_first([ScheduledItem(seqs[i], *item, True) for i, *item in step]), BLOCK)
            with torch.inference_mode():  # inference tensors, as StepInputs.to's copy to a GPU makes them
                inputs = StepInputs.unpack(inputs.packed().clone(), inputs.sizes(), inputs.scalars())
            if len(inputs.token_ids) == 1:
                runner.execute_with_hidden(inputs, torch.zeros(1, dtype=torch.long))
            else:
                runner.execute(inputs)
        result[name] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result["limit"] = torch._dynamo.config.recompile_limit
    return result


@pytest.fixture(scope="module")
def result(triton_interpreted):
    return triton_interpreted(__file__)


def test_two_compiled_variants_a_served_model(result):
    assert result["target"] == 2, result
    assert result["draft"] - result["target"] == 2, result
    assert result["draft"] <= result["limit"] - 4, result  # room for a third model's blocks


if __name__ == "__main__":
    print(json.dumps(_run()))
