import json

import pytest
import torch

from duoka.data.dataset import split_batch
from duoka.data.sft import SFTWindows, encode_conversation, prepare_sft
from duoka.data.tokenizer import Tokenizer
from duoka.errors import DuokaError

CONV = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "six"}]

GENERATION_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DUOKA_CACHE", str(tmp_path / "cache"))


def targets_text(tok, ids, keep):
    return tok.decode([i for i, k in zip(ids, keep) if k])


def test_prompt_tokens_are_masked_chatml(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)  # Qwen2's ChatML template: no generation tags
    ids, keep = encode_conversation(tok, CONV)
    assert tok.decode(ids) == tok.apply_chat_template(CONV, tokenize=False)
    assert targets_text(tok, ids, keep) == "4<|im_end|>\nsix<|im_end|>\n"


def test_prompt_tokens_are_masked_with_generation_tags(tokenizer_dir, tmp_path):
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "chat_template.jinja").write_text(GENERATION_TEMPLATE)
    tok = Tokenizer(folder)
    ids, keep = encode_conversation(tok, CONV)
    assert targets_text(tok, ids, keep) == "4<|im_end|>six<|im_end|>"


def test_packing_truncation_and_drop(tokenizer_dir, tmp_path):
    tok = Tokenizer(tokenizer_dir)
    long_conv = [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"messages": m}) for m in [CONV, CONV, long_conv, CONV]) + "\n")
    seq = 192
    tokens, stats = prepare_sft(path, tok, seq, overlong="truncate")
    # The long conversation's only assistant turn lies beyond the window: truncated, then
    # skipped, as it has no target left (a window of such alone would divide by zero).
    assert (stats.conversations, stats.truncated, stats.dropped, stats.no_target) == (4, 1, 0, 1)
    data = SFTWindows(tokens)
    n_conv_tokens = len(encode_conversation(tok, CONV)[0]) + 1
    assert n_conv_tokens < seq + 1 < 3 * n_conv_tokens  # fits alone; three need two windows
    eot = tok.token_to_id("<|endoftext|>")
    per_window = [int((data[i][0] == eot).sum()) for i in range(len(data))]
    assert sum(min(c, 10) for c in per_window) >= 4  # every conversation ends with a separator
    _, stats_drop = prepare_sft(path, tok, seq, overlong="drop")
    assert (stats_drop.truncated, stats_drop.dropped) == (0, 1)

    batch = torch.stack([data[i] for i in range(len(data))])
    inputs, labels = split_batch(batch, -100)
    assert inputs.shape == labels.shape == (len(data), seq)
    assert int((labels != -100).sum()) == stats.target_tokens
    assert bool((labels != -100).any(dim=1).all())  # every window has targets
    assert not bool((labels == eot).any())  # separators and padding are never targets


def test_bad_sft_lines(tokenizer_dir, tmp_path):
    tok = Tokenizer(tokenizer_dir)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"conversation": CONV}) + "\n")
    with pytest.raises(DuokaError, match=r"bad.jsonl:1 has no list of messages in field 'messages'") as e:
        prepare_sft(path, tok, 64)
    assert "data.messages_field" in e.value.fix


def test_a_huge_conversation_is_encoded_only_as_far_as_its_window(tokenizer_dir, monkeypatch):
    """A conversation of megabytes is cut to its window anyway: only a prefix a little longer
    than the window is tokenized (the tokenizer holds ~200 bytes a character), with the same
    first tokens and targets as the whole."""
    tok = Tokenizer(tokenizer_dir)
    long_answer = "It's 12 words, café. " * 20_000
    conv = [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": long_answer}]
    whole_ids, whole_keep = encode_conversation(tok, conv)
    encoded = []
    plain = tok.encode_with_offsets
    monkeypatch.setattr(tok, "encode_with_offsets", lambda text: encoded.append(len(text)) or plain(text))
    ids, keep = encode_conversation(tok, conv, max_tokens=64)
    assert max(encoded) < 2_000 < len(whole_ids)
    assert ids[:65] == whole_ids[:65] and keep[:65] == whole_keep[:65]
