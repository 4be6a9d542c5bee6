"""The adapters served by name: each name's LoRARequest (a fresh id per load, so a name loaded
again never meets KV or slots of its former adapter), those of `lora_modules` first with ids
1..n in both processes, and the folder runtime loads are confined to."""

from __future__ import annotations

import itertools
from pathlib import Path

from tandem.config import LoRAConfig
from tandem.core.sampling_params import LoRARequest


def startup_loras(config: LoRAConfig) -> list[LoRARequest]:
    """`lora_modules` as requests, ids 1..n in order (the engine core loads these at start)."""
    return [
        LoRARequest(name, i, path)
        for i, (name, path) in enumerate(config.modules().items(), start=1)
    ]


class LoRANames:
    def __init__(self, config: LoRAConfig) -> None:
        self.config = config
        self.loras = {lora.lora_name: lora for lora in startup_loras(config)}
        self._ids = itertools.count(len(self.loras) + 1)

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.loras.get(name)

    @property
    def runtime_loading(self) -> bool:
        """Whether adapters may be loaded and unloaded at run time (enabled, with a folder)."""
        return self.config.enabled and self.config.lora_dir is not None

    def new(self, name: str, path: str) -> LoRARequest:
        """A request for a runtime load of `path` (relative to `lora_dir`, or inside it) under
        `name`; ValueError in words: the name empty or taken, or the path outside the folder."""
        root = self.config.lora_dir
        assert root is not None and self.runtime_loading
        if not name:
            raise ValueError("lora_name is empty")
        if name in self.loras:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded")
        folder = (Path(root) / path).resolve()
        if not folder.is_relative_to(Path(root).resolve()):
            raise ValueError(f"lora_path {path!r} is outside the adapter folder")
        return LoRARequest(name, next(self._ids), str(folder))

    def add(self, lora: LoRARequest) -> None:
        self.loras[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest:
        """KeyError if no adapter has that name."""
        return self.loras.pop(name)
