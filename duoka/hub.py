"""Where a model lives: a local folder, or a Hugging Face hub id resolved through
huggingface_hub's cache (and download, where the network allows), as transformers
users expect. HF_HUB_CACHE, HF_HOME and HF_HUB_OFFLINE are honoured as there."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from duoka.errors import DuokaError

# What a Qwen2 folder needs; weights as safetensors only (we never unpickle, so *.bin
# files are not worth downloading).
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
# huggingface_hub's command is `hf` from 0.34 on (2.x ships only `hf`); duoka accepts 0.24 and
# later, whose older releases have `huggingface-cli` instead.
OLD_CLI_NOTE = "huggingface_hub before 0.34"


def bundled_model_dir() -> Path:
    """A tiny Qwen2 shipped in the package (tools/make_tiny_model.py made it), so that
    `duoka generate` works on a fresh machine with no download; its tokenizer is also the
    one the built-in training run uses."""
    return Path(str(resources.files("duoka") / "assets" / "tiny-qwen2"))


def bundled_corpus() -> Path:
    """Standard-library docstrings (PSF licence), the built-in training run's data."""
    return Path(str(resources.files("duoka") / "assets" / "corpus" / "stdlib_docstrings.jsonl.gz"))


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_dir(name_or_path: str | Path, revision: str | None = None) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise DuokaError(f"{path} is a file; a model is a folder with config.json and *.safetensors",
                         f"pass the folder that contains it: {path.parent}")
    text = str(name_or_path)
    if not _REPO_ID.match(text) or text.startswith((".", "/", "~")):
        raise DuokaError(f"model folder {text} does not exist",
                         "pass a local Hugging Face folder (config.json + *.safetensors) or a hub id such as Qwen/Qwen2-7B")
    return _from_hub(text, revision)


def _from_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILE_PATTERNS))
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise DuokaError(f"hub model {repo_id} is not accessible: {type(e).__name__}",
                         "check the id's spelling, or log in for a gated model: `hf auth login` "
                         f"({OLD_CLI_NOTE}: `huggingface-cli login`)") from None
    except RevisionNotFoundError:
        raise DuokaError(f"hub model {repo_id} has no revision {revision!r}", "use an existing branch, tag or commit") from None
    except LocalEntryNotFoundError:
        raise DuokaError(
            f"{repo_id} is neither a local folder nor in the Hugging Face cache ({HF_HUB_CACHE}), and it could not be "
            "downloaded (offline, or HF_HUB_OFFLINE=1)",
            f"download it where there is network (`hf download {repo_id}`; {OLD_CLI_NOTE}: `huggingface-cli "
            f"download {repo_id}`) and copy the cache, or pass a local folder",
        ) from None
    except HfHubHTTPError as e:
        raise DuokaError(f"downloading {repo_id} failed: {e}", "retry, or pass a local folder") from None
