"""Shared fixtures: the `duoka` command as a user runs it, tiny random Qwen2 checkpoints
written by transformers itself, and a small Qwen2-style tokenizer trained with
`tokenizers` (there is no model hub here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

# Before torch loads OpenMP, for this process and every process a test starts: a thread that
# waits at a barrier sleeps instead of spinning. Beside other CPU-bound processes (a loaded CI
# machine, a test's own server and client) spinning threads took the cores from the threads
# they waited for: in a loaded run the README's default run took 535 s of CPU (110 s with this),
# two 2-thread trainings at once 59 s instead of 20. Alone as fast (40 steps: 12.5 s, 12.6 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core, at most four. A worker's multi-process tests start up to
    four ranks and a server or Slurm of their own; beyond four workers memory, not cores, binds."""
    return max(1, min(4, os.cpu_count() or 1))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from duoka.cache import INDUCTOR_CACHE_ENV  # after ROOT: this checkout's duoka

TOKENIZER_TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we're testing 12345 numbers!",
    "Grouped-query attention shares each key/value head across several query heads.",
    "中文分词测试：你好，世界。多卡训练大模型。",
    "Émigré naïve café — ünïcödé, emoji 🙂🚀, tabs\tand\nnewlines\n\n  indented code:\n    return x",
    "def f(x):\n    return x ** 2  # a comment\n",
] * 40


class Cli:
    """`python -m duoka.cli ARGS` started from the repository root, as a user runs it."""

    root = ROOT

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT), **(extra or {})}

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "duoka.cli", *args]

    def __call__(self, *args: str, env: dict[str, str] | None = None, stdin: str | None = None,
                 timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args), capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                              input=stdin or "", env=self.env(env))

    def ok(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        """The command, which must succeed."""
        proc = self(*args, **kwargs)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    def popen(self, *args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(*args), cwd=ROOT, env=self.env(env), **kwargs)


@pytest.fixture(scope="session", autouse=True)
def own_cache_folder(tmp_path_factory):
    """duoka's cache folder (tokenized corpora, compiled artefacts; duoka.cache) for this
    session, inherited by every process a test starts: nothing lands in the user's. Inductor's
    cache is its torch-compile folder, where duoka itself would put it: every compile of the
    session (in this process, in a worker, in a server) reuses what an earlier one made, and
    none reads a warm /tmp/torchinductor_$USER that a clean CI machine would not have."""
    patch = pytest.MonkeyPatch()
    home = tmp_path_factory.mktemp("duoka-cache")
    patch.setenv("DUOKA_CACHE", str(home))
    patch.setenv(INDUCTOR_CACHE_ENV, str(home / "torch-compile"))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def duoka() -> Cli:
    """The `duoka` command: duoka(*args) runs it (stdout and stderr captured), duoka.ok(*args)
    also requires success, duoka.popen(*args) starts it; duoka.root is the repository."""
    return Cli()


@pytest.fixture(scope="session")
def compile_cache(own_cache_folder) -> Path:
    """The session's one torch.compile cache folder (own_cache_folder's), named to the
    compiled runs: their compile checks compile the same block once."""
    return Path(os.environ[INDUCTOR_CACHE_ENV])


@pytest.fixture(scope="session")
def compile_flags(compile_cache) -> tuple[str, ...]:
    """`duoka train` flags: training.compile on (auto is off on CPU), into compile_cache."""
    return ("--training.compile=true", f"--training.compile_cache={compile_cache}")


@pytest.fixture(scope="session")
def triton_interpreted():
    """triton_interpreted(script): runs a test module as a script under Triton's interpreter
    (TRITON_INTERPRET=1 must be set before Triton is imported: a process of its own), on the
    CPU, and returns the JSON its last line printed."""
    def run(script: str, timeout: int = 600):
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    return run


@pytest.fixture
def in_process(capsys):
    """in_process(*args): duoka.cli.main(args) in this process, as a CompletedProcess. For
    errors found before any worker starts or model loads (a Python start each costs 2-4 s)."""
    from duoka.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()  # what ran before (fixtures) is not the command's output
        # A launcher writes its workers' environment into its own (OMP_NUM_THREADS=1 for two
        # CPU ranks, the compile cache): kept, it would reach every later test's processes.
        with mock.patch.dict(os.environ):
            code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def hf_config(**overrides):
    from transformers import Qwen2Config

    base = dict(vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=True, attn_implementation="sdpa")
    base.update(overrides)
    return Qwen2Config(**base)


def make_hf_model(seed: int = 0, noise: float = 0.2, **overrides):
    """A transformers Qwen2ForCausalLM with every parameter perturbed away from its init
    (transformers starts biases at 0 and norms at 1, which would hide bugs there; and
    near-init random models decode one token over and over, which would prove little)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(hf_config(**overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return model


@pytest.fixture
def hf_folder(tmp_path):
    """Factory: write a random transformers Qwen2 to a folder; returns (hf_model, folder)."""

    def make(seed: int = 0, max_shard_size=None, **overrides):
        model = make_hf_model(seed, **overrides)
        folder = tmp_path / f"hf-{seed}-{len(list(tmp_path.iterdir()))}"
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(folder, **kwargs)
        return model, folder

    return make


@pytest.fixture(scope="session")
def saved_hf_model(tmp_path_factory):
    """Factory for module and session fixtures: saved_hf_model(**overrides) -> the folder of
    make_hf_model(**overrides), written once per session for each set of arguments."""
    made: dict[tuple, Path] = {}

    def make(**overrides) -> Path:
        key = tuple(sorted(overrides.items()))
        if key not in made:
            made[key] = tmp_path_factory.mktemp("hf-model")
            make_hf_model(**overrides).save_pretrained(made[key])
        return made[key]

    return make


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from duoka.data.tokenizer import train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(TOKENIZER_TEXTS, 600, folder)
    return folder


# Qwen2.5-Instruct's chat template (from Qwen/Qwen2.5-7B-Instruct's tokenizer_config.json,
# Apache-2.0): tools in the system prompt, tool calls and tool results in the Hermes format.
QWEN25_CHAT_TEMPLATE = ROOT / "tests" / "fixtures" / "qwen2_5_chat_template.jinja"


def use_qwen25_chat_template(folder: Path) -> Path:
    """Gives the model or tokenizer folder Qwen2.5-Instruct's chat template (in
    tokenizer_config.json, where the official model keeps it); returns the folder."""
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # it would win over the config's
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["chat_template"] = QWEN25_CHAT_TEMPLATE.read_text(encoding="utf-8")
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def qwen25_tokenizer_dir(tokenizer_dir, tmp_path_factory):
    """tokenizer_dir's tokenizer with Qwen2.5-Instruct's tools-capable chat template."""
    folder = tmp_path_factory.mktemp("tokenizer-qwen2.5")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return use_qwen25_chat_template(folder)


def _write_adapter(folder, args, rank, alpha, targets, rslora=False, seed=0, layers=None, extra=None):
    """A PEFT LoRA adapter folder for a model of `args`, with random A and B (B too: a fresh
    adapter's zero B would change nothing)."""
    from duoka.models.qwen2.multi_lora import MODULES
    from duoka.models.qwen2.peft import peft_name

    gen = torch.Generator().manual_seed(seed)
    hd = args.resolved_head_dim
    q, kv, dim, mlp = args.n_heads * hd, args.n_kv_heads * hd, args.dim, args.intermediate_size
    shapes = {"q_proj": (q, dim), "k_proj": (kv, dim), "v_proj": (kv, dim), "o_proj": (dim, q),
              "gate_proj": (mlp, dim), "up_proj": (mlp, dim), "down_proj": (dim, mlp)}
    tensors = {}
    for layer in range(args.n_layers) if layers is None else layers:
        for target in targets:
            out, inp = shapes[target]
            stem = f"layers.{layer}.{MODULES[target]}"
            tensors[peft_name(f"{stem}.lora_a.weight")] = torch.randn(rank, inp, generator=gen) * 0.3
            tensors[peft_name(f"{stem}.lora_b.weight")] = torch.randn(out, rank, generator=gen) * 0.3
    tensors.update(extra or {})
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(targets), "use_rslora": rslora, "base_model_name_or_path": "tiny"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def write_adapter():
    """_write_adapter: a random PEFT LoRA adapter folder for a model's ModelArgs."""
    return _write_adapter
