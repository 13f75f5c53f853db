"""A config.json's fields read with their type and range checked, before anything is built: a
model folder is untrusted input, and a value such as `num_hidden_layers: 2000000000` (a build
that never ends), `rope_theta: "NaN"` (a model that prints nothing) or `head_dim: -4` (a
traceback deep in torch) is refused here, naming the field and what it must be.

The bounds are far above every published model and far below what would take the machine
down; the parameter count a config implies is also checked against the weights on disk
(hf_adapter.read_config), which these bounds alone cannot do.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from duoka.errors import DuokaError

# The deepest published decoders have 126 layers (Llama 3.1 405B); building a layer's modules
# takes about a millisecond, so 1,024 layers are still built in a second.
MAX_LAYERS = 1024
# Any other count (widths, heads, vocabulary, positions, experts): 2^24 is 16.7 M, above every
# published value (widths up to 53,248, vocabularies up to 262,144, contexts up to 10 M tokens)
# and small enough that products of two stay far from int64's range.
MAX_COUNT = 1 << 24
# The dtypes a config.json may name for its weights (what transformers writes); a name is
# looked up in this list only, never on the torch module.
CONFIG_DTYPES = ("bfloat16", "float16", "float32")

FIX = "restore config.json from the original checkpoint (or compare with one that transformers wrote)"

Refuse = Callable[[str, str, str], DuokaError]
_MISSING = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_int(cfg: dict, field: str, refuse: Refuse, default: Any = _MISSING, low: int = 1,
             high: int = MAX_COUNT) -> int:
    """An integer field in [low, high] (a float with an integral value is accepted: JSON writers differ)."""
    value = cfg.get(field, default)
    if value is None and default is not _MISSING:
        value = default
    if value is _MISSING:
        raise refuse(field, "is missing", "the file is not a complete Qwen2 config.json")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise refuse(field, f"is {value!r}, not an integer", FIX)
    if not low <= value <= high:
        raise refuse(field, f"is {value:,}, outside {low:,}..{high:,}", FIX)
    return value


def read_float(cfg: dict, field: str, refuse: Refuse, default: float, low: float = 0.0, high: float = math.inf,
               low_open: bool = False) -> float:
    """A finite number in [low, high] ((low, high] with low_open)."""
    value = cfg.get(field, default)
    if value is None:
        value = default
    return check_float(value, field, refuse, low, high, low_open)


def check_float(value: Any, field: str, refuse: Refuse, low: float = 0.0, high: float = math.inf,
                low_open: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise refuse(field, f"is {value!r}, not a number", FIX)
    bound = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
    if not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
        raise refuse(field, f"is {value!r}; it must be a finite number {bound}", FIX)
    return float(value)


def read_bool(cfg: dict, field: str, refuse: Refuse, default: bool) -> bool:
    value = cfg.get(field, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise refuse(field, f"is {value!r}, not true or false", FIX)
    return value


def read_token_ids(cfg: dict, field: str, refuse: Refuse) -> int | list[int] | None:
    """bos_token_id / eos_token_id: absent, one id or a list of ids, each >= 0."""
    value = cfg.get(field)
    ids = value if isinstance(value, list) else [value] if value is not None else []
    if not all(_is_int(i) and 0 <= i < MAX_COUNT for i in ids):
        raise refuse(field, f"is {value!r}; it must be a token id or a list of them", FIX)
    return value


def read_dtype(cfg: dict, refuse: Refuse) -> str | None:
    """The dtype the weights are saved in (transformers 5 writes dtype, 4 torch_dtype), from
    CONFIG_DTYPES only."""
    names = {field: cfg.get(field) for field in ("dtype", "torch_dtype") if cfg.get(field) is not None}
    for field, name in names.items():
        if name not in CONFIG_DTYPES:
            raise refuse(field, f"is {name!r}, not one of {', '.join(CONFIG_DTYPES)}", FIX)
    return next(iter(names.values()), None)


def read_dict(cfg: dict, field: str, refuse: Refuse) -> dict:
    value = cfg.get(field)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise refuse(field, f"is {value!r}, not an object", FIX)
    return value


def read_layer_list(cfg: dict, field: str, refuse: Refuse, n_layers: int) -> tuple[int, ...]:
    value = cfg.get(field) or []
    if not isinstance(value, list) or not all(_is_int(i) for i in value) or len(value) > n_layers:
        raise refuse(field, f"is {value!r}; it must be a list of layer indices", FIX)
    return tuple(value)
