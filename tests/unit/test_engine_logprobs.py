"""What the engine reports beside its tokens: logprobs equal a plain forward's log-softmax;
a model folder's generation_config.json sets the sampling defaults."""

import json

import torch

from duoka.hub import bundled_model_dir
from duoka.models.qwen2.hf_adapter import load_hf_model
from duoka.serve.config import EngineConfig
from duoka.serve.engine import LLMEngine
from duoka.serve.params import SamplingParams


def test_logprobs_equal_the_plain_forward():
    engine = LLMEngine(EngineConfig(device="cpu", max_model_len=128, num_kv_blocks=16), log=lambda m: None)
    prompt = engine.tokenizer.encode("Return the value of")
    engine.add_request("a", prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    logprobs = [lp for o in outs for lp in (o.new_logprobs or [])]
    assert len(logprobs) == len(tokens) == 6

    model, _ = load_hf_model(bundled_model_dir(), "cpu", torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([prompt + tokens]))[0].log_softmax(-1)[len(prompt) - 1:-1]
    for i, (token, lp) in enumerate(zip(tokens, logprobs)):
        assert lp.token_id == token
        torch.testing.assert_close(lp.logprob, want[i, token].item(), atol=1e-4, rtol=0)
        top = want[i].topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), top.values, atol=1e-4, rtol=0)
        assert lp.top[0][0] == token  # greedy: the sampled token is the most likely


def test_generation_config_sets_the_defaults(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for f in bundled_model_dir().iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                               "eos_token_id": [0, 3]}))
    engine = LLMEngine(EngineConfig(model=folder, device="cpu", max_model_len=64, num_kv_blocks=8),
                       log=lambda m: None)
    params = engine.make_params(max_tokens=5)
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.8, 20)
    assert engine.make_params(temperature=0.0).temperature == 0.0  # the request's own field wins
    assert {0, 3} <= engine.eos_ids  # and the tokenizer's own eos
