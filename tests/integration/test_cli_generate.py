"""`duoka generate` end to end, as a user runs it (a subprocess, real stdout/stderr). The
errors found before any model loads run through the same entry point in this process
(a Python start each would cost 2 s); one error still goes through a real process."""

import shutil

import pytest
import torch


def assert_user_error(proc, *phrases):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and "\n  fix: " in proc.stderr
    for phrase in phrases:
        assert phrase in proc.stderr
    assert proc.stdout == ""


def test_default_run_uses_the_bundled_model(duoka):
    proc = duoka("generate", "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) > 10
    assert "duoka:" not in proc.stdout  # logs never mix into the generated text
    assert "loaded" in proc.stderr and "tokens/s" in proc.stderr


def test_chat_mode_and_stdin_prompt(duoka):
    proc = duoka("generate", "--chat", "--max-new-tokens", "16", stdin="What does a list do?")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


@pytest.fixture
def model_with_tokenizer(hf_folder, tokenizer_dir):
    hf, folder = hf_folder(seed=3, vocab_size=600)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return hf, folder


def test_greedy_text_equals_transformers(duoka, model_with_tokenizer):
    from transformers import AutoTokenizer

    hf, folder = model_with_tokenizer
    prompt = "The quick brown fox"
    proc = duoka("generate", "--model", str(folder), "--prompt", prompt, "--max-new-tokens", "20")
    assert proc.returncode == 0, proc.stderr

    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok.encode(prompt)])
    out = hf.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
    assert proc.stdout == tok.decode(out, skip_special_tokens=True) + "\n"


def test_sampling_flags_and_seed(duoka, model_with_tokenizer):
    _, folder = model_with_tokenizer
    args = ("generate", "--model", str(folder), "--prompt", "hello", "--max-new-tokens", "12",
            "--temperature", "0.9", "--top-p", "0.9", "--top-k", "50", "--seed", "7")
    first, second = duoka(*args), duoka(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


def test_hub_id_resolves_from_an_offline_cache(duoka, model_with_tokenizer, tmp_path):
    _, folder = model_with_tokenizer
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--duoka-test--tiny-qwen2"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}

    proc = duoka("generate", "--model", "duoka-test/tiny-qwen2", "--prompt", "hi", "--max-new-tokens", "5", env=env)
    assert proc.returncode == 0, proc.stderr
    assert str(repo / "snapshots" / commit) in proc.stderr

    missing = duoka("generate", "--model", "duoka-test/not-cached", "--prompt", "hi", env=env)
    assert_user_error(missing, "duoka-test/not-cached", "Hugging Face cache")
    # huggingface_hub 2.x ships only `hf`; the older command is named for releases before 0.34.
    assert "`hf download duoka-test/not-cached`" in missing.stderr.split("fix:")[1], missing.stderr


def test_missing_model_folder_is_a_clear_error(in_process, tmp_path):
    assert_user_error(in_process("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x"), "does not exist")


def test_folder_without_tokenizer(in_process, hf_folder):
    _, folder = hf_folder()
    assert_user_error(in_process("generate", "--model", str(folder), "--prompt", "x"), "tokenizer.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_requested_without_gpu(in_process):
    assert_user_error(in_process("generate", "--device", "cuda", "--prompt", "x"), "no GPU")


def test_bad_sampling_value(in_process):
    assert_user_error(in_process("generate", "--top-p", "2", "--prompt", "x"), "top_p")


def test_no_subcommand_prints_help(duoka):
    proc = duoka()
    assert proc.returncode == 2 and "generate" in proc.stderr
