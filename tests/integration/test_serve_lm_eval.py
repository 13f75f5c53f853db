"""Issue 48 end to end: EleutherAI's lm-evaluation-harness (`lm_eval --model local-completions`,
batched: its requests carry lists of token-id prompts with echo and logprobs) against `duoka
serve` on the bundled tiny model in fp32, and lm-eval's own `hf` backend on the same folder,
over three offline tasks written here (JSONL + task YAMLs): multiple choice with shared
contexts and multi-token choices, rolling perplexity, and greedy generation. Every request's
loglikelihood agrees within 1e-3, and the generations are the same text. One server and one
lm-eval process for the module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from duoka.host.ports import free_port
from duoka.hub import bundled_model_dir

pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90
EVAL_TIMEOUT_S = 300
TOLERANCE = 1e-3
# lm-eval's context: both backends score every document in one window (the longest is ~60 tokens).
MAX_LENGTH = 256
TASKS = ("duoka_mc", "duoka_ppl", "duoka_gen")

QUESTIONS = [
    ("The quick brown fox jumps over the lazy dog. Then the fox", [" runs away into the woods", " sleeps",
                                                                   " jumps again over the dog", " eats"], 0),
    ("def f(x):\n    return", [" x ** 2", " None", " the value of x", " f(x - 1) + 1"], 0),
    ("Grouped-query attention shares each key", [" and value head", " of the lock", " to the city hall",
                                                  " across several query heads"], 3),
    ("中文分词测试：你好，", ["世界。", "多卡训练大模型。", "朋友", "再见"], 0),
]
TEXTS = ["The quick brown fox jumps over the lazy dog. It's 2024, and we're testing 12345 numbers!",
         "Émigré naïve café — ünïcödé, emoji 🙂🚀, tabs\tand\nnewlines\n\n  indented code:\n    return x"]
PROMPTS = [("The quick brown fox", " jumps"), ("def f(x):\n", "    return x")]

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
MC = """output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
PPL = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""
GEN = """output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path) -> Path:
    folder.mkdir()
    rows = {"duoka_mc": [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS],
            "duoka_ppl": [{"text": t} for t in TEXTS],
            "duoka_gen": [{"question": q, "answer": a} for q, a in PROMPTS]}
    for name, body in (("duoka_mc", MC), ("duoka_ppl", PPL), ("duoka_gen", GEN)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows[name]), encoding="utf-8")
        (folder / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data) + body.format(), encoding="utf-8")
    return folder


# One process runs both evaluations through lm-eval's own evaluator (what its CLI calls), with
# only this folder's tasks indexed (its CLI indexes its thousands of built-in ones first, ~5 s a
# run): lm-eval's hf backend first, while the server starts, then local-completions against it,
# batched (lists of token-id prompts). argv: tasks folder, model folder, server URL, output file.
DRIVER = """
import json, sys, time, urllib.request
import lm_eval
from lm_eval.tasks import TaskManager

MAX_LENGTH, START_TIMEOUT_S = {max_length}, {start_timeout_s}

tasks, folder, url, out = sys.argv[1:]
manager = TaskManager(include_path=tasks, include_defaults=False)
names = ["duoka_mc", "duoka_ppl", "duoka_gen"]

def run(model, model_args, **kwargs):
    result = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=names, task_manager=manager,
                                     log_samples=True, batch_size=4, **kwargs)
    return {t: [{"doc_id": s["doc_id"], "resps": s["resps"], "acc": s.get("acc")} for s in result["samples"][t]]
            for t in names}

hf = run("hf", {"pretrained": folder, "dtype": "float32", "max_length": MAX_LENGTH}, device="cpu")
deadline = time.monotonic() + START_TIMEOUT_S
while True:
    try:
        urllib.request.urlopen(url + "/health", timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
served = run("local-completions", {"model": "tiny", "base_url": url + "/v1/completions", "tokenizer": folder,
                                   "tokenizer_backend": "huggingface", "max_length": MAX_LENGTH})
json.dump({"hf": hf, "served": served}, open(out, "w"))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(served, hf): each task's samples, in document order."""
    root = tmp_path_factory.mktemp("lm-eval")
    folder = root / "model"
    shutil.copytree(bundled_model_dir(), folder)
    # transformers' generate would let the folder's max_new_tokens win over lm-eval's max_gen_toks.
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    tasks = write_tasks(root / "tasks")
    port = free_port()
    log = root / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "duoka.cli", "serve", str(folder), "--device", "cpu", "--dtype", "float32",
           "--port", str(port), "--max-model-len", "512", "--served-model-name", "tiny"]
    with open(log, "w") as err:
        server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
    out = root / "samples.json"
    try:
        driver = DRIVER.replace("{max_length}", str(MAX_LENGTH)).replace("{start_timeout_s}", str(START_TIMEOUT_S))
        proc = subprocess.run([sys.executable, "-c", driver, str(tasks), str(folder), f"http://127.0.0.1:{port}",
                               str(out)], cwd=root, capture_output=True, text=True, timeout=EVAL_TIMEOUT_S, check=False,
                              env={**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                                   "HF_DATASETS_CACHE": str(root / "datasets-cache"),
                                   "TOKENIZERS_PARALLELISM": "false"})
        assert proc.returncode == 0, f"{proc.stderr[-4000:]}\nserver:\n{log.read_text()[-2000:]}"
    finally:
        server.terminate()
        server.wait(30)
    samples = json.loads(out.read_text())
    return tuple({t: sorted(rows, key=lambda r: r["doc_id"]) for t, rows in samples[side].items()}
                 for side in ("served", "hf"))


def loglikelihoods(sample: dict) -> list[float]:
    """A sample's per-request loglikelihoods: [(ll, is_greedy)] per choice, or [ll] for a rolling one."""
    return [float(r[0][0]) if isinstance(r[0], list) else float(r[0]) for r in sample["resps"]]


def test_multiple_choice_loglikelihoods_match_hf(runs):
    served, hf = runs
    assert len(served["duoka_mc"]) == len(QUESTIONS)
    for a, b in zip(served["duoka_mc"], hf["duoka_mc"]):
        got, want = loglikelihoods(a), loglikelihoods(b)
        assert len(got) == 4 and all(abs(x - y) < TOLERANCE for x, y in zip(got, want)), (a["doc_id"], got, want)
        assert [r[0][1] for r in a["resps"]] == [r[0][1] for r in b["resps"]]  # is_greedy
        assert a["acc"] == b["acc"]


def test_rolling_perplexity_matches_hf(runs):
    served, hf = runs
    for a, b in zip(served["duoka_ppl"], hf["duoka_ppl"]):
        [got], [want] = loglikelihoods(a), loglikelihoods(b)
        assert got < 0 and abs(got - want) < TOLERANCE, (a["doc_id"], got, want)


def test_generation_matches_hf(runs):
    served, hf = runs
    for a, b in zip(served["duoka_gen"], hf["duoka_gen"]):
        assert a["resps"] == b["resps"] and a["resps"][0][0], (a["resps"], b["resps"])
