"""The engine's logit processing end to end against transformers: a tiny random Qwen2 served
by duoka (fp32, CPU) at temperature 0 with logprobs, each request with one of penalties,
repetition_penalty, logit_bias and min_tokens, all in one batch. Every step is recomputed with
transformers' model on prompt + output so far, processed by transformers' own processors or
plain torch here; the chosen token is the reference argmax and the logprobs (the chosen one
and the top 5) are the reference log_softmax."""

import shutil

import pytest
import torch
from transformers import Qwen2ForCausalLM, RepetitionPenaltyLogitsProcessor

from duoka.serve.engine import LLM
from duoka.serve.params import SamplingParams

VOCAB = 600  # the tokenizer_dir fixture's vocabulary
STEPS = 8
TOP = 5
TOL = 1e-4


@pytest.fixture(scope="module")
def folder(saved_hf_model, tokenizer_dir, tmp_path_factory):
    """The session's tiny model with the tokenizer beside it, in a folder of this module's own."""
    out = tmp_path_factory.mktemp("logits-reference")
    shutil.copytree(saved_hf_model(vocab_size=VOCAB, seed=21), out, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def penalties(logits, prompt, output, p):
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).float()
    return logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def repetition(logits, prompt, output, p):
    ids = torch.tensor([prompt + output])
    return RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[None].clone())[0]


def bias(logits, prompt, output, p):
    out = logits.clone()
    for token, value in p.logit_bias:
        out[token] += value
    return out


def run(llm, requests):
    """Every request in one batch, greedy: {id: (prompt, [(token, TokenLogprob)], finish_reason)}."""
    engine = llm.engine
    steps = {rid: [] for rid in requests}
    reasons = {}
    for rid, (prompt, params, _) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            steps[out.request_id] += list(zip(out.new_token_ids, out.new_logprobs or []))
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return steps, reasons


def test_processed_logprobs_and_greedy_tokens_match_transformers(folder):
    llm = LLM(folder, device="cpu", dtype="float32", block_size=4, log=lambda m: None)
    hf = Qwen2ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    prompt = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (9, 14, 6, 11, 8)]

    def last_logits(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1].float()

    # logit_bias: ban the plain greedy first token, push another one up a little.
    first = int(last_logits(prompt[2]).argmax())
    eos = sorted(llm.engine.eos_ids)
    # min_tokens: a stop id the plain greedy decoding produces at once, and eos pushed up by a
    # bias of 100: both blocked for 3 steps, then eos ends the request.
    stop = int(last_logits(prompt[3]).argmax())

    def min_tokens(logits, prompt, output, p):
        logits = bias(logits, prompt, output, p)
        if len(output) >= p.min_tokens:
            return logits
        return logits.index_fill(0, torch.tensor(eos + list(p.stop_token_ids)), float("-inf"))

    base = {"max_tokens": STEPS, "temperature": 0.0, "logprobs": TOP}
    requests = {
        "penalties": (prompt[0], SamplingParams(presence_penalty=1.5, frequency_penalty=0.75, **base), penalties),
        "repetition": (prompt[1], SamplingParams(repetition_penalty=1.8, **base), repetition),
        "bias": (prompt[2], SamplingParams(logit_bias={first: -100, "5": 3.5}, **base), bias),
        "min_tokens": (prompt[3], SamplingParams(min_tokens=3, stop_token_ids=[stop], logit_bias={eos[0]: 100}, **base),
                       min_tokens),
        "plain": (prompt[4], SamplingParams(**base, ignore_eos=True), lambda logits, *_: logits),
    }
    steps, reasons = run(llm, requests)

    for rid, (prompt_ids, params, process) in requests.items():
        output = []
        changed = 0.0  # how far the processing moved the reference's logprobs: it must have done something
        assert steps[rid], rid
        for token, logprob in steps[rid]:
            raw = last_logits(prompt_ids + output)
            want = torch.log_softmax(process(raw, prompt_ids, output, params), dim=-1)
            assert token == int(want.argmax()) == logprob.token_id, (rid, len(output))
            assert logprob.logprob == pytest.approx(want[token].item(), abs=TOL), (rid, len(output))
            top = want.topk(TOP)
            assert [i for i, _ in logprob.top] == top.indices.tolist(), (rid, len(output))
            assert [v for _, v in logprob.top] == pytest.approx(top.values.tolist(), abs=TOL), (rid, len(output))
            changed = max(changed, (want - torch.log_softmax(raw, dim=-1)).abs().max().item())
            output.append(token)
        assert (changed > 0.1) == (rid != "plain"), (rid, changed)
    assert steps["bias"][0][0] != first and len(steps["plain"]) == STEPS
    # min_tokens: neither the stop id (the greedy choice at once) nor eos (forced) before 3 tokens.
    got = [t for t, _ in steps["min_tokens"]]
    assert stop not in got[:3] and got[3:] == [eos[0]] and reasons["min_tokens"] == "stop"
