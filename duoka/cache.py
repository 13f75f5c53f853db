"""Where duoka keeps what it can make again but would rather not: tokenized corpora and
torch.compile's artefacts, under the user's cache directory.

Imports no torch: the launcher sets the workers' environment from here before torch loads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# The variable Inductor reads for its cache folder (FX graphs, AOTAutograd entries, and
# Triton's kernels under triton/<device> unless TRITON_CACHE_DIR says otherwise), looked up
# each time it compiles: set before the first compile, it moves every cache with it.
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_home() -> Path:
    """$DUOKA_CACHE, else $XDG_CACHE_HOME/duoka, else ~/.cache/duoka."""
    base = os.environ.get("DUOKA_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "duoka")
    return Path(base).expanduser()


def compile_cache_env(folder: str = "", environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment that sends torch.compile's artefacts to a folder that outlives the
    run (torch's default is under /tmp, which a reboot or a new container empties):
    `folder` when given (training.compile_cache), else a TORCHINDUCTOR_CACHE_DIR the user
    set (nothing to change), else cache_home()/torch-compile."""
    if folder:
        return {INDUCTOR_CACHE_ENV: str(Path(folder).expanduser().resolve())}
    if environ.get(INDUCTOR_CACHE_ENV):
        return {}
    return {INDUCTOR_CACHE_ENV: str(cache_home() / "torch-compile")}
