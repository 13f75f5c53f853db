"""What a serving engine is built from: EngineConfig (the model, the cache, the batch limits,
tensor parallelism) and ServerConfig (the HTTP side of `duoka serve`).

Both are frozen dataclasses of plain values: they are checked once, when made, and travel
as they are to the engine's own process (serve.engine_process) and to every tensor-parallel
rank (serve.rank_process). EngineConfig's fields carry their documentation and command-line
form: `duoka serve`'s and `duoka generate`'s engine flags are made from them
(add_engine_flags, engine_config_from_args), and so is the table of engine options in
docs/serving.md (`python -m duoka.serve.config --update docs/serving.md`), as training's
flags and docs/config.md come from duoka.config. This module imports no torch: `duoka
--help` builds its parsers from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from duoka.errors import DuokaError

DTYPES = ("auto", "float32", "bfloat16", "float16")
SERVE, GENERATE = "serve", "generate"  # the commands whose flags come from EngineConfig

DEFAULT_HOST = "127.0.0.1"  # nothing outside this machine reaches the server unless --host says so
DEFAULT_PORT = 8000  # vLLM's and the OpenAI clients' usual local port
# `vllm bench serve` sends its 1,000 prompts at once by default; a waiting request costs
# only its token ids, so the bound is there to shed a flood, not to protect memory.
DEFAULT_MAX_QUEUE = 4096
# Kubernetes' default terminationGracePeriodSeconds is 30 s; draining must end before it.
DEFAULT_GRACE_S = 25.0

# The generated table in docs/serving.md sits between these two lines.
DOCS_BEGIN = "<!-- engine options: generated from duoka/serve/config.py, do not edit by hand -->"
DOCS_END = "<!-- end of engine options -->"
DOCS_COMMAND = "python -m duoka.serve.config --update docs/serving.md"


def option(default, help: str, *, flag: str | None = None, commands: tuple[str, ...] = (),
           positional: tuple[str, ...] = (), switch: dict | None = None, flag_help: str | None = None,
           choices: tuple | None = None, repeat: Callable[[str], typing.Any] | None = None, metavar: str | None = None):
    """An engine option with its documentation and its command-line form in one place.

    flag: the option's flag (e.g. --max-model-len), on the commands named; none: Python only.
    positional: the commands that take it as their positional argument instead.
    switch: the flag takes no value; given, it sets these fields ({field: value}), so one
    flag may set several fields (--enforce-eager); flag_help then says what it does.
    repeat: the flag may be given several times; this function turns each text into one
    item of the field's tuple (raising DuokaError for a malformed one)."""
    meta = {"help": help, "flag": flag, "commands": commands, "positional": positional, "switch": switch,
            "flag_help": flag_help, "choices": choices, "repeat": repeat, "metavar": metavar}
    return field(default=default, metadata=meta)


def parse_lora(text: str) -> tuple[str, str]:
    """--lora NAME=DIR -> (NAME, DIR)."""
    name, sep, folder = text.partition("=")
    if not sep or not name.strip() or not folder.strip():
        raise DuokaError(f"--lora {text!r} is not of the form NAME=DIR",
                         "give the name clients send as the request's model, then = and the adapter's folder, "
                         "e.g. --lora sql=/adapters/sql")
    return name.strip(), folder.strip()


_EAGER = {"cuda_graphs": False, "compile": False}
SPECULATIVE_METHODS = ("draft_model", "ngram")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
# Above this many running requests a step decodes plainly (speculative_disable_by_batch_size):
# bench/serve_speculative.py's sweep on an H100 (7B, p 0.8, K 4): 1.30x plain at 16, 0.54x at 64.
DEFAULT_SPECULATIVE_MAX_BATCH = 16
# Prompt tokens a step computes beside running decodes. On an H100 (7B, bench/NOTES.md 44-45) a
# cap of 768 met the latency run's tails (TTFT p99 98.8 ms, ITL p99 23.9 ms; uncapped 786 and
# 30.2); on the 256-request burst it measured 7.8% under an uncapped run of the same call (run
# first; uncapped runs alone have spread 25.1-29.2k total tok/s), where 512 cost 22%. Tails are
# what an interactive server is judged by, and the burst stays above 12x the peer.
DEFAULT_PREFILL_BESIDE_DECODES = 768


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = option(
        None, "model folder, hub id or a training run's hf/step-N (default: the tiny model bundled with duoka, or "
              "the base --adapter's adapter_config.json names)",
        flag="--model", commands=(GENERATE,), positional=(SERVE,))
    adapter: str | None = option(
        None, "a PEFT LoRA adapter folder (a LoRA run's hf/step-N) merged into the model's weights at load; MODEL "
              "defaults to the base its adapter_config.json names (tp 1)",
        flag="--adapter", commands=(SERVE, GENERATE))
    loras: tuple[tuple[str, str], ...] = option(
        (), "PEFT LoRA adapters served beside the base, each request choosing one by its model field (NAME), "
            "requests of different adapters batched together; repeat the flag for each adapter (Python: a dict "
            "or (name, folder) pairs)",
        flag="--lora", commands=(SERVE,), repeat=parse_lora, metavar="NAME=DIR")
    served_model_name: str | None = option(
        None, "the model name clients send (default: MODEL, or the --adapter folder)",
        flag="--served-model-name", commands=(SERVE,))
    tp: int = option(1, "tensor-parallel size: one process per GPU", flag="--tp", commands=(SERVE,))
    device: str | None = option(None, "cpu, cuda or cuda:N (default: cuda when available)",
                                flag="--device", commands=(SERVE, GENERATE))
    dtype: str = option("auto", "auto = bfloat16 on GPU, float32 on CPU", flag="--dtype", commands=(SERVE, GENERATE),
                        choices=DTYPES)
    quantization: str | None = option(
        None, "fp8: quantize a bf16 checkpoint's projections to FP8 at load (per-channel weights, per-token "
              "activations; FP8 matmuls on compute capability 8.9+); GPTQ, AWQ and FP8 compressed-tensors folders are "
              "read from their config.json without it",
        flag="--quantization", commands=(SERVE, GENERATE), choices=("fp8",))
    load_format: str = option(
        "auto", "auto: the folder's safetensors; dummy: random weights of the folder's config.json made on the "
                "device (benchmarks of shapes not on disk; the answers mean nothing)",
        flag="--load-format", commands=(SERVE, GENERATE), choices=("auto", "dummy"))
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's)",
                                       flag="--max-model-len", commands=(SERVE,))
    gpu_memory_utilization: float = option(
        0.9, "share of GPU memory for weights and KV cache; on CPU, the share of free RAM the KV cache may take, "
             "at most 1 GiB",
        flag="--gpu-memory-utilization", commands=(SERVE,))
    kv_cache_memory_gib: float | None = option(
        None, "the KV cache's size in GiB, instead of what gpu_memory_utilization leaves")
    num_kv_blocks: int | None = option(None, "a fixed KV-cache size in blocks (tests, tuning)",
                                       flag="--num-kv-blocks", commands=(SERVE,))
    block_size: int = option(16, "tokens per KV-cache block", flag="--block-size", commands=(SERVE,))
    max_num_seqs: int = option(256, "most requests in one step", flag="--max-num-seqs", commands=(SERVE,))
    max_num_batched_tokens: int = option(8192, "token budget of one step: prefill chunks beside the decodes",
                                         flag="--max-num-batched-tokens", commands=(SERVE,))
    max_prefill_beside_decodes: int = option(
        DEFAULT_PREFILL_BESIDE_DECODES,
        "prompt tokens a step computes at most while requests are decoding (0: up to "
        "--max-num-batched-tokens): a prompt of many thousand tokens then goes in chunks instead of stalling "
        "every stream for one long step; 768 kept a 7B's inter-token p99 at 24 ms under 1K-token prompts",
        flag="--max-prefill-beside-decodes", commands=(SERVE,))
    enable_prefix_caching: bool = option(
        True, "reuse the KV-cache blocks of shared prompt prefixes",
        flag="--no-prefix-caching", commands=(SERVE,), switch={"enable_prefix_caching": False},
        flag_help="do not reuse the blocks of shared prompt prefixes")
    cuda_graphs: bool = option(
        True, "replay decode-only steps from CUDA graphs captured per batch-size bucket, and steps with prefill "
        "chunks of up to 2,048 tokens per token bucket (GPU)",
        flag="--enforce-eager", commands=(SERVE, GENERATE), switch=_EAGER,
        flag_help="no compiled blocks and no CUDA graphs (GPU; slower, starts faster)")
    compile: bool | None = option(
        None, "run each decoder block as one compiled graph (default: on GPU only)",
        flag="--enforce-eager", commands=(SERVE, GENERATE), switch=_EAGER)
    seed: int = option(0, "seed of the seeds drawn for requests that bring none")
    check_weights: bool = option(
        True, "refuse the model if a weight tensor holds NaN or infinity (one pass over the loaded weights on the "
              "device: 7 ms for a 7B model on an H100)",
        flag="--skip-weight-check", commands=(SERVE, GENERATE), switch={"check_weights": False},
        flag_help="load the weights even if a tensor holds NaN or infinity")
    speculative_model: str | None = option(
        None, "speculative decoding: a small draft model (folder or hub id) with the model's tokenizer, e.g. "
              "Qwen2-0.5B-Instruct for Qwen2-7B-Instruct, that proposes --num-speculative-tokens tokens per step; "
              "the model verifies them in one forward (greedy output unchanged, sampled output of the same "
              "distribution; tp 1)",
        flag="--speculative-model", commands=(SERVE, GENERATE))
    speculative_method: str | None = option(
        None, "draft_model (implied by --speculative-model) or ngram: propose the tokens that followed the latest "
              "earlier occurrence of the sequence's last n tokens (prompt lookup, no draft model)",
        flag="--speculative-method", commands=(SERVE, GENERATE), choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int | None = option(
        None, "speculative decoding: tokens proposed per sequence and step (K); each step verifies K + 1 tokens "
              "per sequence in one forward",
        flag="--num-speculative-tokens", commands=(SERVE, GENERATE))
    prompt_lookup_max: int | None = option(
        None, "ngram: the longest n tried first (default: prompt_lookup_min, or 5 when neither is given, as vLLM)",
        flag="--prompt-lookup-max", commands=(SERVE, GENERATE))
    prompt_lookup_min: int | None = option(
        None, "ngram: the shortest n tried (default: prompt_lookup_max, or 5 when neither is given, as vLLM)",
        flag="--prompt-lookup-min", commands=(SERVE, GENERATE))
    speculative_disable_by_batch_size: int = option(
        DEFAULT_SPECULATIVE_MAX_BATCH,
        "speculate only in steps that start with at most this many running requests: above it the K + 1 "
        "tokens verified per request cost more than the accepted ones save (vLLM's speculative_disable_by_"
        "batch_size; the default from bench/serve_speculative.py's sweep on an H100: 1.30x plain at 16 requests, "
        "0.54x at 64)",
        flag="--speculative-disable-by-batch-size", commands=(SERVE,))

    def __post_init__(self):
        if self.tp < 1:
            raise DuokaError(f"--tp {self.tp} must be at least 1", "give the number of GPUs to split the model over")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise DuokaError(f"--gpu-memory-utilization {self.gpu_memory_utilization} is outside (0, 1]",
                             "give the share of the GPU's memory to use, e.g. 0.9")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise DuokaError("block size, max_num_seqs and max_num_batched_tokens must be at least 1",
                             "leave them at their defaults (16, 256, 8192) unless you are tuning")
        if self.max_prefill_beside_decodes < 0:
            raise DuokaError(f"--max-prefill-beside-decodes {self.max_prefill_beside_decodes} is negative",
                             "give the prompt tokens a decoding step may add, e.g. 512, or 0 for no cap")
        # Plain strings, whatever path type the caller had: the config travels between processes.
        for name in ("model", "adapter", "speculative_model"):
            value = getattr(self, name)
            if isinstance(value, Path):
                object.__setattr__(self, name, str(value))
        object.__setattr__(self, "loras", _checked_loras(self.loras))
        self._check_speculative()

    @property
    def speculation(self) -> str | None:
        """The speculative method in use: "draft_model", "ngram", or None (plain decoding)."""
        if self.speculative_method is not None:
            return self.speculative_method
        return "draft_model" if self.speculative_model is not None else None

    @property
    def prompt_lookup(self) -> tuple[int, int]:
        """ngram's (shortest, longest) n: one given sets the other, neither gives vLLM's 5 and 5."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        return (low or high or DEFAULT_PROMPT_LOOKUP, high or low or DEFAULT_PROMPT_LOOKUP)

    def _check_speculative(self) -> None:
        method, k = self.speculation, self.num_speculative_tokens
        if self.speculative_model is not None and method != "draft_model":
            raise DuokaError(f"--speculative-model is a draft model, but --speculative-method is {method}",
                             "drop --speculative-model for ngram, or --speculative-method for the draft model")
        if method is None:
            if k is not None or self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise DuokaError("speculative options are given without a speculative method",
                                 "add --speculative-model DRAFT or --speculative-method ngram")
            return
        if method == "draft_model" and self.speculative_model is None:
            raise DuokaError("--speculative-method draft_model needs the draft model",
                             "give it with --speculative-model DRAFT (a small model with this model's tokenizer)")
        if k is None or k < 1:
            raise DuokaError(f"speculative decoding needs --num-speculative-tokens of at least 1 (got {k})",
                             "give the tokens to propose per step, e.g. --num-speculative-tokens 4")
        if k + 1 > self.max_num_batched_tokens:
            raise DuokaError(f"--num-speculative-tokens {k} verifies {k + 1} tokens a step, more than "
                             f"--max-num-batched-tokens {self.max_num_batched_tokens}",
                             "lower --num-speculative-tokens or raise --max-num-batched-tokens")
        if method == "ngram":
            low, high = self.prompt_lookup
            if not 1 <= low <= high:
                raise DuokaError(f"--prompt-lookup-min {low} and --prompt-lookup-max {high} are not 1 <= min <= max",
                                 "give n-gram lengths such as --prompt-lookup-min 2 --prompt-lookup-max 5")
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise DuokaError("--prompt-lookup-min/max apply to --speculative-method ngram only",
                             "drop them, or use --speculative-method ngram")
        if method == "draft_model" and self.tp > 1:
            raise DuokaError("a speculative draft model with tensor parallelism is not supported yet",
                             "serve with --tp 1, or use --speculative-method ngram (no draft model)")
        if self.speculative_disable_by_batch_size < 1:
            raise DuokaError(f"--speculative-disable-by-batch-size {self.speculative_disable_by_batch_size} must be "
                             "at least 1", "give the largest running batch that still speculates, e.g. 16")

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        """The config from keyword options (the Python API's `LLM(model, **options)`); a name
        that is no option is refused with the nearest one and the whole list."""
        names = [f.name for f in fields(cls)]
        unknown = [name for name in options if name not in names]
        if unknown:
            close = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise DuokaError(f"{unknown[0]!r} is not an engine option",
                             f"{hint}the options are: {', '.join(names)} (docs/serving.md)")
        return cls(**options)


def _checked_loras(loras) -> tuple[tuple[str, str], ...]:
    """EngineConfig.loras as (name, folder) string pairs with unique names; a dict is taken as its items."""
    pairs = tuple(loras.items()) if isinstance(loras, dict) else tuple(loras)
    if not all(isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) and p[0].strip()
               and isinstance(p[1], (str, Path)) and str(p[1]).strip() for p in pairs):
        raise DuokaError(f"loras={loras!r} is not a list of (name, folder) pairs",
                         'give e.g. loras={"sql": "/adapters/sql"} (on the command line: --lora sql=/adapters/sql)')
    pairs = tuple((name, str(folder)) for name, folder in pairs)
    names = [name for name, _ in pairs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise DuokaError(f"--lora {twice[0]} is given more than once",
                         "give each adapter its own name: requests choose an adapter by its name")
    return pairs


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side of `duoka serve` (serve.server.serve's keywords; it checks them)."""
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = field(default=None, repr=False)  # a secret: kept out of logs and tracebacks
    max_queue: int = DEFAULT_MAX_QUEUE
    served_model_name: str | None = None
    grace_s: float = DEFAULT_GRACE_S
    allowed_origins: tuple[str, ...] = ()  # CORS: the browser origins allowed to call the API; none by default
    log_requests: bool = False  # one log line per request (method, path, status, ms, request id)

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- command-line flags
def _takes(f: dataclasses.Field, command: str) -> bool:
    return command in f.metadata["commands"] or command in f.metadata["positional"]


def _value_type(f: dataclasses.Field) -> type:
    """int for `int | None`, and so on: what argparse converts a flag's text to."""
    hint = typing.get_type_hints(EngineConfig)[f.name]
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    return kinds[0]


def _flag_help(f: dataclasses.Field) -> str:
    m = f.metadata
    if m["switch"] is not None:
        return m["flag_help"]
    number = isinstance(f.default, (int, float)) and not isinstance(f.default, bool)
    return m["help"] + (f" (default {f.default:g})" if number else "")


def add_engine_flags(parser, command: str) -> None:
    """The engine options `command` takes, as flags of `parser` (a parser or an argument
    group), in EngineConfig's field order; a flag shared by several fields is added once."""
    added = set()
    for f in fields(EngineConfig):
        m = f.metadata
        if not _takes(f, command) or m["flag"] in added:
            continue
        if command in m["positional"]:
            parser.add_argument(f.name, nargs="?", default=f.default, help=m["help"])
        elif m["repeat"] is not None:  # texts collected here, parsed by engine_config_from_args (a DuokaError)
            parser.add_argument(m["flag"], dest=f.name, action="append", default=None, metavar=m["metavar"],
                                help=m["help"])
        elif m["switch"] is not None:
            parser.add_argument(m["flag"], action="store_true", help=_flag_help(f))
        else:
            parser.add_argument(m["flag"], dest=f.name, type=_value_type(f), default=f.default,
                                choices=m["choices"], help=_flag_help(f))
        added.add(m["flag"])


def engine_config_from_args(args: argparse.Namespace, command: str, **overrides) -> EngineConfig:
    """The EngineConfig of a parsed command line (add_engine_flags' flags of `command`), with
    `overrides` (what the command decides itself) on top."""
    values = {}
    for f in fields(EngineConfig):
        m = f.metadata
        if not _takes(f, command):
            continue
        if m["repeat"] is not None:
            values[f.name] = tuple(m["repeat"](text) for text in getattr(args, f.name) or ())
        elif m["switch"] is None:
            values[f.name] = getattr(args, f.name)
        elif getattr(args, m["flag"].removeprefix("--").replace("-", "_")):
            values.update(m["switch"])
    return EngineConfig(**{**values, **overrides})


# ---------------------------------------------------------------- docs/serving.md
def _flag_cell(f: dataclasses.Field) -> str:
    m = f.metadata
    cells = []
    for command in m["positional"]:
        cells.append(f"`{f.name.upper()}` ({command})")
    commands = [c for c in m["commands"] if c not in m["positional"]]
    if commands:
        sets = f" sets {str(m['switch'][f.name]).lower()}" if m["switch"] is not None else ""
        flag = f"{m['flag']} {m['metavar']}" if m["metavar"] else m["flag"]
        cells.append(f"`{flag}` ({', '.join(commands)}){sets}")
    return ", ".join(cells) or "Python only"


def reference_markdown() -> str:
    """The table of engine options in docs/serving.md, generated from EngineConfig's fields."""
    out = [DOCS_BEGIN, "", "| option | flag | default | meaning |", "|---|---|---|---|"]
    for f in fields(EngineConfig):
        out.append(f"| `{f.name}` | {_flag_cell(f)} | `{f.default!r}` | {f.metadata['help']} |")
    return "\n".join(out + ["", DOCS_END])


def docs_section(text: str) -> str | None:
    """The generated part of a document (its markers included), or None without one."""
    begin, end = text.find(DOCS_BEGIN), text.find(DOCS_END)
    if begin < 0 or end < begin:
        return None
    return text[begin:end + len(DOCS_END)]


def update_section(path: Path, begin: str, end: str, section: str) -> None:
    """Replace the part of a document between its lines `begin` and `end` (kept, and included
    in `section`) by `section`: the generated tables of docs/serving.md."""
    text = path.read_text()
    first, last = text.find(begin), text.find(end)
    if first < 0 or last < first:
        raise SystemExit(f"{path} has no line {begin!r} followed by {end!r}")
    path.write_text(text[:first] + section + text[last + len(end):])


def update_docs(path: Path) -> None:
    update_section(path, DOCS_BEGIN, DOCS_END, reference_markdown())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--update"] and len(sys.argv) == 3:
        update_docs(Path(sys.argv[2]))
    else:
        print(reference_markdown())
