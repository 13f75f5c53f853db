"""training.compile: auto resolved per device, the compile check that catches a compiler
failing on this machine, and the folder compiled artefacts are kept in. (The check and the
fallback in a real two-rank run: tests/distributed/test_layouts.py; compiled tp and pp:
test_model_parallel.py; the cache across launches: tests/integration/test_cli_train.py.)"""

import os

import pytest
import torch
import torch.distributed as dist

from duoka.cache import INDUCTOR_CACHE_ENV, compile_cache_env
from duoka.errors import DuokaError
from duoka.models.qwen2.args import FLAVORS, ModelOptions
from duoka.train.compile_check import (
    CAUSE_CHARS,
    agree_to_compile,
    check_args,
    check_compile,
    check_stamp,
    compile_wanted,
    describe,
    failing_ranks,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_compiles_on_cuda_only_and_true_false_are_kept():
    assert compile_wanted("auto", CUDA) and not compile_wanted("auto", CPU)
    assert compile_wanted(True, CPU) and compile_wanted(True, CUDA)
    assert not compile_wanted(False, CUDA)


def test_the_cache_folder_is_the_users_unless_set(tmp_path, monkeypatch):
    for name in ("DUOKA_CACHE", "XDG_CACHE_HOME", INDUCTOR_CACHE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache_env() == {INDUCTOR_CACHE_ENV: str(tmp_path / "home" / ".cache" / "duoka" / "torch-compile")}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_env() == {INDUCTOR_CACHE_ENV: str(tmp_path / "xdg" / "duoka" / "torch-compile")}
    monkeypatch.setenv("DUOKA_CACHE", str(tmp_path / "duoka"))
    assert compile_cache_env() == {INDUCTOR_CACHE_ENV: str(tmp_path / "duoka" / "torch-compile")}
    # A folder the user gave torch is left alone; training.compile_cache wins over both.
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert compile_cache_env() == {}
    assert compile_cache_env(str(tmp_path / "key")) == {INDUCTOR_CACHE_ENV: str(tmp_path / "key")}


def test_failing_ranks_names_ranks_of_the_job():
    assert failing_ranks("", 4) == set() and failing_ranks("all", 2) == {0, 1} and failing_ranks("1,3", 4) == {1, 3}
    for bad in ("4", "one", "1;2"):
        with pytest.raises(DuokaError, match="names no ranks of this 4-process job"):
            failing_ranks(bad, 4)


def test_the_check_keeps_the_models_attention_shape():
    for flavor in ("debug", "qwen2-7b", "qwen2-72b"):
        args, small = FLAVORS[flavor], check_args(FLAVORS[flavor])
        assert small.resolved_head_dim == args.resolved_head_dim
        assert small.n_heads // small.n_kv_heads == args.n_heads // args.n_kv_heads
        assert small.dim <= 1024  # a block of a few MB whatever the model
    # The debug model's own block: its compiled graph is the one the model's blocks then reuse.
    assert check_args(FLAVORS["debug"]) == FLAVORS["debug"] and check_args(FLAVORS["qwen2-7b"]).n_kv_heads == 1


def test_a_missing_compiler_is_caught_and_named(tmp_path, monkeypatch):
    """What a machine without a C++ compiler does to Inductor's CPU kernels (a fresh cache
    folder: a cached graph would need no compiler)."""
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "cache"))
    with torch._inductor.config.patch({"cpp.cxx": (None, "/nonexistent/c++")}):
        error = check_compile(FLAVORS["debug"], ModelOptions(), torch.float32, None, CPU, documents=True)
    assert error is not None
    cause = describe(error)
    assert cause.startswith("InvalidCxxCompiler: ") and "/nonexistent/c++" in cause and "\n" not in cause


def test_an_injected_failure_fails_in_the_compiler():
    error = check_compile(FLAVORS["debug"], ModelOptions(), torch.float32, None, CPU, documents=False,
                          inject_failure=True)
    assert type(error).__name__ == "BackendCompilerFailed"  # raised where a real backend's error is
    assert describe(error) == "RuntimeError: compiler failure injected by debug.fail_compile_ranks"


def test_describe_is_one_line_of_bounded_length():
    text = describe(ValueError("first line\n" + "x" * 1000))
    assert "\n" not in text and len(text) <= len("ValueError: ") + CAUSE_CHARS and text.endswith("...")


class Console:
    def __init__(self):
        self.lines = []

    def print(self, text):
        self.lines.append(text)

    warning = print


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_passed_check_is_remembered_until_what_it_depends_on_changes(tmp_path, monkeypatch, one_rank_group):
    """The second launch of a configuration skips the check; another configuration, torch or
    device gets a stamp of its own; a failed check leaves none."""
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "cache"))
    args = FLAVORS["debug"]
    stamp = check_stamp(args, ModelOptions(), torch.float32, None, CPU, documents=False)
    assert stamp.parent == tmp_path / "cache" / "duoka-compile-checks" and not stamp.exists()
    assert check_stamp(args, ModelOptions(), torch.float32, None, CPU, documents=True) != stamp
    assert check_stamp(args, ModelOptions(), torch.float32, torch.bfloat16, CPU, documents=False) != stamp
    assert check_stamp(FLAVORS["qwen2-7b"], ModelOptions(), torch.float32, None, CPU, documents=False) != stamp
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert check_stamp(args, ModelOptions(), torch.float32, None, CPU, documents=False) != stamp
    monkeypatch.undo()
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "cache"))

    calls, console = [], Console()

    def check(error=None):
        calls.append(error)
        return error

    assert not agree_to_compile(lambda: check(RuntimeError("broken")), 0, 1, tmp_path, console, stamp)
    assert not stamp.exists() and len(calls) == 1
    assert agree_to_compile(check, 0, 1, tmp_path, console, stamp) and stamp.exists() and len(calls) == 2
    assert agree_to_compile(check, 0, 1, tmp_path, console, stamp) and len(calls) == 2  # skipped
    assert console.lines[-1].startswith("compile check: passed before with this configuration, skipped")
    monkeypatch.delenv(INDUCTOR_CACHE_ENV)
    assert check_stamp(args, ModelOptions(), torch.float32, None, CPU, documents=False) is None


def test_generate_and_serve_compile_into_the_users_cache_unless_told(tmp_path, monkeypatch):
    from duoka import cli

    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setenv("DUOKA_CACHE", str(tmp_path / "duoka"))
    cli.use_compile_cache()
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "duoka" / "torch-compile")
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    cli.use_compile_cache()
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "mine")
