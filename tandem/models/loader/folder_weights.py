"""A Hugging Face folder's safetensors weights, read by name when asked for."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

if TYPE_CHECKING:  # torch is imported where weights are read: the front end process never needs it
    import torch


class FolderWeights:
    """A Hugging Face folder's safetensors tensors by name, read when asked for (as stored)."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder)
        self._files: dict[str, Path] = {}
        for file in weight_files(self.path):
            with open_safetensors(file) as f:
                self._files.update(dict.fromkeys(f.keys(), file))

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) as stored, one at a time."""
        for file in weight_files(self.path):
            with open_safetensors(file) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def names(self) -> list[str]:
        return list(self._files)

    def get(self, name: str) -> torch.Tensor:
        with open_safetensors(self._files[name]) as f:
            return f.get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        with open_safetensors(self._files[name]) as f:
            return f.get_slice(name)[start:stop]

    def shape(self, name: str) -> tuple[int, ...]:
        with open_safetensors(self._files[name]) as f:
            return tuple(f.get_slice(name).get_shape())

    def int4(self, name: str) -> None:
        """A safetensors file holds no int4 codes: int4 is quantised from its floats."""
        return None

    def code_bits(self, name: str) -> int:
        """Bits a weight is stored in: the float's width."""
        with open_safetensors(self._files[name]) as f:
            return {"F16": 16, "BF16": 16}.get(f.get_slice(name).get_dtype(), 32)


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: the shards named by model.safetensors.index.json, else
    every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ValueError(f"{index}: invalid safetensors index ({e!r})") from e
        files = [folder / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index}: lists shards that do not exist: {', '.join(missing)}"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no weights (*.safetensors) in the model folder")
    return files


@contextmanager
def open_safetensors(path: Path, framework: str = "pt") -> Iterator[Any]:
    """safe_open, with its terse header errors re-raised naming the file."""
    try:
        handle = safe_open(str(path), framework=framework)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: corrupt or truncated safetensors file ({e})") from e
    with handle as f:
        yield f
