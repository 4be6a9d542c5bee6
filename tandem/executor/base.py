"""The executor interface: SchedulerOutput in, sampled tokens (and timings) out; plus the KV
blocks' bytes, which swap and P/D move and which only the executor holds.

`StepExecutor` is what a scheduler loop needs, and all the simulator's executor is (it holds
no model and no KV bytes). `Executor` is what the engine and `KVHandoff` use: nothing reaches
past it into the model runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.core.sampling_params import LoRARequest

if TYPE_CHECKING:
    import torch


class StepExecutor(Protocol):
    num_kv_blocks: int  # device KV pool, in blocks of block_size tokens
    num_host_blocks: int  # host tier for swapped-out requests
    block_size: int
    kv_group_windows: tuple[int | None, ...]  # per KV group its sliding window (core/kv_groups.py)

    def preemption_costs(self) -> tuple[float, float]:
        """Seconds per token to swap KV out and back, and to recompute it."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the swaps (`blocks_to_swap_out/in`), run the step, return the sampled tokens."""
        ...


class ServedVariants(Protocol):
    """The precision variants of the model an executor built (models/variants.py)."""

    default: str  # the precision a request without one runs at
    weight_bytes: dict[str, int]  # precision -> bytes of weights, for each variant built
    unavailable: dict[str, str]  # precision -> why it could not be built here


class Executor(StepExecutor, Protocol):
    kv_device: torch.device  # where the KV pool lives: a KV connector's device (NCCL or gloo)
    variants: ServedVariants

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of the blocks' K/V, all layers, on `kv_device`: a tensor
        [num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim]."""
        ...

    def write_kv_blocks(
        self, block_ids: list[int], kv: torch.Tensor, layer: int | None = None
    ) -> None:
        """Place blocks read by `read_kv_blocks` (here or on another instance), all layers, or
        one layer's [2, n, block_size, num_kv_heads, head_dim] when `layer` is given. Raises
        ValueError when their shape does not fit this cache."""
        ...

    def add_lora(self, lora: LoRARequest) -> None:
        """Load a LoRA adapter for the requests that name it; ValueError (in words): refused."""
        ...

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter (a request still running with it reloads it)."""
        ...

    def lora_stats(self) -> dict[str, dict[str, int]]:
        """Per adapter name: tokens run with it, loads from its folder, evictions from a slot."""
        ...
