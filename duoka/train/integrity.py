"""What makes a checkpoint folder trustworthy before it is loaded.

- `manifest.json`, written last, holds every file's size and checksum: a missing or
  truncated file, or flipped bits, is found before any tensor is read. Each rank checksums
  the files it wrote (in parallel across ranks) and leaves them in a `.sums-RANK.json`;
  rank 0 folds those into the manifest with its own files' sums.
- DCP's `.metadata` is a pickle, and unpickling runs whatever code it names: it is read
  by an unpickler that builds only the classes DCP writes there, and refuses the rest. The
  shards' bytes items are pickles too: checkpoint_io's load planner reads them with torch's
  weights-only loader (refused_item names what it refuses).
- Files are fsynced before the folder is renamed into place, so a power loss cannot leave
  a renamed checkpoint with missing data.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from duoka.errors import DuokaError

MANIFEST = "manifest.json"
STATE_FILE = "train_state.json"
METADATA = ".metadata"  # DCP's own name for its metadata file
# zlib.crc32 catches truncation and flipped bits (the failures it guards against; it is no
# defence against forgery): 0.47 s/GiB on one core here, 0.38 s/GiB reading from the page
# cache, against 1.0 for blake2b and 0.85 for sha256. It releases the GIL, so threads
# checksum several files at once.
CHECKSUM = "crc32"
_CHUNK = 16 << 20  # read buffer: large enough that the per-call cost vanishes
_SUMS = ".sums-{rank}.json"
FIX_DAMAGED = ("resume from another checkpoint of the run (checkpoint.resume=auto takes the newest intact one), "
               "or restore this folder's files from a copy")
FIX_WRITE = "check the disk under job.output_dir (free space, permissions, quota)"
# A checkpoint without its manifest cannot be told from a damaged or altered one: it is
# refused unless the user vouches for it (checkpoint.trust_unverified; export --trust-unverified).
UNVERIFIED = f"{MANIFEST} is missing: its files cannot be verified"
FIX_UNVERIFIED = ("resume from a checkpoint that has one (checkpoint.resume=auto takes the newest intact one); if you "
                  "trust this one (saved by a duoka older than manifests, or copied without it), pass "
                  "--checkpoint.trust_unverified=true (duoka export: --trust-unverified)")


def checksum(path: Path) -> str:
    crc, buf = 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _describe(paths: list[Path]) -> dict[str, dict]:
    """{file name: {"bytes": size, CHECKSUM: sum}}, several files checksummed at once."""
    if not paths:
        return {}
    with ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1, 8)) as pool:
        sums = list(pool.map(checksum, paths))
    return {p.name: {"bytes": p.stat().st_size, CHECKSUM: s} for p, s in zip(paths, sums)}


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def copy_synced(source: Path, folder: Path) -> None:
    target = folder / source.name
    shutil.copyfile(source, target)
    with open(target, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(folder: Path) -> None:
    """Make the folder's entries (new files, a rename) durable, as fsync does a file's data."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems that cannot sync a folder
            raise
    finally:
        os.close(fd)


def write_rank_sums(folder: Path, rank: int, files: list[Path]) -> None:
    """A rank's part of the manifest: the files it wrote, described by the rank itself."""
    write_synced(folder / _SUMS.format(rank=rank), json.dumps(_describe(files)).encode())


def write_manifest(folder: Path) -> None:
    """The ranks' sums, plus every other file of the folder described here (DCP's metadata,
    the train state, the tokenizer), written last: a checkpoint with a manifest is whole."""
    files: dict[str, dict] = {}
    for part in sorted(folder.glob(_SUMS.format(rank="*"))):
        files.update(json.loads(part.read_text()))
        part.unlink()
    rest = sorted(p for p in folder.iterdir() if p.is_file() and p.name not in files and p.name != MANIFEST)
    files.update(_describe(rest))
    write_synced(folder / MANIFEST, json.dumps({"checksum": CHECKSUM, "files": files}, indent=1).encode())


def has_manifest(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def find_damage(folder: Path, trust_unverified: bool = False) -> str | None:
    """What is wrong with this checkpoint folder, or None when every check passes. Without a
    manifest it is UNVERIFIED, unless trusted: then only the metadata and the state file are
    checked."""
    if not has_manifest(folder) and not trust_unverified:
        return UNVERIFIED
    problems = _manifest_problems(folder) if has_manifest(folder) else []
    if not problems:
        for name in (STATE_FILE, METADATA):
            if not (folder / name).is_file():
                problems.append(f"{name} is missing")
    if not problems:
        try:
            read_state(folder)
            load_metadata(folder)
        except DuokaError as e:
            problems.append(e.cause.removeprefix(f"{folder}/"))
    return "; ".join(problems) or None


def _manifest_problems(folder: Path) -> list[str]:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
        sizes = {name: int(entry["bytes"]) for name, entry in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"]
    if manifest.get("checksum") != CHECKSUM:
        return [f"{MANIFEST} uses checksum {manifest.get('checksum')!r}, not {CHECKSUM}"]
    problems, present = [], []
    for name in (STATE_FILE, METADATA):
        if name not in files:
            problems.append(f"{MANIFEST} does not list {name}")
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif (actual := path.stat().st_size) != size:
            problems.append(f"{name} is truncated ({actual:,} of {size:,} bytes)" if actual < size
                            else f"{name} has {actual:,} bytes, {size:,} expected")
        else:
            present.append(path)
    if problems:  # sizes first: no reading of every byte when a file is plainly damaged
        return problems
    for name, entry in _describe(present).items():
        if entry[CHECKSUM] != files[name][CHECKSUM]:
            problems.append(f"{name} fails its checksum ({CHECKSUM} {entry[CHECKSUM]}, written as "
                            f"{files[name][CHECKSUM]}): its bytes changed after it was saved")
    return problems


def fix_for(damage: str) -> str:
    """The fix for what find_damage found."""
    return FIX_UNVERIFIED if damage == UNVERIFIED else FIX_DAMAGED


def read_state(folder: Path) -> dict:
    path = folder / STATE_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DuokaError(f"{path} is missing", FIX_DAMAGED) from None
    except (ValueError, OSError) as e:
        raise DuokaError(f"{path} is damaged ({type(e).__name__}: {e})", FIX_DAMAGED) from None



# Every global a DCP .metadata pickle names (read from real duoka checkpoints with
# pickletools): its dataclasses, torch.Size, dtypes and layouts, and the checkpoint's path.
_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    *((_DCP, name) for name in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
                                "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta",
                                "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name, from torch's own table
    *(("pathlib", name) for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _Refused(f"persistent id {pid!r}")


class _Refused(pickle.UnpicklingError):
    pass


def load_metadata(folder: Path):
    """DCP's metadata of the checkpoint, unpickled with only DCP's own classes allowed."""
    path = folder / METADATA
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except _Refused as e:
        raise DuokaError(f"{path} names {e}, which torch.distributed.checkpoint never writes there: refused to "
                         f"unpickle it (a crafted pickle runs code)",
                         "load only checkpoints you trust; this one was not written by duoka, or was altered") from None
    except FileNotFoundError:
        raise DuokaError(f"{path} is missing", FIX_DAMAGED) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, OSError) as e:
        raise DuokaError(f"{path} is truncated or damaged ({type(e).__name__}: {e})", FIX_DAMAGED) from None


def refused_item(folder: Path, item: str, e: Exception) -> DuokaError:
    """A bytes item of a shard that torch's weights-only unpickler refused (or could not read)."""
    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, pickle.UnpicklingError):
        return DuokaError(f"{folder}: item {item} holds a pickled object that is not a plain value or tensor ({why}): "
                          "refused to unpickle it (a crafted pickle runs code)",
                          "load only checkpoints you trust; this one was not written by duoka, or was altered")
    return DuokaError(f"{folder}: item {item} is damaged ({type(e).__name__}: {why})", FIX_DAMAGED)


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full(folder: Path, needed: int | None) -> DuokaError:
    """The error of a save that found no room: how much it needs, how much there is, where."""
    root = folder
    while not root.exists() and root != root.parent:
        root = root.parent
    free = shutil.disk_usage(root).free
    gb = max(needed or 0, free) >= 1e8  # one unit for both figures
    need = f"{_size(needed, gb)} needed, " if needed else ""
    return DuokaError(f"no space left on device: {need}{_size(free, gb)} free at {folder}",
                      "free space on that disk (older checkpoints, or a lower checkpoint.keep) or point "
                      "job.output_dir at a disk with room")


def _size(n: int, gb: bool) -> str:
    return f"{n / 1e9:.1f} GB" if gb else f"{n / 1e6:.1f} MB"
