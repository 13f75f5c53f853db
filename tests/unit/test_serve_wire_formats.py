"""The server's own encodings: whole responses as JSON bytes (protocol.json_response, not
FastAPI's encoder) and prompt-logprob entries pickled between the engine process and the server."""

import json
import math
import pickle

import numpy as np
import pytest

from duoka.serve.api_logprobs import completion_logprobs, echoed, echoed_logprobs, joined
from duoka.serve.logprob_columns import EntryRows, PromptEntries, PromptLogprobColumns
from duoka.serve.params import TokenLogprob
from duoka.serve.protocol import LOGPROB_FLOOR, json_response


def test_a_response_body_reads_back_as_the_dict_json_dumps_writes():
    body = {"id": "cmpl-1", "choices": [{"index": 0, "text": "中文 é 🙂\n\"q\"\u2028", "finish_reason": None,
                                         "logprobs": {"tokens": ["a", "\ufffd"], "token_logprobs": [None, -1.25e-07],
                                                      "top_logprobs": [None, {"\ufffd": -3.0000001e-5}],
                                                      "text_offset": [0, 1]}}],
            "prompt_logprobs": [None, {151643: {"logprob": LOGPROB_FLOOR, "rank": 2, "decoded_token": "x"}}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}}
    response = json_response(body)
    assert response.media_type == "application/json"
    assert json.loads(response.body) == json.loads(json.dumps(body))  # int keys become strings in both
    assert "中文".encode() in response.body  # UTF-8, not \u escapes


def test_a_non_finite_float_is_null_not_invalid_json():
    assert json.loads(json_response({"x": [math.inf, -math.inf, math.nan]}).body) == {"x": [None, None, None]}


def test_token_logprobs_pickle_to_equal_entries():
    entries = [TokenLogprob(7, -0.5, [(7, -0.5), (3, -1.75)], 1), TokenLogprob(9, -2.0, [], None)]
    back = pickle.loads(pickle.dumps(entries))
    assert back == entries and all(type(e) is TokenLogprob for e in back)


def _prompt_entries(k: int) -> list:
    """[None, entries...] as the engine makes them, with a non-finite value and two ids of one name."""
    return [None, TokenLogprob(5, -0.25, [(5, -0.25), (6, -1.5), (7, -2.0)][:k], 1),
            TokenLogprob(6, -math.inf, [(5, -0.125), (7, -0.5), (6, -math.inf)][:k], 151_000),
            TokenLogprob(7, -3.0000001e-5, [(8, -1e-9), (5, -4.0), (7, -3.0000001e-5)][:k], 2)]


@pytest.mark.parametrize("k", [0, 1, 3])
def test_prompt_logprob_columns_read_as_the_entries_they_pack(k):
    entries = _prompt_entries(k)
    columns = PromptLogprobColumns.pack(entries)
    back = pickle.loads(pickle.dumps(columns))
    assert list(back) == entries and back == entries and len(back) == 4
    assert back[0] is None and back[-1] == entries[-1] and back[1:3] == entries[1:3]
    # The completions API's lists from the columns equal those written entry by entry (the
    # name function makes ids 5 and 8 one text: a later top entry overwrites, in both).
    prompt_ids = [9, 5, 6, 7]
    name = {5: "a", 6: "bb", 7: "\ufffd", 8: "a", 9: "Q"}.__getitem__
    assert echoed_logprobs(prompt_ids, back, name) == completion_logprobs(echoed(prompt_ids, entries), name, 0)
    generated = [(11, TokenLogprob(11, -0.5, [(11, -0.5)]))]
    name2 = {**{5: "a", 6: "bb", 7: "\ufffd", 8: "a", 9: "Q"}, 11: "end"}.__getitem__
    assert joined(echoed_logprobs(prompt_ids, back, name2), generated, name2) == \
        completion_logprobs(echoed(prompt_ids, entries) + generated, name2, 0)


def test_columns_refuse_what_is_not_a_prompts_entries():
    with pytest.raises(ValueError, match="first token alone"):
        PromptLogprobColumns.pack(_prompt_entries(1)[1:])


@pytest.mark.parametrize("k", [0, 1, 3])
def test_prompt_entries_gathered_in_pieces_read_as_the_entries(k):
    """The engine's accumulator (rows from steps and from cached blocks, any split, fp32
    values in float32 or float64 arrays) gives the columns of the same entries."""
    entries = _prompt_entries(k)[1:]

    def rows(part, float_type):
        return EntryRows(np.array([e.token_id for e in part]), np.array([e.logprob for e in part], float_type),
                         np.array([e.rank for e in part], np.int32),
                         np.array([[t for t, _ in e.top] for e in part], np.int64).reshape(len(part), k),
                         np.array([[v for _, v in e.top] for e in part], float_type).reshape(len(part), k))

    gathered = PromptEntries(len(entries), k)
    gathered.append(rows(entries[:1], np.float64))
    gathered.append(rows([], np.float64))  # a step with no row of this request's
    gathered.append(rows(entries[1:], np.float32))  # as a cached block holds them
    assert len(gathered) == 3 and gathered.entries()[2].logprob == np.float32(entries[2].logprob)
    want = [None, *entries[:2], TokenLogprob(7, float(np.float32(-3.0000001e-5)),
                                            [(t, float(np.float32(v))) for t, v in entries[2].top], 2)]
    assert list(gathered.columns()) == want and len(gathered.columns()) == 4
    assert list(PromptEntries(3, k).columns()) == [None] and list(PromptEntries(0, k).columns()) == [None]
    assert PromptEntries(0, k).rows(0, 0).top_ids.shape == (0, k)  # a block of one token: block 0 has no entry
    with pytest.raises(AssertionError):
        gathered.append(rows(entries[:1], np.float64))  # past the prompt's rows
