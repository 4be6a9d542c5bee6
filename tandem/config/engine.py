"""EngineConfig: the engine's configuration in sections, as vLLM's VllmConfig composes them. A
component takes the section it needs. Every option also has a flat name, unique across the
sections (`max_num_seqs`, `kv_cache_memory`): `LLM(**kwargs)`, the CLI flags and the YAML's
`serving.engine` use it, and `from_kwargs` routes it to its section."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tandem.config.cache import CacheConfig
from tandem.config.device import DeviceConfig
from tandem.config.lora import LoRAConfig
from tandem.config.model import ModelConfig
from tandem.config.observability import ObservabilityConfig
from tandem.config.option import option
from tandem.config.quantization import QuantizationConfig
from tandem.config.scheduler import SchedulerConfig
from tandem.config.speculative import SpeculativeConfig


@dataclass(slots=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    quant_config: QuantizationConfig = field(default_factory=QuantizationConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    speculative_config: SpeculativeConfig | None = option(
        None,
        'speculative decoding, vLLM\'s keys as JSON: {"method": "ngram"}, or {"method": "draft", '
        '"model": "self:int4", "num_speculative_tokens": 4} with a draft of self:int4, self:int8, '
        "self:bf16 or a model with the same tokenizer",
        none="off",
        yaml="speculative_decoding",
        from_yaml=SpeculativeConfig.from_yaml,
    )

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.lora_config.enabled and self.speculative_config is not None:
            raise ValueError("LoRA adapters are not served with speculative decoding yet")

    @classmethod
    def from_kwargs(cls, **values: Any) -> EngineConfig:
        """From flat options (`model=..., max_num_seqs=...`), each routed to its section."""
        unknown = set(values) - OPTIONS.keys()
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        sections: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            sections.setdefault(OPTIONS[name].section, {})[name] = value
        own = sections.pop("", {})
        return cls(**{s: SECTIONS[s](**kw) for s, kw in sections.items()}, **own)


class Option(NamedTuple):
    """A flat option: the section attribute holding it ("" for EngineConfig's own field), its
    dataclass field and its resolved type."""

    section: str
    field: dataclasses.Field
    type: Any


def _options() -> tuple[dict[str, type], dict[str, Option]]:
    sections: dict[str, type] = {}
    options: dict[str, Option] = {}
    own = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.default_factory is dataclasses.MISSING:
            options[f.name] = Option("", f, own[f.name])
            continue
        sections[f.name] = section = own[f.name]
        hints = typing.get_type_hints(section)
        for g in dataclasses.fields(section):
            if g.name in options:  # a flat name routes to one section only
                raise TypeError(f"option {g.name!r} is in two sections")
            options[g.name] = Option(f.name, g, hints[g.name])
    return sections, options


SECTIONS, OPTIONS = _options()
