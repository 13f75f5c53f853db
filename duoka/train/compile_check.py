"""training.compile for this run: resolved for the device, then checked on every rank before
the model is built.

torch.compile is lazy: a compiler that fails on this machine (no C compiler for Triton's
launcher or Inductor's CPU kernels, a GPU too old for Triton, an unwritable cache folder)
fails at the first forward, inside the first step, where some ranks may already wait in
a collective that the failing rank will never join. So one small decoder block is
compiled and run forward and backward first, on the run's device, dtype and kernels, and
every rank shares its outcome: where any rank fails, all build the uncompiled model, and
rank 0 prints one warning naming the cause and the switch. A check that passed is
remembered in the compile cache folder (check_stamp), so the next launch of the same
configuration on the same software and device skips it (5-7 s on an H200).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from duoka.cache import INDUCTOR_CACHE_ENV
from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs, ModelOptions
from duoka.models.qwen2.model import TransformerBlock, document_mask
from duoka.models.qwen2.rope import rope_cos_sin

# The check's input: two rows of two documents each, long enough for every attention kernel.
CHECK_BATCH, CHECK_SEQ = 2, 64
CAUSE_CHARS = 240  # of the error's message in the one-line warning; the whole error goes to a file
# A model this narrow (the debug flavors) is checked with a block of its own size, a few hundred
# KB: the check's compiled graph is then the one its whole-block compiles (pipeline stages) find
# in the compile cache (a CPU pp2 run's first step: 27 -> 9 s after the check).
OWN_SIZE_MAX_DIM = 256


def compile_wanted(choice: bool | str, device: torch.device, ep: int = 1, cp: int = 1) -> bool:
    """training.compile: auto is on for CUDA, off on CPU (there compiling a step takes
    longer than the steps of a CPU-sized run save), under expert parallelism (its token
    dispatch reads the all-to-all's sizes on the host, which a block compiled as one graph
    cannot hold; check_moe_layout refuses compile=true with ep > 1) and under context
    parallelism (its gathered attention is checked eager on CPU only so far; true compiles it)."""
    return device.type == "cuda" and ep == 1 and cp == 1 if choice == "auto" else bool(choice)


def failing_ranks(text: str, world: int) -> set[int]:
    """debug.fail_compile_ranks: "" (none), "all", or comma-separated ranks."""
    if not text:
        return set()
    if text == "all":
        return set(range(world))
    try:
        ranks = {int(part) for part in text.split(",")}
    except ValueError:
        ranks = {-1}
    if not ranks <= set(range(world)):
        raise DuokaError(f"debug.fail_compile_ranks={text!r} names no ranks of this {world}-process job",
                         f'give ranks from 0 to {world - 1}, comma-separated (e.g. "1"), or "all"')
    return ranks


def check_args(args: ModelArgs) -> ModelArgs:
    """A block with the model's attention shape (head width, query heads per KV head) and a
    single KV head: the same kernels as the model's blocks, at a size any device holds (a
    model of width OWN_SIZE_MAX_DIM or less: its own block)."""
    if args.dim <= OWN_SIZE_MAX_DIM:
        return args
    ratio, head_dim = args.n_heads // args.n_kv_heads, args.resolved_head_dim
    return args.replace(n_heads=ratio, n_kv_heads=1, head_dim=head_dim, dim=ratio * head_dim,
                        intermediate_size=2 * ratio * head_dim)


def _block_step(block: TransformerBlock, x: torch.Tensor, rope, mask) -> torch.Tensor:
    # A function of its own: dynamo caches graphs per code object, so the check's graph
    # never sits in the cache of the model's own compiled bodies (whose sizes it would vary).
    return block(x, rope, mask)


def _injected_failure(gm, example_inputs):
    """A torch.compile backend that fails as a broken compiler would (debug.fail_compile_ranks)."""
    raise RuntimeError("compiler failure injected by debug.fail_compile_ranks")


def check_compile(args: ModelArgs, options: ModelOptions, param_dtype: torch.dtype,
                  autocast_dtype: torch.dtype | None, device: torch.device, documents: bool,
                  inject_failure: bool = False) -> BaseException | None:
    """Compile one block (check_args) with `options`' kernels as one fullgraph region and
    run its forward and backward on `device`, with parameters in `param_dtype` under
    autocast to `autocast_dtype` (None: none) as the training step runs them, and the
    document mask when `documents`. Returns what failed, None when it all worked."""
    small = check_args(args)
    gen = torch.Generator(device=device).manual_seed(0)  # the training's random streams stay untouched
    try:
        with torch.device(device):
            # A MoE model's sparse block when it has one: the kernels the check must compile.
            layer = small.moe_layers[0] if small.moe_layers else 0
            block = TransformerBlock(small, options.replace(compile="none", compile_loss=False), layer)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, small.initializer_range, generator=gen)
        block.to(param_dtype)
        x = torch.randn(CHECK_BATCH, CHECK_SEQ, small.dim, device=device, generator=gen).to(param_dtype)
        x.requires_grad_(True)
        positions = torch.arange(CHECK_SEQ, device=device)
        mask = None
        if documents:
            ids = (positions >= CHECK_SEQ // 2).long().expand(CHECK_BATCH, CHECK_SEQ)
            positions = positions % (CHECK_SEQ // 2)
            mask = document_mask(ids, options.document_masking)
        rope = rope_cos_sin(positions, small.resolved_head_dim, small.rope_theta, x.dtype)
        step = torch.compile(_block_step, fullgraph=True, dynamic=False,
                             backend=_injected_failure if inject_failure else "inductor")
        autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with autocast:
            out = step(block, x, rope, mask)
        out.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a kernel that cannot run on this GPU fails at launch
    except Exception as e:  # whatever the compiler raises, from any of its stages
        return e
    return None


def check_stamp(args: ModelArgs, options: ModelOptions, param_dtype: torch.dtype,
                autocast_dtype: torch.dtype | None, device: torch.device, documents: bool) -> Path | None:
    """The file that records a passed check, in the compile cache folder (None without one),
    named by everything the check's outcome depends on: the block's shape and kernels, the
    dtypes, the torch, CUDA and Triton versions, the device (or the C++ compiler Inductor's
    CPU kernels need) and the source of the compiled code. Any change makes a new name, so
    the check runs again."""
    folder = os.environ.get(INDUCTOR_CACHE_ENV)
    if not folder:
        return None
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    where = ((torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)) if device.type == "cuda"
             else (device.type, os.environ.get("CXX"), shutil.which("g++"), shutil.which("c++")))
    code = [hashlib.sha256(Path(sys.modules[name].__file__).read_bytes()).hexdigest()
            for name in (__name__, TransformerBlock.__module__, "duoka.models.qwen2.moe")]
    facts = (torch.__version__, torch.version.cuda, triton, where, repr(check_args(args)), repr(options),
             str(param_dtype), str(autocast_dtype), documents, code)
    return Path(folder) / "duoka-compile-checks" / (hashlib.sha256(repr(facts).encode()).hexdigest()[:32] + ".ok")


def describe(error: BaseException) -> str:
    """The error on one line, cut to CAUSE_CHARS: the backend's own error rather than
    torch's wrapper of it (BackendCompilerFailed keeps it as inner_exception)."""
    inner = getattr(error, "inner_exception", None)
    shown = inner if isinstance(inner, BaseException) else error
    text = " ".join(str(shown).split())
    text = text if len(text) <= CAUSE_CHARS else text[:CAUSE_CHARS - 3] + "..."
    return f"{type(shown).__name__}: {text}" if text else type(shown).__name__


def error_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"compile-error-rank{rank}.txt"


def agree_to_compile(check, rank: int, world: int, run_dir: str | Path, console, stamp: Path | None = None) -> bool:
    """Run `check` (a check_compile call) on this rank and decide with every other rank:
    True if it worked everywhere. Every rank takes part in the one all_gather, whatever its
    own outcome, so all build the same model and issue the same collectives from here on.
    A failing rank writes its whole error to compile-error-rank<R>.txt in the run
    directory; rank 0 prints one warning naming the first failure and the switch. A rank
    whose `stamp` (check_stamp) exists skips `check`; a check passed on every rank leaves it."""
    path = error_path(run_dir, rank)
    path.unlink(missing_ok=True)  # an earlier run's
    started = time.perf_counter()
    remembered = stamp is not None and stamp.exists()
    error = None if remembered else check()
    seconds = time.perf_counter() - started
    if error is not None:
        with contextlib.suppress(OSError):  # the warning still names the cause
            path.write_text("".join(traceback.format_exception(error)))
    outcomes: list = [None] * world
    dist.all_gather_object(outcomes, (describe(error) if error is not None else None, remembered))
    failed = [(r, cause) for r, (cause, _) in enumerate(outcomes) if cause is not None]
    if not failed:
        if all(skipped for _, skipped in outcomes):
            console.print(f"compile check: passed before with this configuration, skipped ({stamp.parent})")
        else:
            console.print(f"compile check: a decoder block compiled in {seconds:.1f} s")
        if stamp is not None and not remembered:
            with contextlib.suppress(OSError):  # an unwritable cache only means checking again next time
                stamp.parent.mkdir(parents=True, exist_ok=True)
                stamp.touch()
        return True
    first, cause = failed[0]
    where = f"rank {first}" if len(failed) == 1 else f"ranks {', '.join(str(r) for r, _ in failed)}"
    console.warning(f"torch.compile failed on {where} ({cause}; whole error in {error_path(run_dir, first)}), so "
                    "every rank trains uncompiled, which is slower: fix the cause, or set "
                    "--training.compile=false to skip compiling")
    return False
