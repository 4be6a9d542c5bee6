"""The LoRA section: adapters served over the base model, how many are held where, and the folder
runtime loads may read from."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.option import option


@dataclass(slots=True)
class LoRAConfig:
    enable_lora: bool = option(
        False,
        "serve LoRA adapters (PEFT folders, GGUF LoRA files) over the base model; on with "
        "lora_modules",
    )
    max_loras: int = option(
        4,
        "adapters resident for the steps at once: a step whose requests use more runs in parts",
        unit="adapters",
    )
    max_cpu_loras: int | None = option(
        None,
        "adapters kept loaded in host memory, the least recently used evicted first",
        unit="adapters",
        none="max_loras",
    )
    max_lora_rank: int = option(16, "the largest adapter rank loaded; a larger one is refused")
    lora_modules: list[str] | None = option(
        None, "adapters served from the start, each as name=path (comma-separated)", none="none"
    )
    lora_dir: str | None = option(
        None,
        "the folder POST /v1/load_lora_adapter may load adapters from, with enable_lora (paths "
        "outside it are refused)",
        none="no loading at run time",
    )

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        self.modules()  # refused here, in words, not at the first request

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def modules(self) -> dict[str, str]:
        """`lora_modules` as name -> path."""
        named: dict[str, str] = {}
        for item in self.lora_modules or []:
            name, eq, path = item.partition("=")
            if not eq or not name.strip() or not path.strip():
                raise ValueError(f"a LoRA module is name=path, got {item!r}")
            if name.strip() in named:
                raise ValueError(f"LoRA module {name.strip()!r} is given twice")
            named[name.strip()] = path.strip()
        return named
