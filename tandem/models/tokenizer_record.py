"""The tokenizer class AutoTokenizer picked for a folder, recorded so that later loads take that
class directly. AutoTokenizer reads the model's config first, and with it transformers' config
machinery and torch: seconds of imports in every process that tokenises (a server's API
process, its engine core, the router), and torch in a process that otherwise never needs it.

A record holds the class's name and the transformers version that picked it, and is used only
under that version, for a class transformers exports by that name. A converted GGUF's folder
holds its record itself (it is Tandem's own and never changes); for a Hugging Face folder the
record lies in the cache, keyed by the folder's path, and names the sizes and times of the
folder's files besides the weights: a file changed, added or removed and AutoTokenizer picks again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path

from tandem.config import cache_root

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def folder_files(path: Path) -> list[list]:
    """A folder's files that are not weights (what a tokenizer load may read: config.json,
    tokenizer files, chat template), or the one file `path` is, as [name, mtime_ns, size]."""
    path = Path(path)
    files = (
        [f for f in path.iterdir() if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES)]
        if path.is_dir()
        else [path]
    )
    return sorted([f.name, f.stat().st_mtime_ns, f.stat().st_size] for f in files)


def cache_record_path(folder: Path) -> Path:
    """Where a Hugging Face folder's record lies in the cache."""
    key = hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:24]
    return cache_root() / "tokenizer-classes" / f"{key}.json"


def write_record(path: Path, picked: type, folder: Path | None = None) -> None:
    """Record `picked` at `path` when transformers exports it by its name; with `folder`, the
    record also names that folder and its files. A cache that cannot be written only loses the
    shortcut."""
    import transformers

    if getattr(transformers, picked.__name__, None) is not picked:
        return
    record = {"tokenizer_class": picked.__name__, "transformers": transformers.__version__}
    if folder is not None:
        record |= {"folder": str(Path(folder).resolve()), "files": folder_files(folder)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".record-")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record) + "\n")
        os.replace(tmp, path)  # whole or not at all, with other processes recording beside it
    except OSError:
        return
    if folder is not None:
        _forget_gone_folders(path.parent)


def _forget_gone_folders(records: Path) -> None:
    """Remove the cache's records of folders that no longer exist (a temporary model folder's),
    so the records stay as many as the folders served."""
    for path in records.glob("*.json"):
        try:
            if not Path(json.loads(path.read_text())["folder"]).is_dir():
                path.unlink()
        except (OSError, ValueError, KeyError, TypeError):
            continue


def recorded_class(path: Path, folder: Path | None = None) -> type | None:
    """The class recorded at `path`, if the transformers installed is the one that picked it
    (and, with `folder`, the record is that folder's and its files are as recorded); else None."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("transformers") != importlib.metadata.version(
        "transformers"
    ):
        return None
    if folder is not None:
        try:
            if record.get("folder") != str(Path(folder).resolve()) or record.get(
                "files"
            ) != folder_files(folder):
                return None
        except OSError:
            return None
    import transformers

    return getattr(transformers, str(record.get("tokenizer_class")), None)
