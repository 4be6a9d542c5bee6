"""The adapters an executor holds: up to `max_cpu_loras` loaded in host memory (in the models'
activation dtype, least recently used evicted first) and up to `max_loras` resident in slots of
the models' LoRA layers, also evicted least recently used. On a CPU a slot views the host copy,
so an adapter is held once; on a GPU its one resident copy serves every precision variant. A
step's rows name their adapters by LoRARequest; `set_step` makes them resident and groups the
rows by slot."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
from torch import nn

from tandem.config import LoRAConfig
from tandem.core.sampling_params import LoRARequest
from tandem.models.config import ModelConfig
from tandem.models.lora.adapter import LoRAAdapter, served_modules
from tandem.models.lora.layer import LoRABatch, LoRALinear
from tandem.models.lora.loader import load_adapter

T = TypeVar("T")


class LoRAManager:
    def __init__(self, config: LoRAConfig, cfg: ModelConfig, models: dict[str, nn.Module]) -> None:
        self.config, self.cfg = config, cfg
        self.num_slots = config.max_loras
        # the variants share one activation dtype and device (one KV pool holds all their KV)
        norm = next(iter(models.values())).norm.weight
        self.dtype, self.device = norm.dtype, norm.device
        # per model (precision variant): its step's rows by slot and its LoRA layers
        self.batches = {p: LoRABatch() for p in models}
        self.layers = [_wrap(m, cfg, self.batches[p], self.num_slots) for p, m in models.items()]
        self.names: dict[int, str] = {}
        self.cpu: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self.slots: collections.OrderedDict[int, int] = collections.OrderedDict()  # id -> slot
        self.loads = collections.Counter[str]()  # adapter name -> loads from its folder
        self.evictions = collections.Counter[str]()  # adapter name -> evictions from a slot
        self.tokens = collections.Counter[str]()  # adapter name -> tokens run with it

    def add(self, lora: LoRARequest) -> LoRAAdapter:
        """Load (or find loaded) an adapter into host memory; ValueError if it is refused."""
        adapter = self.cpu.get(lora.lora_int_id)
        if adapter is None:
            adapter = load_adapter(lora.lora_path, self.cfg, self.config.max_lora_rank, self.dtype)
            self.loads[lora.lora_name] += 1
            self.names[lora.lora_int_id] = lora.lora_name
            while len(self.cpu) >= self.config.cpu_capacity:  # a resident copy stays resident
                self.cpu.popitem(last=False)
            self.cpu[lora.lora_int_id] = adapter
        self.cpu.move_to_end(lora.lora_int_id)
        return adapter

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter (a request still running with it loads it again)."""
        self.cpu.pop(lora_int_id, None)
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            self._fill(slot, None)

    def groups(
        self, rows: list[T], loras: Sequence[LoRARequest | None], one_token: Sequence[bool]
    ) -> list[list[T]]:
        """`rows` (whose adapters are `loras`) ordered by adapter, so that each adapter's rows are
        one segment, within the one-token rows first (`one_token`, as the batch puts them); in
        parts of at most `max_loras` adapters each: one forward each."""
        order = sorted(
            range(len(rows)),
            key=lambda i: (not one_token[i], -1 if loras[i] is None else loras[i].lora_int_id),
        )
        parts: list[list[T]] = []
        ids: set[int] = set()
        for row, lora in ((rows[i], loras[i]) for i in order):
            key = None if lora is None else lora.lora_int_id
            if not parts or (key is not None and key not in ids and len(ids) == self.num_slots):
                parts.append([])
                ids = set()
            if key is not None:
                ids.add(key)
            parts[-1].append(row)
        return parts

    def set_step(
        self, precision: str, loras: Sequence[LoRARequest | None], counts: np.ndarray
    ) -> bool:
        """Make the rows' adapters resident and group the step's token rows (`counts` per row) by
        slot for the variant `precision`. Returns whether any row is adapted."""
        slots = np.array([self._slot(lora) for lora in loras], dtype=np.int64)
        for lora, n in zip(loras, counts.tolist()):
            if lora is not None:
                self.tokens[lora.lora_name] += n
        return self.batches[precision].set(np.repeat(slots, counts))

    def stats(self) -> dict[str, dict[str, int]]:
        """Per adapter name: tokens run with it, loads from its folder, evictions from a slot."""
        names = self.tokens.keys() | self.loads.keys() | self.evictions.keys()
        return {
            n: {"tokens": self.tokens[n], "loads": self.loads[n], "evictions": self.evictions[n]}
            for n in names
        }

    def _slot(self, lora: LoRARequest | None) -> int:
        if lora is None:
            return -1
        key = lora.lora_int_id
        slot = self.slots.get(key)
        if slot is None:
            adapter = self.add(lora)
            free = set(range(self.num_slots)) - set(self.slots.values())
            if free:
                slot = min(free)
            else:  # the least recently used one: not this step's (`groups` keeps them few)
                old, slot = self.slots.popitem(last=False)
                self.evictions[self.names[old]] += 1
            self.slots[key] = slot
            self._fill(slot, adapter)
        self.slots.move_to_end(key)
        return slot

    def held_bytes(self) -> dict[str, int]:
        """Bytes the adapters' tensors hold (host cache and slots), per device type; a tensor
        held in both places is counted once."""
        tensors = [t for a in self.cpu.values() for w in a.modules.values() for t in w.tensors()]
        for layers in self.layers:
            for layer in layers.values():
                tensors += [t for w in layer.slots if w is not None for t in w.tensors()]
        storages = {t.untyped_storage().data_ptr(): t for t in tensors}
        held = collections.Counter[str]()
        for t in storages.values():
            held[t.device.type] += t.untyped_storage().nbytes()
        return dict(held)

    def _fill(self, slot: int, adapter: LoRAAdapter | None) -> None:
        resident = None if adapter is None else adapter.to(self.device)
        for layers in self.layers:
            for name, layer in layers.items():
                layer.set_slot(slot, None if resident is None else resident.modules.get(name))


def _wrap(
    model: nn.Module, cfg: ModelConfig, batch: LoRABatch, num_slots: int
) -> dict[str, LoRALinear]:
    """Put each adaptable projection behind a LoRALinear (the layers' ops look their linears up
    by name at each call, so they call the wrappers)."""
    wrapped = {}
    for name in served_modules(cfg):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        lora = LoRALinear(parent._modules[attr], batch, num_slots)
        setattr(parent, attr, lora)
        wrapped[name] = lora
    return wrapped
