"""The observability section: what the engine records of its own steps."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.option import option


@dataclass(slots=True)
class ObservabilityConfig:
    step_trace: str | None = option(
        None,
        "append one JSON line per executed step to this file (summarise: tandem bench steps FILE)",
        none="no trace",
    )
