"""The one cache of torch.compile'd free functions (flex attention, the loss kernels).

torch.compile returns a new wrapper on every call; memoising it per (function, options)
gives each caller one wrapper for the process, built on first use, so no import pays
for it and every call site shares the same compiled graphs and recompile budget.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch


@functools.cache
def compiled(fn: Callable, dynamic: bool | None = None, fullgraph: bool = False) -> Callable:
    """torch.compile(fn, dynamic=dynamic, fullgraph=fullgraph), made once per process.
    Two variants that must not share guards need two functions (graphs are cached per
    code object), not two option sets."""
    return torch.compile(fn, dynamic=dynamic, fullgraph=fullgraph)
