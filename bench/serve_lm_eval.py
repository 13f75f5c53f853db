"""Issue 48's figure: a multiple-choice eval through EleutherAI's lm-evaluation-harness, scored by
`duoka serve` (lm-eval's `local-completions`: batched lists of token-id prompts with echo and
logprobs, several requests in flight) against lm-eval's own `hf` backend (batch_size=auto) on
the same GPU and model folder: loglikelihood requests per second on each side, the accuracy
of each (the same, up to near-ties that bf16 may flip: counted), and every request's
loglikelihood side by side (the largest difference).

The eval is made here, offline: QUESTIONS questions, each a context of about CONTEXT_CHARS
characters of the bundled corpus (a few hundred tokens) and four choices of CHOICE_CHARS
characters (multi-token), as a local JSONL file and task YAML (lm-eval's `dataset_path: json`).
lm-eval sends each choice as its own request: context + choice, the four sharing the context,
which the prefix cache computes once (prompt logprobs kept with the cached blocks;
docs/serving.md, "Evaluating a served model"); `prompt_tokens_computed` counts what was computed.

GPU (bench/NOTES.md 32: 1.15x the hf backend on an H100 before section 33's server changes):

    PYTHONPATH=$PWD python3 bench/serve_lm_eval.py --shape 7b --questions 2000 --out $OUT/serve_lm_eval_7b.json

on nvidia-h100-x1 (or nvidia-h200), with a random Qwen2-7B (bench/serve_models.py; pass --model
FOLDER for real weights, which the device machine cannot download). The device image lacks
lm-eval: carry .wheels holding `pip download --no-deps "lm-eval==0.4.13" datasets dill
sacrebleu tenacity aiohttp more_itertools sqlitedict word2number portalocker tabulate colorama
lxml` (and whatever of their dependencies the image lacks; `python -c "import lm_eval.evaluator,
lm_eval.models.huggingface, lm_eval.models.openai_completions"` says) and install them with
`pip install --no-index --no-deps .wheels/*.whl`; scikit-learn, scipy and nltk are not
imported by these tasks.

Where the server's time goes (--parts engine, NOTES 40): the same requests straight into the
engine (LLMEngine in this process: no HTTP, no lm-eval client), in lm-eval's order (longest
first) with as many in flight as lm-eval keeps (batch size x concurrent requests): wall time,
steps, tokens computed, and with --cprofile the host's hottest functions (time in a
synchronising call is the host waiting for the GPU).

CPU smoke check (the bundled tiny model in fp32; about 20 s on 2 cores):

    PYTHONPATH=$PWD python3 bench/serve_lm_eval.py --shape tiny --questions 24 --hf-batch-size 8 \\
        --out /tmp/serve_lm_eval_tiny.json
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import os
import pstats
import random
import resource
import re
import sys
import time
from pathlib import Path

import httpx2 as httpx
import lm_eval
import torch
from lm_eval.models.huggingface import HFLM
from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.tasks import TaskManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_table import kernel_table  # noqa: E402
from serve_models import make_folder  # noqa: E402

from duoka.bench.serving import StartedServer  # noqa: E402
from duoka.serve.config import EngineConfig  # noqa: E402
from duoka.serve.engine import LLMEngine  # noqa: E402
from duoka.serve.params import SamplingParams  # noqa: E402
from duoka.hub import bundled_model_dir  # noqa: E402

TASK = "duoka_mc_bench"
# A few hundred tokens of context (Qwen2's tokenizer: ~4 characters a token of English prose).
CONTEXT_CHARS = 1200
# Multi-token choices: ~15 tokens each.
CHOICE_CHARS = 60
CORPUS = Path(__file__).resolve().parents[1] / "duoka" / "assets" / "corpus" / "stdlib_docstrings.jsonl.gz"
START_TIMEOUT_S = 900  # a 7B folder of random weights loads and profiles in a minute or two
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_task(folder: Path, questions: int, seed: int = 0) -> Path:
    """The eval's JSONL and task YAML in `folder`; returns it (lm-eval's include_path)."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        texts = [re.sub(r"\s+", " ", json.loads(line)["text"]).strip() for line in f]
    prose = " ".join(texts)
    rng = random.Random(seed)

    def piece(chars: int) -> str:
        start = rng.randrange(0, len(prose) - chars)
        return prose[start:start + chars].strip()

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for _ in range(questions):
            row = {"context": piece(CONTEXT_CHARS), "choices": [piece(CHOICE_CHARS) for _ in range(4)],
                   "answer": rng.randrange(4)}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (folder / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data), encoding="utf-8")
    return folder


def evaluate(lm, tasks: Path) -> tuple[float, dict]:
    """(seconds, results) of one lm-eval run of TASK with an already built model."""
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    t0 = time.perf_counter()
    results = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, log_samples=True)
    return time.perf_counter() - t0, results


def loglikelihoods(results: dict) -> list[list[float]]:
    """Per document, in document order, its four choices' loglikelihoods."""
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def run_hf(folder: Path, tasks: Path, dtype: str, batch_size: str, device: str) -> dict:
    lm = HFLM(pretrained=str(folder), dtype=dtype, batch_size=batch_size, device=device)
    seconds, results = evaluate(lm, tasks)
    side = {"seconds": seconds, "acc": results["results"][TASK]["acc,none"], "batch_size": batch_size,
            "loglikelihoods": loglikelihoods(results)}
    del lm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the server is next on this GPU
    return side


def prompt_tokens_computed(url: str) -> float | None:
    """duoka_serve_prompt_tokens_total from the server's /metrics (prefix-cache hits excluded)."""
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    found = re.search(r"^duoka_serve_prompt_tokens_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def process_cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of process root and each of its descendants, by
    "pid command" (Linux /proc; a process gone meanwhile is left out)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, command)
    tree, found = {root}, True
    while found:
        found = {pid for pid, (ppid, _, _) in stats.items() if ppid in tree and pid not in tree}
        tree |= found
    return {f"{pid} {stats[pid][2][:80]}": stats[pid][1] for pid in sorted(tree) if pid in stats}


def run_duoka(folder: Path, tasks: Path, serve_args: list[str], batch_size: int, concurrent: int) -> dict:
    """lm-eval against duoka serve; also the CPU seconds of lm-eval's own process (the client:
    tokenizing, requests, parsing the answers) and of the server's processes in that time."""
    server = StartedServer(str(folder), ["--served-model-name", "model", *serve_args], START_TIMEOUT_S, log)
    try:
        before = prompt_tokens_computed(server.url)
        lm = LocalCompletionsAPI(model="model", base_url=server.url + "/v1/completions", tokenizer=str(folder),
                                 tokenizer_backend="huggingface", batch_size=batch_size, num_concurrent=concurrent,
                                 max_length=4096, timeout=3600)
        client0, server0 = resource.getrusage(resource.RUSAGE_SELF), process_cpu_seconds(server.proc.pid)
        seconds, results = evaluate(lm, tasks)
        client1, server1 = resource.getrusage(resource.RUSAGE_SELF), process_cpu_seconds(server.proc.pid)
        server.check_alive()
        after = prompt_tokens_computed(server.url)
    finally:
        server.stop()
    client = client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime
    return {"seconds": seconds, "acc": results["results"][TASK]["acc,none"], "batch_size": batch_size,
            "num_concurrent": concurrent, "serve_args": serve_args,
            "prompt_tokens_computed": None if before is None or after is None else after - before,
            "client_cpu_s": client,
            "server_cpu_s": {name: round(value - server0.get(name, 0.0), 2) for name, value in server1.items()},
            "loglikelihoods": loglikelihoods(results)}


def scoring_prompts(folder: Path, tasks: Path) -> list[list[int]]:
    """lm-eval's requests of the task as token ids, in the order it sends them: per choice the
    context's tokens and then the continuation's (" " + choice, split off the whole's encoding
    as lm-eval's _encode_pair does), longest first."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    prompts = []
    with open(tasks / f"{TASK}.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            context = tok.encode(row["context"], add_special_tokens=False)
            for choice in row["choices"]:
                whole = tok.encode(row["context"] + " " + choice, add_special_tokens=False)
                prompts.append(context + whole[len(context):])
    return sorted(prompts, key=len, reverse=True)


KERNELS_FROM = 20  # the first steps still fill the pipeline and compile new shapes


def run_engine(folder: Path, tasks: Path, dtype: str, device: str, in_flight: int, profile: bool,
               kernels: int) -> dict:
    """The scoring requests straight into LLMEngine, in_flight of them at a time (lm-eval's
    batch size x concurrent requests), each max_tokens=1 with prompt logprobs of k=1 as lm-eval
    asks: wall time, steps, prompt tokens computed; with profile the host's top functions; with
    kernels the device's kernels over that many steps from the 20th (torch.profiler: those
    steps run slower, so the wall time then is not the figure to quote)."""
    prompts = scoring_prompts(folder, tasks)
    engine = LLMEngine(EngineConfig(model=folder, dtype=dtype, device=device))  # as duoka serve with no flags
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
    for i, p in enumerate(prompts[:4]):  # warm-up: the compiled blocks' first shapes
        engine.add_request(f"w{i}", p, params)
    while engine.has_unfinished():
        engine.step()
    before = engine.stats()
    prof = cProfile.Profile() if profile else None
    pending, done, steps = list(enumerate(prompts))[::-1], 0, 0
    running = 0
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    cuda = device == "cuda"
    kernel_prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if cuda else
                                                     torch.profiler.ProfilerActivity.CPU]) if kernels else None
    while pending or engine.has_unfinished():
        while pending and running < in_flight:
            i, p = pending.pop()
            engine.add_request(f"r{i}", p, params)
            running += 1
        if kernel_prof and steps == KERNELS_FROM:
            kernel_prof.start()
        finished = sum(out.finished for out in engine.step())
        running -= finished
        done += finished
        steps += 1
        if kernel_prof and steps == KERNELS_FROM + kernels:
            kernel_prof.stop()
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    after = engine.stats()
    engine.shutdown()
    side = {"seconds": wall, "requests": done, "steps": steps, "in_flight": in_flight,
            "prompt_tokens": sum(map(len, prompts)),
            "prompt_tokens_computed": after.prompt_tokens - before.prompt_tokens,
            "prefix_hits": after.prefix_hits - before.prefix_hits}
    side["computed_tokens_per_s"] = side["prompt_tokens_computed"] / wall
    side["computed_tokens_per_step"] = side["prompt_tokens_computed"] / max(steps, 1)
    side["requests_per_s"] = done / wall
    profiled = min(steps, KERNELS_FROM + kernels) - KERNELS_FROM
    if kernel_prof and profiled > 0:
        if profiled < kernels:  # the run ended inside the window
            kernel_prof.stop()
        side["kernels_per_step"] = {"steps": profiled, **kernel_table(kernel_prof, profiled, cuda=cuda)}
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        side["host_profile"] = out.getvalue()
    return side


def compare(duoka: dict, hf: dict, questions: int) -> dict:
    a, b = duoka.pop("loglikelihoods"), hf.pop("loglikelihoods")
    diffs = [abs(x - y) for da, db in zip(a, b) for x, y in zip(da, db)]
    picks = sum(max(range(4), key=da.__getitem__) != max(range(4), key=db.__getitem__) for da, db in zip(a, b))
    requests = 4 * questions
    for side in (duoka, hf):
        side["requests_per_s"] = requests / side["seconds"]
    return {"requests": requests, "max_abs_loglikelihood_diff": max(diffs),
            "mean_abs_loglikelihood_diff": sum(diffs) / len(diffs), "questions_answered_differently": picks,
            "speedup": hf["seconds"] / duoka["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="7b", help="a bench/serve_models.py shape (random weights), or tiny: the "
                                                 "bundled model")
    p.add_argument("--model", help="a model folder instead of --shape's")
    p.add_argument("--questions", type=int, default=2000)
    p.add_argument("--dtype", help="both sides' dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--hf-batch-size", default="auto", help="lm-eval's hf backend batch size (auto: its search)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per request to duoka serve")
    p.add_argument("--num-concurrent", type=int, default=16, help="requests in flight to duoka serve")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `duoka serve` flag (repeatable)")
    p.add_argument("--parts", nargs="+", default=["hf", "duoka"], choices=["hf", "duoka", "engine"],
                   help="hf: lm-eval's hf backend; duoka: lm-eval against duoka serve; engine: the same "
                        "requests straight into the engine (no HTTP, no lm-eval client)")
    p.add_argument("--cprofile", action="store_true", help="with engine: the host's hottest functions too")
    p.add_argument("--kernels", type=int, default=0, metavar="STEPS",
                   help="with engine: the GPU's kernels per step over STEPS steps (torch.profiler)")
    p.add_argument("--work", default="/tmp/duoka-lm-eval", help="where the task files go")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.model:
        folder = Path(args.model)
    else:
        folder = bundled_model_dir() if args.shape == "tiny" else make_folder(args.shape)
    tasks = make_task(Path(args.work) / f"tasks-{args.questions}", args.questions)

    log(f"lm-eval {lm_eval.__version__}: {args.questions} questions on {folder} ({dtype}, {device})")
    result = {"model": str(folder), "shape": None if args.model else args.shape, "questions": args.questions,
              "dtype": dtype, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "lm_eval": lm_eval.__version__,
              "command": " ".join(["python3", "bench/serve_lm_eval.py", *sys.argv[1:]])}
    if "engine" in args.parts:
        result["engine"] = run_engine(folder, tasks, dtype, device, args.batch_size * args.num_concurrent,
                                      args.cprofile, args.kernels)
        log(f"engine alone: {result['engine']['seconds']:.1f} s, "
            f"{result['engine']['computed_tokens_per_s']:,.0f} computed tokens/s")
        if cuda:
            torch.cuda.empty_cache()
    if "hf" in args.parts:
        result["hf"] = run_hf(folder, tasks, dtype, args.hf_batch_size, device)
        log(f"hf backend: {result['hf']['seconds']:.1f} s, acc {result['hf']['acc']:.4f}")
    if "duoka" in args.parts:
        serve_args = ["--dtype", dtype, "--device", device, *args.serve_arg]
        result["duoka"] = run_duoka(folder, tasks, serve_args, args.batch_size, args.num_concurrent)
        log(f"duoka serve: {result['duoka']['seconds']:.1f} s, acc {result['duoka']['acc']:.4f}")
    if "hf" in result and "duoka" in result:
        result.update(compare(result["duoka"], result["hf"], args.questions))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("duoka", "hf", "engine")}, indent=1))
    if "engine" in result:
        print({k: v for k, v in result["engine"].items() if k != "host_profile"})
        print(result["engine"].get("host_profile", ""))
    if "speedup" in result:
        duoka, hf = result["duoka"], result["hf"]
        print(f"duoka {duoka['requests_per_s']:.1f} req/s (acc {duoka['acc']:.4f}), hf {hf['requests_per_s']:.1f} "
              f"req/s (acc {hf['acc']:.4f}): {result['speedup']:.2f}x")


if __name__ == "__main__":
    main()
