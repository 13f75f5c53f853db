"""Several LoRA adapters in one engine (--lora NAME=DIR; duoka.models.qwen2.multi_lora): each
request's tokens and logprobs equal those of an engine serving its adapter merged into the
base (--adapter), with base and adapter requests, prefills and decodes, in the same steps;
the prefix cache never hands one adapter's blocks to another; the stacked projection equals
its dense definition, whole and as tensor-parallel shards; bad configs are clear errors.
fp32 on CPU, a tiny random Qwen2."""

from __future__ import annotations

import shutil
from functools import partial
from typing import ClassVar

import pytest
import torch

from duoka.cli import build_parser
from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelOptions
from duoka.models.qwen2.hf_adapter import load_hf_model, read_config
from duoka.models.qwen2.multi_lora import MODULES, MultiLoRALinear, add_loras, read_lora
from duoka.serve.config import SERVE, EngineConfig, engine_config_from_args
from duoka.serve.engine import LLMEngine
from duoka.serve.params import SamplingParams
from duoka.serve.runner import ModelRunner
from duoka.serve.tp_shard import build_shard, load_shard, shard_range

VOCAB = 600  # the tokenizer_dir fixture's vocabulary
# name -> (rank, alpha, targets, rslora): different ranks, scales and targets, one attention-only.
ADAPTERS = {
    "sql": (4, 8.0, ("q_proj", "v_proj", "o_proj"), False),
    "chat": (8, 4.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "mlp": (2, 6.0, ("k_proj", "gate_proj", "up_proj", "down_proj"), True),
}
OPTIONS = {"device": "cpu", "max_model_len": 96, "block_size": 4}


def quiet(message: str) -> None:
    pass


@pytest.fixture(scope="module")
def served(saved_hf_model, tokenizer_dir, tmp_path_factory, write_adapter):
    """(model folder, {name: adapter folder}) of a tiny random Qwen2 and three adapters."""
    root = tmp_path_factory.mktemp("multi-lora")
    folder = root / "model"
    shutil.copytree(saved_hf_model(seed=12, vocab_size=VOCAB), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    args = read_config(folder)
    adapters = {name: write_adapter(root / name, args, *spec, seed=i + 1)
                for i, (name, spec) in enumerate(ADAPTERS.items())}
    return folder, adapters


class RecordingRunner(ModelRunner):
    """ModelRunner that keeps, per step, (adapter slots in it, decodes, prefill tokens)."""
    steps: ClassVar[list[tuple[set[int], int, int]]] = []

    def execute(self, inputs):
        slots = set() if inputs.adapter_ids is None else set(inputs.adapter_ids.tolist())
        RecordingRunner.steps.append((slots, inputs.num_decodes, len(inputs.token_ids) - inputs.num_decodes))
        return super().execute(inputs)


@pytest.fixture(scope="module")
def engine(served):
    folder, adapters = served
    config = EngineConfig(model=str(folder), loras=tuple((n, str(d)) for n, d in adapters.items()),
                          max_num_batched_tokens=13, **OPTIONS)
    return LLMEngine(config, log=quiet, runner_factory=RecordingRunner)


def prompts(n: int, seed: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)


def run(engine, requests, stagger: int = 0) -> dict[str, tuple[list[int], list]]:
    """requests: (id, prompt, lora); one joins every `stagger` steps (0: all at once).
    -> {id: (tokens, logprobs)}."""
    got, pending = {}, list(requests)
    while pending or engine.has_unfinished():
        for _ in range(min(len(pending), 1 if stagger else len(pending))):
            rid, prompt, lora = pending.pop(0)
            engine.add_request(rid, prompt, GREEDY, lora=lora)
        for _ in range(max(stagger, 1)):
            for out in engine.step():
                tokens, logprobs = got.setdefault(out.request_id, ([], []))
                tokens += out.new_token_ids
                logprobs += out.new_logprobs or []
    return got


def merged_results(served, lora: str | None, requests) -> dict[str, tuple[list[int], list]]:
    folder, adapters = served
    config = EngineConfig(model=str(folder), adapter=None if lora is None else str(adapters[lora]), **OPTIONS)
    return run(LLMEngine(config, log=quiet), [(rid, prompt, None) for rid, prompt, _ in requests])


def test_mixed_batches_give_each_request_its_merged_adapter_s_output(engine, served):
    names = [None, *ADAPTERS]
    requests = [(f"{name}-{i}", prompt, name) for i, prompt in enumerate(prompts(3, seed=1))
                for name in names] + [(f"{name}-late", prompts(1, seed=2)[0], name) for name in names]
    RecordingRunner.steps.clear()
    got = run(engine, requests, stagger=1)
    mixed = [step for step in RecordingRunner.steps if len(step[0] | {0}) > 2 and step[1] and step[2]]
    assert mixed, "no step ran several adapters' decodes beside prefill chunks"
    for name in names:
        mine = [r for r in requests if r[2] == name]
        want = merged_results(served, name, mine)
        for rid, *_ in mine:
            tokens, logprobs = got[rid]
            assert tokens == want[rid][0], rid
            for lp, ref in zip(logprobs, want[rid][1]):
                assert lp.token_id == ref.token_id
                assert abs(lp.logprob - ref.logprob) < 1e-4
                assert [t for t, _ in lp.top] == [t for t, _ in ref.top]
                torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), torch.tensor([v for _, v in ref.top]),
                                           atol=1e-4, rtol=0)
    # the adapters change the model: each one's tokens differ from the base's somewhere
    for name in ADAPTERS:
        assert any(got[f"{name}-{i}"][0] != got[f"None-{i}"][0] for i in range(3)), name
    assert engine.stats().kv_usage == 0


def test_the_prefix_cache_keeps_each_adapter_s_blocks_apart(engine, served):
    prompt = prompts(1, seed=5, lo=21, hi=22)[0]  # five full blocks of 4
    outs = {}
    for rid, lora in (("p-sql", "sql"), ("p-chat", "chat"), ("p-base", None), ("p-sql-again", "sql")):
        engine.add_request(rid, prompt, GREEDY, lora=lora)
        while engine.has_unfinished():
            for out in engine.step():
                outs[rid] = (outs.get(rid, ([], 0))[0] + out.new_token_ids, out.num_cached_tokens)
    assert outs["p-sql"][1] == outs["p-chat"][1] == outs["p-base"][1] == 0  # nothing of another adapter's
    assert outs["p-sql-again"][1] == 20  # its own adapter's blocks are found
    assert outs["p-sql-again"][0] == outs["p-sql"][0]
    for rid, lora in (("p-sql", "sql"), ("p-chat", "chat"), ("p-base", None)):
        assert outs[rid][0] == merged_results(served, lora, [(rid, prompt, lora)])[rid][0], rid


def test_an_unknown_adapter_is_refused_naming_the_served_ones(engine):
    assert engine.lora_names == tuple(ADAPTERS)
    assert [engine.adapter_index(n) for n in (None, "sql", "chat", "mlp")] == [0, 1, 2, 3]
    with pytest.raises(DuokaError) as e:
        engine.add_request("x", [1, 2, 3], GREEDY, lora="nope")
    assert "'nope' is not served here (served: sql, chat, mlp)" in e.value.cause and "--lora" in e.value.fix
    assert not engine.has_unfinished()


def test_the_stacked_projection_equals_the_dense_sum_whole_and_sharded(served):
    """y = base(x) + scale * B(A(x)) for each token's adapter and each target in the
    projection; a tensor-parallel rank's share: its rows (q/k/v, gate/up) or its partial sum
    (o, down), which the ranks' sum completes."""
    folder, adapters = served
    args = read_config(folder)
    loras = [read_lora(name, adapters[name], args) for name in ADAPTERS]
    packed = ModelOptions(packed_projections=True)
    model, _ = load_hf_model(folder, options=packed)
    dense = {n: p.clone() for n, p in model.state_dict().items()}
    ids = add_loras(model, loras)
    block = model.layers["1"]
    assert isinstance(block.attention.wqkv, MultiLoRALinear) and isinstance(block.feed_forward.w2, MultiLoRALinear)
    assert model.state_dict().keys() == {n.replace("wqkv.", "wqkv.base.").replace("wo.", "wo.base.").replace(
        "w13.", "w13.base.").replace("w2.", "w2.base.") for n in dense}
    slots = torch.tensor([0, 1, 2, 3, 3, 1, 0, 2], dtype=torch.int32)
    ids.use(slots)
    hd = args.resolved_head_dim
    q, kv, mlp = args.n_heads * hd, args.n_kv_heads * hd, args.intermediate_size
    rows = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv), "o_proj": (0, args.dim),
            "gate_proj": (0, mlp), "up_proj": (mlp, mlp), "down_proj": (0, args.dim)}
    for path, parts, width in (("attention.wqkv", ("q_proj", "k_proj", "v_proj"), args.dim),
                               ("attention.wo", ("o_proj",), q),
                               ("feed_forward.w13", ("gate_proj", "up_proj"), args.dim),
                               ("feed_forward.w2", ("down_proj",), mlp)):
        module = block.get_submodule(path)
        x = torch.randn(len(slots), width)
        want = module.base(x).clone()
        for t, slot in enumerate(slots.tolist()):
            if slot:
                lora = loras[slot - 1]
                for part in parts:
                    if part in lora.targets:
                        a, b = lora.pair("1", part)
                        first, n = rows[part]
                        want[t, first:first + n] += lora.scaling * (b @ (a @ x[t]))
        torch.testing.assert_close(module(x), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(module(x)[slots == 0], module.base(x)[slots == 0], atol=0, rtol=0)

        # Two tensor-parallel ranks: q/k/v and gate/up by rows, o and down by input columns.
        outs = []
        for rank in range(2):
            shard_model = build_shard(args, 2, "cpu", torch.float32, packed)
            load_shard(shard_model, folder, args, 2, rank)
            shard_ids = add_loras(shard_model, loras, partial(shard_range, args=args, tp=2, rank=rank))
            shard_ids.use(slots)
            local = shard_model.layers["1"].get_submodule(path)
            if path in ("attention.wo", "feed_forward.w2"):
                _, start, stop = shard_range(f"layers.1.{MODULES[parts[0]]}.weight", args, 2, rank)
                outs.append(local(x[:, start:stop]))
            else:
                outs.append(local(x))
        if path in ("attention.wo", "feed_forward.w2"):
            torch.testing.assert_close(outs[0] + outs[1], want, atol=1e-5, rtol=1e-5)
        else:
            for rank, out in enumerate(outs):
                first = 0
                for part in parts:
                    _, start, stop = shard_range(f"layers.1.{MODULES[part]}.weight", args, 2, rank)
                    base_first = rows[part][0]
                    torch.testing.assert_close(out[:, first:first + stop - start],
                                               want[:, base_first + start:base_first + stop], atol=1e-5, rtol=1e-5)
                    first += stop - start


def test_projections_no_adapter_targets_stay_plain(served):
    folder, adapters = served
    args = read_config(folder)
    model, _ = load_hf_model(folder, options=ModelOptions(packed_projections=True))
    add_loras(model, [read_lora("sql", adapters["sql"], args)])  # q, v, o only
    assert isinstance(model.layers["0"].attention.wqkv, MultiLoRALinear)
    assert type(model.layers["0"].feed_forward.w13) is torch.nn.Linear


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_the_lora_flag_repeats_and_its_errors_name_the_fix(served, tmp_path):
    a = _parse("serve", "/m", "--lora", "sql=/a/sql", "--lora", " chat = /a/chat")
    assert engine_config_from_args(a, SERVE).loras == (("sql", "/a/sql"), ("chat", "/a/chat"))
    assert EngineConfig(loras={"sql": tmp_path}).loras == (("sql", str(tmp_path)),)
    with pytest.raises(DuokaError, match="'sql' is not of the form NAME=DIR"):
        engine_config_from_args(_parse("serve", "--lora", "sql"), SERVE)
    with pytest.raises(DuokaError, match="--lora sql is given more than once"):
        EngineConfig(loras=[("sql", "/a"), ("sql", "/b")])
    with pytest.raises(DuokaError, match="not a list of"):
        EngineConfig(loras=["sql"])


def _refusal(folder, loras, **options) -> DuokaError:
    with pytest.raises(DuokaError) as e:
        LLMEngine(EngineConfig(model=str(folder), loras=loras, **{**OPTIONS, **options}), log=quiet)
    return e.value


def test_adapters_that_do_not_fit_are_refused_before_loading(served, tmp_path, write_adapter):
    folder, adapters = served
    args = read_config(folder)
    e = _refusal(folder, {"x": tmp_path / "nope"})
    assert "--lora x=" in e.cause and "there is no folder" in e.cause
    (tmp_path / "empty").mkdir()
    assert "has no adapter_config.json" in _refusal(folder, {"x": tmp_path / "empty"}).cause
    wider = write_adapter(tmp_path / "wider", args.replace(dim=32, head_dim=16), 4, 8.0, ("q_proj",))
    e = _refusal(folder, {"x": wider})
    assert "layer 0 q_proj adapter maps 32 inputs to 64 outputs; this model's q_proj maps 64 to 64" in e.cause
    assert "base it was trained on (tiny)" in e.fix
    deeper = write_adapter(tmp_path / "deeper", args.replace(n_layers=3), 4, 8.0, ("q_proj",))
    assert "cover layers 0-2, and this model has layers 0-1" in _refusal(folder, {"x": deeper}).cause
    huge = write_adapter(tmp_path / "huge", args, 257, 8.0, ("o_proj",))
    e = _refusal(folder, {"x": huge})
    assert "rank 257 is above 256" in e.cause and "--adapter" in e.fix
    whole = write_adapter(tmp_path / "whole", args, 4, 8.0, ("q_proj",),
                          extra={"base_model.model.lm_head.weight": torch.zeros(args.vocab_size, args.dim)})
    e = _refusal(folder, {"x": whole})
    assert "trains output.weight whole" in e.cause and "--adapter" in e.fix
    e = _refusal(folder, {"sql": adapters["sql"]}, served_model_name="sql")
    assert "--lora sql has the name the base model is served under" in e.cause
