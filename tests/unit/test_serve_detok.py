"""IncrementalDetokenizer: split UTF-8 characters never leak, the streamed text equals one
decode of the output, stop strings are cut across token boundaries, and the work per token
stays bounded (a window of recent ids, not the whole output)."""

import random

import pytest

from duoka.data.tokenizer import Tokenizer, load_tokenizer
from duoka.hub import bundled_model_dir
from duoka.serve.detok import WINDOW_IDS, IncrementalDetokenizer

TEXT = "多卡训练大模型 on 8 GPUs 🙂🚀: 你好，世界。Émigré naïve café 龘🦀 done."


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return load_tokenizer(bundled_model_dir())


@pytest.fixture(scope="module")
def small(tokenizer_dir) -> Tokenizer:
    """600-entry byte-level BPE whose merges cross character boundaries ('中' + a byte of '文')."""
    return Tokenizer(tokenizer_dir)


def stream(tok, prompt_ids, output_ids, stop=(), chunk=1):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=stop)
    pieces = []
    for i in range(0, len(output_ids), chunk):
        text, matched = detok.push(output_ids[i:i + chunk])
        pieces.append(text)
        if matched is not None:
            return pieces, matched
    pieces.append(detok.flush())
    return pieces, None


@pytest.mark.parametrize("which", ["tiny", "small"])
def test_split_characters_never_appear_broken(which, tiny, small):
    tok = tiny if which == "tiny" else small
    ids = tok.encode(TEXT, add_special_tokens=False)
    # Not vacuous: some single tokens decode to a broken character on their own.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    prompt = tok.encode("Say it:", add_special_tokens=False)
    for chunk in (1, 2, 3):
        pieces, _ = stream(tok, prompt, ids, chunk=chunk)
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == TEXT


def test_merges_across_character_boundaries(small):
    # '中文' is two tokens here, the first ending in half of '文': '中' must come out at once.
    ids = small.encode("中文", add_special_tokens=False)
    assert len(ids) == 2 and small.decode(ids[:1]) == "中\ufffd"
    detok = IncrementalDetokenizer(small, small.encode("x", add_special_tokens=False))
    assert detok.push(ids[:1]) == ("中", None)
    assert detok.push(ids[1:]) == ("文", None)


@pytest.mark.parametrize("which", ["tiny", "small"])
def test_concatenation_equals_one_decode_of_random_ids(which, tiny, small):
    tok = tiny if which == "tiny" else small
    rng = random.Random(0)
    prompt = tok.encode("The prompt ends here.", add_special_tokens=False)
    for trial in range(60):
        # Any id, special tokens included (skipped in both), in runs long enough to cut the
        # window; every other trial from the low ids (single bytes, many incomplete characters).
        high = tok.vocab_size if trial % 2 else 300
        output = [rng.randrange(high) for _ in range(rng.randrange(1, 80))]
        pieces, _ = stream(tok, prompt, output, chunk=rng.choice([1, 1, 2, 5]))
        assert "".join(pieces) == tok.decode(output, skip_special_tokens=True), (trial, output)


def test_first_token_is_decoded_as_a_continuation(tiny):
    prompt = tiny.encode("Hello", add_special_tokens=False)
    output = tiny.encode(" world, again", add_special_tokens=False)
    pieces, _ = stream(tiny, prompt, output)
    assert pieces[0].startswith(" ") and "".join(pieces) == " world, again"


def test_special_tokens_are_skipped(tiny):
    end = tiny.token_to_id("<|im_end|>")
    ids = tiny.encode("ok", add_special_tokens=False) + [end]
    assert "".join(stream(tiny, [], ids)[0]) == "ok"
    detok = IncrementalDetokenizer(tiny, [], skip_special_tokens=False)
    assert detok.push(ids)[0] + detok.flush() == "ok<|im_end|>"


def test_stop_string_across_token_boundaries(small):
    text = "Hello world. The end is near."
    ids = small.encode(text, add_special_tokens=False)
    stop = "d. Th"
    pieces, matched = stream(small, [], ids, stop=(stop,))
    assert matched == stop and "".join(pieces) == "Hello worl"
    # Nothing emitted before the match was taken back: every piece is part of the answer.
    assert "Hello worl".startswith("".join(pieces[:-1]))


def test_stop_string_spanning_a_split_character(small):
    text = "abc 中文 def"
    ids = small.encode(text, add_special_tokens=False)
    pieces, matched = stream(small, [], ids, stop=("文 d",))
    assert matched == "文 d" and "".join(pieces) == "abc 中"


def test_stop_string_at_the_very_start(tiny):
    ids = tiny.encode("STOP and more text", add_special_tokens=False)
    pieces, matched = stream(tiny, tiny.encode("go", add_special_tokens=False), ids, stop=("STOP",))
    assert matched == "STOP" and "".join(pieces) == ""


def test_earliest_stop_string_wins_and_text_is_held_back_only_while_it_may_match(tiny):
    detok = IncrementalDetokenizer(tiny, [], stop=("xyz", "lo w"))
    enc = lambda s: tiny.encode(s, add_special_tokens=False)
    assert detok.push(enc("abc")) == ("abc", None)  # no tail could start a stop string
    assert detok.push(enc(" hel")) == (" he", None)  # "l" may start "lo w"
    assert detok.push(enc("lo"))[0] == "l"  # "lo" may still grow into it
    assert detok.push(enc(" wxyz")) == ("", "lo w")  # both match; "lo w" starts first


def test_flush_returns_held_text(tiny):
    detok = IncrementalDetokenizer(tiny, [], stop=("the end",))
    assert detok.push(tiny.encode("to the", add_special_tokens=False)) == ("to ", None)
    assert detok.flush() == "the"


def test_flush_shows_a_trailing_incomplete_character(small):
    ids = small.encode("中文", add_special_tokens=False)
    detok = IncrementalDetokenizer(small, [])
    assert detok.push(ids[:1]) == ("中", None)
    assert detok.flush() == "\ufffd"  # as tokenizer.decode shows the cut-off bytes


class CountingTokenizer:
    """A tokenizer that records how many ids each decode is given."""

    def __init__(self, tok):
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_is_bounded(tiny):
    ids = tiny.encode((TEXT + " ") * 60, add_special_tokens=False)
    assert len(ids) > 1500
    counting = CountingTokenizer(tiny)
    detok = IncrementalDetokenizer(counting, list(range(100, 200)))
    out = "".join(detok.push([i])[0] for i in ids) + detok.flush()
    assert out == tiny.decode(ids)
    # Never a decode of the whole output, and a bounded number of decodes per token.
    assert max(counting.lengths) <= WINDOW_IDS + 1
    assert len(counting.lengths) <= 1.2 * len(ids)
