"""Which KV blocks hold which layers, when a model mixes sliding-window and full-attention layers.

A sliding-window layer reads only its last `window` positions, so its blocks behind the window can
be freed while the full-attention layers still need theirs. For that, layers of one kind share
blocks and the kinds do not: the layers are cut into groups of `g` layers, g the greatest common
divisor of each kind's layer count, every group of one attention kind (e.g. Gemma 3 270M: 3
global and 15 local layers -> 1 full group and 5 sliding groups of 3 layers). Each group has a
block table of its own; every block holds `g` layers' K/V for block_size tokens, so all groups
draw on one pool of equal blocks, and a freed sliding block serves the full layers' next tokens.
The j-th layer of each group shares one storage row (`layer_slots[layer] = (group, row)`).

A model with a single kind of attention has one group of all its layers (the plain layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window (None: full attention)
    layer_slots: tuple[tuple[int, int], ...]  # per model layer: (group, storage row)
    layers_per_group: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def plain_groups(num_layers: int) -> KVGroups:
    """Every layer in one group: one block table, every block holds every layer."""
    return KVGroups((None,), tuple((0, i) for i in range(num_layers)), num_layers)


def kv_groups(layer_windows: list[int | None]) -> KVGroups:
    """The grouping of layers whose windows are `layer_windows` (None: full attention). One kind
    of attention: the plain layout (its window, if any, still frees blocks behind it)."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1:
        (window,) = kinds
        return KVGroups(
            (window,), tuple((0, i) for i in range(len(layer_windows))), len(layer_windows)
        )
    g = math.gcd(*(len(layers) for layers in kinds.values()))
    windows: list[int | None] = []
    slots: dict[int, tuple[int, int]] = {}
    for window, layers in kinds.items():
        for t, layer in enumerate(layers):
            if t % g == 0:
                windows.append(window)
            slots[layer] = (len(windows) - 1, t % g)
    return KVGroups(tuple(windows), tuple(slots[i] for i in range(len(layer_windows))), g)
