"""The out-of-memory report names only the remedies a run has not taken, and `duoka doctor`
still reads it."""

import torch

from duoka.config import load_config
from duoka.doctor.diagnose import explain
from duoka.train.oom_advice import oom_cause, oom_fix

TORCH_OOM = torch.OutOfMemoryError(
    "CUDA out of memory. Tried to allocate 18.56 GiB. GPU 0 has a total capacity of 79.18 GiB of which 11.49 GiB "
    "is free.")


def test_a_long_sequence_with_every_lever_pulled_is_pointed_at_context_parallelism():
    cfg = load_config(None, ["--model.flavor=qwen2-7b", "--training.seq_len=98304", "--training.micro_batch_size=1",
                             "--training.global_batch_size=1", "--training.activation_checkpointing=full",
                             "--training.fused_loss=true", "--parallel.dp_mode=fsdp", "--optimizer.name=sgd"])
    cause, fix = oom_cause(cfg, 0, TORCH_OOM), oom_fix(cfg, 1)
    assert cause == "CUDA out of memory on rank 0 (micro-batch 1, seq_len 98304): it tried to allocate 18.56 GiB more"
    for taken in ("micro_batch_size", "activation_checkpointing", "fused_loss", "dp_mode=fsdp;", "adamw8bit"):
        assert taken not in fix, fix
    assert "one sequence of 98304 tokens is what does not fit: split it over GPUs with parallel.cp=2" in fix
    assert "duoka plan --model qwen2-7b --seq 98304" in fix
    cp4 = load_config(None, ["--training.micro_batch_size=1", "--training.activation_checkpointing=full",
                             "--parallel.cp=4"])
    assert "raise parallel.cp above 4" in oom_fix(cp4, 8)


def test_a_default_run_hears_every_remedy_and_no_context_parallelism():
    cfg = load_config(None, ["--training.micro_batch_size=8", "--training.global_batch_size=16"])
    fix = oom_fix(cfg, 2)
    for remedy in ("lower training.micro_batch_size", "training.activation_checkpointing=full",
                   "training.fused_loss=true", "parallel.dp_mode=fsdp", "optimizer.name=adamw8bit"):
        assert remedy in fix, fix
    assert "parallel.cp" not in fix
    assert "parallel.dp_mode" not in oom_fix(cfg, 1)  # FSDP2 over one GPU shards nothing


def test_the_doctor_reads_the_report():
    cfg = load_config(None, ["--training.micro_batch_size=1", "--training.seq_len=4096"])
    log = f"error: training stopped on rank(s) 3: {oom_cause(cfg, 3, TORCH_OOM)}\n  fix: {oom_fix(cfg, 4)}\n"
    [diagnosis] = explain(log)
    assert diagnosis.kind == "cuda_oom"
    assert diagnosis.cause.startswith("rank 3 ran out of GPU memory") and "micro-batch 1, seq_len 4096" in diagnosis.cause
