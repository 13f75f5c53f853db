"""The server's own encodings: whole responses as JSON bytes (protocol.json_response, not
FastAPI's encoder) and prompt-logprob entries pickled between the engine process and the server."""

import json
import math
import pickle

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
