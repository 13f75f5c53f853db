"""`duoka train` end to end through the real CLI."""

import json


def assert_user_error(proc, *phrases):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error: " in proc.stderr and "\n  fix: " in proc.stderr
    for phrase in phrases:
        assert phrase in proc.stderr, proc.stderr


def test_resolved_config_is_reusable(duoka, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[training]\nsteps = 2\nseq_len = 32\nglobal_batch_size = 4\n[optimizer]\nlr = 0.001\n')
    run = tmp_path / "run"
    assert duoka("train", str(cfg), f"--job.output_dir={run}", "--optimizer.lr=0.002").returncode == 0
    saved = (run / "config.toml").read_text()
    assert "lr = 0.002" in saved and "steps = 2" in saved and f'output_dir = "{run}"' in saved
    rerun = duoka("train", str(run / "config.toml"), f"--job.output_dir={tmp_path / 'run2'}")
    assert rerun.returncode == 0, rerun.stderr[-2000:]


def test_config_errors_before_any_worker_starts(duoka, in_process, tmp_path):
    out = f"--job.output_dir={tmp_path / 'x'}"
    # One through a real process (exit code, no traceback), the rest through the same
    # entry point in this process (a Python start each would cost 4 s).
    assert_user_error(duoka("train", out, "--training.stpes=3"), "training.stpes", "training.steps")
    for args, phrases in [
        (["--nproc-per-node=2", "--parallel.dp_mode=fsdp", "--parallel.dp_replicate=3"],
         ["dp_replicate=3 does not divide the 2 data-parallel ranks"]),
        (["--nproc-per-node=2", "--training.global_batch_size=5"], ["5 / 2 = 2.5"]),
        (["--training.micro_batch_size=3"], ["16 / 1 ranks = 16"]),
        ([f"--data.path={tmp_path / 'none.jsonl'}"], ["does not exist"]),
        (["--model.flavor=qwen2-0.5b"], ["no tokenizer", "model.tokenizer"]),
        (["--gpus=0"], ["no GPU is visible"]),
        (["--training.seq_len=4096"], ["exceeds the model's 2048 positions"]),
    ]:
        assert_user_error(in_process("train", out, *args), *phrases)
    assert not (tmp_path / "x").exists()


def test_too_small_corpus(in_process, tmp_path):
    """Found by the launcher while it reads the corpus, before any worker starts: through
    the entry point in this process, as above."""
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text('{"text": "too short"}\n')
    assert_user_error(in_process("train", f"--job.output_dir={tmp_path / 'run'}", f"--data.path={tiny}"),
                      "fewer than one window", "training.seq_len")


def test_worker_errors_come_back_as_one_message(duoka, tmp_path):
    """A checkpoint whose tensor shapes do not match is found while the workers load it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from duoka.hub import bundled_model_dir

    model = tmp_path / "model"
    shutil.copytree(bundled_model_dir(), model)
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:7].clone()
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    proc = duoka("train", f"--job.output_dir={tmp_path / 'run'}", f"--model.path={model}", "--nproc-per-node=2",
                 "--training.steps=2")
    # Both ranks fail alike; whichever reports first stops the job, so the ranks named vary.
    assert_user_error(proc, "training stopped on rank(s) ", "model.norm.weight: checkpoint [7], model [192]")


def test_start_from_a_hugging_face_folder(duoka, tmp_path):
    """model.path: weights and tokenizer from an HF folder (here the bundled tiny model)."""
    from duoka.hub import bundled_model_dir

    run = tmp_path / "run"
    proc = duoka("train", f"--job.output_dir={run}", f"--model.path={bundled_model_dir()}", "--training.steps=3",
                 "--training.seq_len=64", "--optimizer.lr=1e-4", "--nproc-per-node=2", "--parallel.dp_mode=fsdp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first < 6.0  # a trained model starts far below ln(vocab) = 8.3


def test_busy_rendezvous_port(duoka, in_process, tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        single = duoka("train", f"--job.output_dir={tmp_path / 'one'}", "--nproc-per-node=2", "--training.steps=1",
                       f"--rdzv-endpoint=127.0.0.1:{port}", "--checkpoint.export_final=false")
        assert single.returncode == 0, single.stderr[-2000:]
        assert f"rendezvous port {port} is in use; using" in single.stderr
        # Refused before any worker starts: through the CLI's entry point in this process.
        multi = in_process("train", f"--job.output_dir={tmp_path / 'two'}", "--nnodes=2", "--node-rank=0",
                           "--nproc-per-node=1", f"--rdzv-endpoint=127.0.0.1:{port}")
        assert_user_error(multi, f"rendezvous port {port} on 127.0.0.1 is already in use", "pick another port")


def test_example_configs_are_valid(duoka):
    from duoka.config import load_config

    configs = sorted((duoka.root / "configs").glob("*.toml"))
    assert len(configs) >= 3
    for path in configs:
        load_config(path)
