"""Serving tensor parallelism on CPU over gloo, fp32: two processes each load only their
shard of a Hugging Face folder and compute what one process computes on the whole model
(a plain forward, and prefill + decode steps over the paged KV cache whose inputs rank 0
broadcasts), with the KV heads split and with them replicated, and a Qwen2-MoE model with
its experts split by width; the engine at tp 2 gives one process's greedy tokens (and, on
the MoE model, its logprobs). One group of processes runs every case once for the module
(a Python start costs seconds); the tests then read what each rank wrote."""

from __future__ import annotations

import datetime
from dataclasses import fields

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from duoka.hub import bundled_model_dir
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.hf_adapter import load_hf_model, read_config, save_hf_checkpoint
from duoka.models.qwen2.model import build_model, materialize
from duoka.serve.config import EngineConfig
from duoka.serve.engine import LLM
from duoka.serve.params import SamplingParams, TokenLogprob
from duoka.serve.runner import CacheShape, ModelRunner, StepInputs
from duoka.serve.step_channel import broadcast_step, worker_loop
from duoka.serve.tp_shard import load_tp_model, local_kv_heads
from duoka.serve.worker import run_worker

BLOCK = 4
PROMPT = 10  # prefill tokens; one decode step follows
# case -> (tp, model shape, file size limit). KV heads split (one per rank); one KV head
# replicated on both ranks, with an untied head in several files (an index), as 7B and up;
# 2 KV heads replicated over 4 ranks, each pair of ranks on its own (Qwen2-1.5B at tp 4);
# Qwen2-MoE (layer 0 dense, layer 1 sparse: 4 routed experts, top-2, a shared expert), its
# experts' tensors spread over several files.
MOE = dict(n_heads=4, n_kv_heads=2, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=(0,), norm_topk_prob=True)
CASES = {
    "kv-split": (2, dict(n_heads=4, n_kv_heads=2, tie_word_embeddings=True), "5GB"),
    "kv-replicated": (2, dict(n_heads=4, n_kv_heads=1, tie_word_embeddings=False), "40KB"),
    "kv-replicated-tp4": (4, dict(n_heads=4, n_kv_heads=2, tie_word_embeddings=True), "5GB"),
    "moe": (2, MOE, "40KB"),
}
# The engine on the bundled tiny model (6 heads, 2 KV heads): prompts of different lengths,
# prefills cut into chunks by a small token budget and run beside the other decodes.
PROMPTS = ["The quick brown fox", "def f(x):\n    return", "多卡训练", "Hello, world. " * 6]
ENGINE = dict(device="cpu", max_num_batched_tokens=16, num_kv_blocks=48, block_size=4, max_model_len=128,
              log=lambda message: None)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# The engine on the MoE case's folder: prompts as token ids (its vocabulary is a part of the
# bundled tokenizer's), greedy, with each token's logprob and the top 2, and each prompt
# token's (rank 0 scores the prompt rows' hidden states while the others run the plain step).
MOE_PROMPTS = [[5, 17, 200, 3, 99, 41], [250, 7, 7, 130, 62, 18, 90, 11, 2, 33, 8], [64, 1]]
WITH_LOGPROBS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)


def _args(**shape) -> ModelArgs:
    return ModelArgs(vocab_size=256, dim=64, n_layers=2, intermediate_size=96, max_seq_len=128, **shape)


def _write_folder(folder, seed: int, shape: dict, shard_size: str):
    """A random model with every parameter (biases and norms too) away from its init."""
    model = materialize(build_model(_args(**shape)), "cpu", torch.float32)
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    save_hf_checkpoint(model, folder, max_shard_size=shard_size)
    return folder


def _with_tokenizer(folder):
    """The folder servable by the engine: the bundled tokenizer beside the weights."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((bundled_model_dir() / name).read_bytes())
    return folder


def _greedy_logprobs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[TokenLogprob]]]:
    """Each prompt's tokens, and its prompt's logprobs (after the first, None) followed by its
    tokens' under WITH_LOGPROBS, all requests batched together."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, WITH_LOGPROBS)
    outs = {f"r{i}": ([], []) for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id][0].extend(out.new_token_ids)
            outs[out.request_id][1].extend((out.prompt_logprobs or [None])[1:])
            outs[out.request_id][1].extend(out.new_logprobs or [])
    return list(outs.values())


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (PROMPT + 1,), generator=torch.Generator().manual_seed(7))


def _steps(tokens: torch.Tensor) -> list[StepInputs]:
    """A prefill of PROMPT tokens (blocks 2, 0, 1: not in order) and one decode step."""
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    slots = [int(table[0, p // BLOCK]) * BLOCK + p % BLOCK for p in range(PROMPT + 1)]
    prefill = StepInputs(
        token_ids=tokens[:PROMPT], positions=torch.arange(PROMPT), slot_mapping=torch.tensor(slots[:PROMPT]),
        block_tables=table, context_lens=torch.tensor([PROMPT], dtype=torch.int32),
        query_start=torch.tensor([0, PROMPT], dtype=torch.int32), logits_indices=torch.tensor([PROMPT - 1]),
        max_query_len=PROMPT, num_decodes=0, max_context_len=PROMPT, prefill_context=PROMPT)
    decode = StepInputs(
        token_ids=tokens[PROMPT:], positions=torch.tensor([PROMPT]), slot_mapping=torch.tensor(slots[PROMPT:]),
        block_tables=table, context_lens=torch.tensor([PROMPT + 1], dtype=torch.int32),
        query_start=torch.tensor([0, 1], dtype=torch.int32), logits_indices=torch.tensor([0]),
        max_query_len=1, num_decodes=1, max_context_len=PROMPT + 1, prefill_context=0)
    return [prefill, decode]


class _Recorder:
    """A runner that keeps what it is given, and what the wrapped runner returns."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.received, self.logits = [], []

    def execute(self, inputs: StepInputs):
        self.received.append(inputs)
        self.logits.append(self.runner.execute(inputs))


@torch.no_grad()
def _worker(rank: int, tp: int, init_file: str, folders: dict, out_dir: str, engine: bool) -> None:
    """Every case of `folders` at this tp; engine: the engine's runs too (the bundled model,
    then the MoE case's folder)."""
    torch.set_num_threads(1)  # the processes share the test machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp,
                            timeout=datetime.timedelta(seconds=60))  # a mismatched collective fails, not hangs
    results = {}
    for case, folder in folders.items():
        args = read_config(folder)
        model = load_tp_model(folder, args, None, "cpu", torch.float32)
        tokens = _tokens(args.vocab_size)
        result = {"state": model.state_dict(), "plain": model(tokens[:PROMPT][None])[0]}
        # Serving steps over the paged cache, as the engine runs them: rank 0 sends each
        # step's inputs and runs it; the others run what arrives until rank 0 says stop.
        shape = CacheShape(args.n_layers, 8, BLOCK, local_kv_heads(args, tp), args.resolved_head_dim, torch.float32)
        recorder = _Recorder(ModelRunner(model, shape, torch.device("cpu"), max_model_len=64, cuda_graphs=False))
        if rank == 0:
            for step in _steps(tokens):
                broadcast_step(step, None)
                recorder.execute(step)
            broadcast_step(None, None)
        else:
            worker_loop(recorder, None)
        result["inputs"], result["paged"] = recorder.received, recorder.logits
        results[case] = result
    if engine:  # rank 0 builds the engine and serves; the others build only a worker and run its steps
        options = {k: v for k, v in ENGINE.items() if k != "log"}
        for key, model in (("engine", None), ("moe-engine", str(folders["moe"]))):
            if rank == 0:
                llm = LLM(model, tp=tp, tp_group=dist.group.WORLD, **ENGINE)
                results[key] = ([c.token_ids for c in llm.generate(PROMPTS, GREEDY)] if model is None
                                else _greedy_logprobs(llm, MOE_PROMPTS))
                llm.engine.shutdown()
            else:
                run_worker(EngineConfig(model=model, tp=tp, **options), dist.group.WORLD)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """(folders, tp -> [each rank's results]): one group of processes per tp, every case of that tp."""
    root = tmp_path_factory.mktemp("serve_tp")
    folders = {case: _write_folder(root / case, seed, shape, size)
               for seed, (case, (_, shape, size)) in enumerate(CASES.items())}
    _with_tokenizer(folders["moe"])
    ranks = {}
    for tp in sorted({tp for tp, _, _ in CASES.values()}):
        mine = {case: folders[case] for case, (t, _, _) in CASES.items() if t == tp}
        out = root / f"tp{tp}"
        out.mkdir()
        engine = tp == 2
        mp.start_processes(_worker, args=(tp, str(out / "init"), mine, str(out), engine), nprocs=tp,
                           start_method="spawn")
        ranks[tp] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(tp)]
    return folders, ranks


@pytest.fixture(scope="module")
def references(tp_run):
    """case -> the unsharded model (the ordinary loader), in one process."""
    folders, _ = tp_run
    return {case: load_hf_model(folder, "cpu", torch.float32)[0] for case, folder in folders.items()}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_sharded_forward_equals_one_process(tp_run, references, case):
    ranks = tp_run[1][CASES[case][0]]
    model = references[case]
    tokens = _tokens(model.args.vocab_size)
    full = model(tokens[None])[0]
    for rank in ranks:  # every rank computes the whole logits
        _close(rank[case]["plain"], full[:PROMPT])
        prefill, decode = rank[case]["paged"]
        _close(prefill, full[PROMPT - 1:PROMPT])
        _close(decode, full[PROMPT:])


# The dimension each split tensor is split along (the shared expert's w1/w2/w3 are among the
# MLP's); every other tensor is whole on every rank (the router and the shared expert's gate too).
ROWS = ("wq.weight", "wq.bias", "wk.weight", "wk.bias", "wv.weight", "wv.bias", "w1.weight", "w3.weight")
COLUMNS = ("wo.weight", "w2.weight")
EXPERTS = {"experts.w1": 1, "experts.w3": 1, "experts.w2": 2}  # stacked [E, out, in]: each expert's rows or columns


def _split_dim(name: str) -> int | None:
    if name.endswith(ROWS + COLUMNS):
        return 0 if name.endswith(ROWS) else 1
    return next((dim for suffix, dim in EXPERTS.items() if name.endswith(suffix)), None)


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_only_its_slices(tp_run, references, case):
    """The ranks' pieces put back together are the checkpoint's tensors: the split ones
    concatenated in rank order (each rank 1/tp of it), the rest whole on every rank."""
    tp = CASES[case][0]
    ranks = tp_run[1][tp]
    args = references[case].args
    # Ranks holding the same replicated KV head: consecutive runs of this many.
    sharing = max(1, tp // args.n_kv_heads)
    for name, full in references[case].state_dict().items():
        parts = [rank[case]["state"][name] for rank in ranks]
        dim = _split_dim(name)
        if dim is not None:
            if ".wk." in name or ".wv." in name:
                for first in range(0, tp, sharing):
                    assert all(torch.equal(p, parts[first]) for p in parts[first:first + sharing]), name
                parts = parts[::sharing]
            assert all(p.shape[dim] * len(parts) == full.shape[dim] for p in parts), name
            assert torch.equal(torch.cat(parts, dim), full), name
        else:
            assert all(torch.equal(p, full) for p in parts), name


def _same_inputs(got: StepInputs, sent: StepInputs) -> None:
    for f in fields(StepInputs):
        a, b = getattr(got, f.name), getattr(sent, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


def test_step_inputs_arrive_whole(tp_run):
    for case, (tp, _, _) in CASES.items():
        ranks = tp_run[1][tp]
        for rank in ranks[1:]:
            assert len(rank[case]["inputs"]) == 2  # both steps ran, then SHUTDOWN ended the loop
            for got, sent in zip(rank[case]["inputs"], ranks[0][case]["inputs"]):
                _same_inputs(got, sent)


def test_engine_at_tp2_gives_the_greedy_tokens_of_one_process(tp_run):
    want = [c.token_ids for c in LLM(None, **ENGINE).generate(PROMPTS, GREEDY)]
    assert tp_run[1][2][0]["engine"] == want


def test_a_moe_model_served_at_tp2_gives_the_tokens_and_logprobs_of_one_process(tp_run):
    folders, ranks = tp_run
    want = _greedy_logprobs(LLM(str(folders["moe"]), **ENGINE), MOE_PROMPTS)
    got = ranks[2][0]["moe-engine"]
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for prompt, (tokens, mine), (_, theirs) in zip(MOE_PROMPTS, got, want):
        assert len(mine) == len(theirs) == len(tokens) + len(prompt) - 1
        for a, b in zip(mine, theirs):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            torch.testing.assert_close(torch.tensor([a.logprob, *(v for _, v in a.top)]),
                                       torch.tensor([b.logprob, *(v for _, v in b.top)]), rtol=0, atol=1e-4)
    assert len({t for tokens, _ in got for t in tokens}) > 3  # a real continuation, not one token repeated


def test_a_moe_width_the_tp_cannot_split_is_refused_before_starting(tmp_path, in_process):
    folder = _write_folder(tmp_path / "odd", 0, {**MOE, "moe_intermediate_size": 25}, "5GB")
    proc = in_process("serve", str(folder), "--tp", "2", "--device", "cpu")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "routed experts' width (moe_intermediate_size) 25 is not divisible by 2" in proc.stderr
    assert "fix: use a tp that divides it: 1" in proc.stderr
