"""EngineConfig: the one description of the engine's options, from which `duoka serve`'s and
`duoka generate`'s engine flags and the table in docs/serving.md are made; checked when made,
picklable as it travels to the engine's process and the tensor-parallel ranks."""

from __future__ import annotations

import pickle
from dataclasses import fields
from pathlib import Path

import pytest

from duoka.cli import build_parser
from duoka.errors import DuokaError
from duoka.serve.config import (
    DOCS_COMMAND,
    GENERATE,
    SERVE,
    EngineConfig,
    ServerConfig,
    docs_section,
    engine_config_from_args,
    reference_markdown,
)
from duoka.serve.engine import LLM

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def test_docs_hold_the_generated_table():
    assert docs_section(DOCS.read_text()) == reference_markdown(), f"run: {DOCS_COMMAND}"
    for f in fields(EngineConfig):
        assert f"| `{f.name}` |" in reference_markdown()


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_no_flags_give_the_defaults():
    assert engine_config_from_args(_parse("serve"), SERVE) == EngineConfig()
    assert engine_config_from_args(_parse("generate"), GENERATE) == EngineConfig()


def test_serve_flags_set_their_fields():
    a = _parse("serve", "/models/m", "--tp", "2", "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
               "--gpu-memory-utilization", "0.5", "--num-kv-blocks", "64", "--block-size", "8", "--max-num-seqs", "4",
               "--max-num-batched-tokens", "100", "--max-prefill-beside-decodes", "0", "--served-model-name", "mine",
               "--no-prefix-caching", "--enforce-eager", "--port", "9000")
    want = EngineConfig(model="/models/m", tp=2, device="cpu", dtype="float32", max_model_len=512,
                        gpu_memory_utilization=0.5, num_kv_blocks=64, block_size=8, max_num_seqs=4,
                        max_num_batched_tokens=100, max_prefill_beside_decodes=0, served_model_name="mine",
                        enable_prefix_caching=False,
                        cuda_graphs=False, compile=False)
    assert engine_config_from_args(a, SERVE) == want
    assert a.port == 9000  # a server flag, not the engine's
    g = _parse("generate", "--model", "m", "--adapter", "ad", "--enforce-eager", "--seed", "3")
    assert engine_config_from_args(g, GENERATE, max_num_seqs=1) == EngineConfig(
        model="m", adapter="ad", cuda_graphs=False, compile=False, max_num_seqs=1)  # --seed is the request's


def test_each_command_keeps_its_flags():
    def flags(command):
        parser = build_parser()._subparsers._group_actions[0].choices[command]
        return {s for action in parser._actions for s in action.option_strings} - {"-h", "--help"}

    assert flags("serve") == {"--tp", "--host", "--port", "--api-key", "--adapter", "--lora", "--served-model-name",
                              "--max-model-len", "--gpu-memory-utilization", "--max-queue", "--grace", "--device",
                              "--dtype", "--max-num-seqs", "--max-num-batched-tokens", "--max-prefill-beside-decodes",
                              "--block-size",
                              "--num-kv-blocks", "--no-prefix-caching", "--enforce-eager", "--skip-weight-check",
                              "--allowed-origins", "--log-requests", "--quantization", "--load-format",
                              *SPECULATIVE, "--speculative-disable-by-batch-size"}
    assert flags("generate") == {"--model", "--adapter", "--prompt", "--chat", "--system", "--max-new-tokens",
                                 "--temperature", "--top-p", "--top-k", "--seed", "--ignore-eos", "--device",
                                 "--dtype", "--enforce-eager", "--skip-weight-check", "--quantization", "--load-format",
                                 *SPECULATIVE}


SPECULATIVE = ("--speculative-model", "--speculative-method", "--num-speculative-tokens", "--prompt-lookup-max",
               "--prompt-lookup-min")


def test_speculative_flags_set_their_fields():
    a = _parse("serve", "m", "--speculative-method", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-min",
               "2", "--speculative-disable-by-batch-size", "8")
    assert engine_config_from_args(a, SERVE) == EngineConfig(model="m", speculative_method="ngram",
                                                           num_speculative_tokens=3, prompt_lookup_min=2,
                                                           speculative_disable_by_batch_size=8)
    g = _parse("generate", "--speculative-model", "d", "--num-speculative-tokens", "4")
    assert engine_config_from_args(g, GENERATE) == EngineConfig(speculative_model="d", num_speculative_tokens=4)


@pytest.mark.parametrize("options, message", [
    (dict(tp=0), "--tp 0 must be at least 1"),
    (dict(gpu_memory_utilization=1.5), r"--gpu-memory-utilization 1.5 is outside \(0, 1\]"),
    (dict(block_size=0), "block size, max_num_seqs and max_num_batched_tokens must be at least 1"),
    (dict(max_num_seqs=0), "block size, max_num_seqs and max_num_batched_tokens must be at least 1"),
])
def test_values_out_of_range_are_refused_when_made(options, message):
    with pytest.raises(DuokaError, match=message):
        EngineConfig(**options)


def test_an_unknown_option_names_itself_and_the_valid_ones():
    with pytest.raises(DuokaError) as e:
        LLM(None, max_num_seq=8)  # refused before anything loads
    assert "'max_num_seq' is not an engine option" in e.value.cause
    assert "did you mean max_num_seqs?" in e.value.fix and "gpu_memory_utilization" in e.value.fix


def test_configs_are_plain_and_travel_pickled():
    config = EngineConfig(model=Path("/models/m"), adapter=Path("/a"), tp=2)
    assert config.model == "/models/m" and config.adapter == "/a"
    assert pickle.loads(pickle.dumps(config)) == config
    server = ServerConfig(api_key="secret")
    assert pickle.loads(pickle.dumps(server)) == server and "secret" not in repr(server)
