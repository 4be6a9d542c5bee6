"""The device section: where and how the model runs (device, CPU threads, attention kernels,
CUDA graphs, batch-invariant kernels)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.option import Choice, option


class AttentionBackend(Choice):
    AUTO = "auto"  # Triton on CUDA when installed, else PyTorch
    TORCH = "torch"
    TRITON = "triton"


@dataclass(slots=True)
class DeviceConfig:
    device: str = option("auto", "auto, cpu, cuda or cuda:N (auto: cuda when available)")
    num_threads: int | None = option(
        None, "CPU threads of the engine", unit="threads", none="all cores"
    )
    attention_backend: AttentionBackend = option(
        AttentionBackend.AUTO,
        "attention kernels (auto: Triton on CUDA when installed, else PyTorch)",
    )
    # CUDA graphs serve decode-only steps (executor/cuda_graphs.py) unless this is set.
    enforce_eager: bool = option(False, "no CUDA graphs: run decode steps eagerly too")
    # A request's tokens do not depend on what shares its steps (batch-invariant kernels, every
    # position attended as a one-token row; models/batch_invariant.py). CPU only for now.
    deterministic: bool = option(
        False,
        "a request's tokens do not depend on the other requests in its steps, the batch size, "
        "chunking, prefix hits, preemption or speculation (CPU)",
        yaml="deterministic",
    )

    def __post_init__(self) -> None:
        self.attention_backend = AttentionBackend.parse(self.attention_backend, "attention_backend")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be true or false, got {self.deterministic!r}")
