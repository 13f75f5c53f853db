"""What a request asks of the engine (SamplingParams) and what it gets back per step.

SamplingParams follows OpenAI's semantics and ranges, so the HTTP layer can pass a
request's fields straight through; every check raises DuokaError naming the field, the
value and the valid range (the API turns it into a 400). The dataclass is frozen:
`dataclasses.replace` re-runs the checks, so defaults from generation_config.json are
merged the same way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from duoka.errors import DuokaError

# OpenAI's limit on top_logprobs; the sampler's top-k over the vocabulary is sized by it.
MAX_LOGPROBS = 20
# JSON has no -inf; a token the model rules out entirely gets vLLM's stand-in value.
LOGPROB_FLOOR = -9999.0
# OpenAI allows 4 stop strings. More are accepted here (prompt formats often need several),
# but not without bound: every stop string is searched in every step's new text of its
# request, and the longest one sets how much text is held back from the stream.
MAX_STOP_STRINGS = 16
# OpenAI's range for both penalties.
PENALTY_RANGE = (-2.0, 2.0)
# The sampler hashes the seed as a 64-bit integer; vLLM accepts the same range.
SEED_RANGE = (-(2**63), 2**63 - 1)
# OpenAI's range for a logit_bias value: -100 bans a token in practice, +100 forces it.
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# OpenAI allows 300 logit_bias entries. A few more are accepted (a word and its variants in a
# large vocabulary add up), but not without bound: every entry goes to the device in every
# step the request samples in, and is checked against the vocabulary at admission.
MAX_LOGIT_BIAS = 1024
# What a structured output constrains the text to: any JSON object, JSON that a schema
# describes, the language of an EBNF grammar, or one Hermes tool call whose object the schema
# describes (serve.structured.TOOL_CALL_PREFIX, the object, TOOL_CALL_SUFFIX).
STRUCTURED_KINDS = ("json_object", "json_schema", "ebnf", "tool_call")
_DECIMAL = re.compile(r"-?[0-9]+")  # ASCII only: str.isdecimal() would take other scripts' digits


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output's text; the grammar is compiled by the engine, not here, so
    only the kind and the types are checked."""

    kind: str
    """One of STRUCTURED_KINDS."""
    spec: str
    """The JSON schema's text (json_schema, tool_call), the EBNF grammar's text (ebnf), "" (json_object)."""
    name: str = ""
    """What the request calls it (a json_schema's name), for error messages."""

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise DuokaError(f"structured output kind={self.kind!r} must be one of {', '.join(STRUCTURED_KINDS)}",
                             'e.g. kind="json_schema" with the schema as spec')
        for field in ("spec", "name"):
            if not isinstance(getattr(self, field), str):
                raise DuokaError(f"structured output {field}={getattr(self, field)!r} must be a string",
                                 f"give the {field} as text")
        if self.kind == "json_object" and self.spec:
            raise DuokaError(f"structured output kind=json_object takes no spec (got {len(self.spec)} characters)",
                             'leave spec empty, or use kind="json_schema" to give a schema')
        if self.kind != "json_object" and not self.spec.strip():
            raise DuokaError(f"structured output kind={self.kind} needs a spec (the {self.kind} text); it is empty",
                             "give the schema or grammar as spec")


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs: from a dict (JSON's keys are strings) or
    from pairs (what this function returns, so dataclasses.replace re-checks it unchanged)."""
    if value is None:
        return ()
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (tuple, list)) and all(isinstance(e, (tuple, list)) and len(e) == 2 for e in value):
        items = [tuple(e) for e in value]
    else:
        raise DuokaError(f"logit_bias={value!r} must be a map from token id to bias",
                         'e.g. logit_bias={"50256": -100}')
    if len(items) > MAX_LOGIT_BIAS:
        raise DuokaError(f"logit_bias has {len(items)} entries; at most {MAX_LOGIT_BIAS} are accepted "
                         "(each goes to the device in every step)", "keep the entries that matter")
    low, high = LOGIT_BIAS_RANGE
    pairs = {}
    for key, bias in items:
        if isinstance(key, str) and _DECIMAL.fullmatch(key.strip()):
            token = int(key)
        elif _is_int(key):
            token = key
        else:
            raise DuokaError(f"logit_bias key {key!r} must be a token id (an integer)",
                             'give token ids as keys, e.g. {"50256": -100}')
        if token < 0:
            raise DuokaError(f"logit_bias key {key!r} is a negative token id", "token ids are >= 0")
        if token in pairs:
            raise DuokaError(f"logit_bias names token id {token} twice", "give each token id once")
        # `nan <= x` is False, so the range test rejects NaN as well as +-inf.
        if not _is_number(bias) or not low <= bias <= high:
            raise DuokaError(f"logit_bias[{token}]={bias!r} must be a number in [{low:g}, {high:g}]",
                             "use -100 to ban a token, +100 to force it, or a value between")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    """How many tokens to generate at most (>= 0; 0: the prompt is computed and nothing is
    generated, for its prompt_logprobs: scoring)."""
    temperature: float = 1.0
    """Finite, >= 0; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose mass reaches top_p; (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1, stored as 0) = off."""
    seed: int | None = None
    """None: the engine draws one at admission. Same seed, same tokens whatever the batch."""
    stop: tuple[str, ...] = ()
    """Stop strings; the output text ends before the first one found (not included)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop ids; the model's eos ids are added by the engine unless ignore_eos."""
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: off; k >= 0: the sampled token's logprob and the k most likely alternatives."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """vLLM's and transformers': a token that occurs in the prompt or the output so far has
    its logit divided by it if positive, multiplied if not; > 0, 1 = off."""
    min_p: float = 0.0
    """After temperature, drop the tokens less likely than min_p times the most likely; [0, 1], 0 = off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI's map token id -> bias in [-100, 100], added to the raw logits. Given as a dict
    (int or decimal-string keys), stored as sorted (id, bias) pairs so the params stay hashable."""
    min_tokens: int = 0
    """Until this many tokens are generated, the stop token ids (eos unless ignore_eos, and
    stop_token_ids) cannot be sampled; [0, max_tokens]."""
    structured: StructuredOutput | None = None
    """A constraint on the text (JSON, a JSON schema, a grammar); None = free text."""
    prompt_logprobs: int | None = None
    """None: off; k >= 0: every prompt token's logprob after the tokens before it (the first
    token has none) and the k most likely tokens at its place, from the prefill's own logits
    (fp32 log-softmax of the model's raw logits). Such a prompt reads from the prefix cache only
    blocks that carry the entries of an earlier scoring request of at least this k
    (serve.logprob_cache); it computes the rest."""

    def __post_init__(self):
        # Lists are accepted (JSON has no tuples) and stored as tuples so the params stay
        # hashable; a single string is one stop string, not one per character.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) for s in stop):
            raise DuokaError(f"stop={self.stop!r} must be a string or a list of strings",
                             'e.g. stop=["\\n\\n"]; leave it empty for no stop strings')
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(_is_int(i) for i in self.stop_token_ids):
            raise DuokaError(f"stop_token_ids={self.stop_token_ids!r} must be a list of integers",
                             "give token ids, e.g. [151645]")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:  # vLLM's spelling of "off"
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if not _is_number(value):
                raise DuokaError(f"{name}={value!r} must be a number", f"give {name} as a number")
            # An int beyond float range becomes inf, which the range checks below reject.
            huge = isinstance(value, int) and abs(value) > 2**1000
            object.__setattr__(self, name, (math.inf if value > 0 else -math.inf) if huge else float(value))
        self._check()

    def _check(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise DuokaError(f"max_tokens={self.max_tokens!r} must be an integer >= 0",
                             "ask for at least one token, or 0 to score the prompt only (with prompt_logprobs)")
        # `nan < 0` is False, so NaN needs its own test; inf would sample uniformly.
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise DuokaError(f"temperature={self.temperature} must be a finite number >= 0",
                             "use 0 for greedy decoding, or e.g. 0.7 to sample")
        if not 0 < self.top_p <= 1:  # also rejects NaN
            raise DuokaError(f"top_p={self.top_p} must be in (0, 1]",
                             "use 1 to sample from the whole distribution, or e.g. 0.9")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise DuokaError(f"top_k={self.top_k!r} must be an integer >= 1, or 0 or -1 for off",
                             "use 0 to disable top-k, or e.g. 50")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise DuokaError(f"seed={self.seed!r} must be an integer in [-2**63, 2**63 - 1]",
                             "give a 64-bit integer seed, or none for a random one")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise DuokaError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are accepted "
                             "(each is searched in every step's output)",
                             f"keep the {MAX_STOP_STRINGS} that matter, or stop on token ids (stop_token_ids)")
        if any(s == "" for s in self.stop):
            raise DuokaError(f"stop={list(self.stop)!r} contains an empty string, which would match at once",
                             "remove the empty string")
        if any(i < 0 for i in self.stop_token_ids):
            raise DuokaError(f"stop_token_ids={list(self.stop_token_ids)} contains a negative id",
                             "token ids are >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise DuokaError(f"ignore_eos={self.ignore_eos!r} must be true or false", "give a boolean")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise DuokaError(f"{name}={value!r} must be an integer in [0, {MAX_LOGPROBS}]",
                                 f"ask for at most {MAX_LOGPROBS} alternatives per token (OpenAI's limit)")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not low <= value <= high:  # also rejects NaN
                raise DuokaError(f"{name}={value} must be in [{low:g}, {high:g}]",
                                 "use 0 for no penalty; positive values discourage repeating tokens")
        self._check_processing()

    def _check_processing(self):
        """The fields that change the logits beyond temperature and truncation, and structured."""
        # 0 would divide by zero and a negative one would flip signs; inf makes every seen token
        # -inf or 0, NaN everything NaN.
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise DuokaError(f"repetition_penalty={self.repetition_penalty} must be a finite number > 0",
                             "use 1 for no penalty; values above 1 (e.g. 1.1) discourage repeating tokens")
        if not 0 <= self.min_p <= 1:  # also rejects NaN
            raise DuokaError(f"min_p={self.min_p} must be in [0, 1]",
                             "use 0 to disable min-p, or e.g. 0.05")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise DuokaError(f"min_tokens={self.min_tokens!r} must be an integer in [0, max_tokens={self.max_tokens}]",
                             "lower min_tokens, or raise max_tokens")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise DuokaError(f"structured={self.structured!r} must be a StructuredOutput or None",
                             'e.g. StructuredOutput("json_object", "")')

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Any of presence, frequency or repetition penalty: the sampler then counts the output."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """The most likely alternatives as (token id, logprob), most likely first."""
    rank: int | None = None
    """A prompt token's rank among the vocabulary at its place (1: the most likely; vLLM's);
    None for sampled tokens."""

    def __reduce__(self):
        # Pickled as its fields in order, not a dataclass's __dict__: the engine process sends one
        # per prompt token of a scoring request, and the server unpickles them 2.4x faster so.
        return TokenLogprob, (self.token_id, self.logprob, self.top, self.rank)


@dataclass
class RequestOutput:
    """A delta: what is new for one request after one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    """"stop" | "length" | "abort"; None while running."""
    num_prompt_tokens: int
    num_output_tokens: int
    """Total so far: tokens up to and including a stop token id; the text is cut at a stop string."""
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    prompt_logprobs: Sequence[TokenLogprob | None] | None = None
    """With SamplingParams.prompt_logprobs, on the request's first output only: one entry per
    prompt token, None for the first (nothing comes before it): columns of numbers that read as
    that list of TokenLogprob (serve/logprob_columns.py; list() makes one)."""
