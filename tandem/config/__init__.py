"""The engine's configuration in sections (config/engine.py composes them), and what reads
them from keyword arguments, CLI flags (config/args.py) and YAML (config/serving_yaml.py)."""

from tandem.config.cache import CacheConfig
from tandem.config.device import AttentionBackend, DeviceConfig
from tandem.config.engine import EngineConfig
from tandem.config.lora import LoRAConfig
from tandem.config.model import ModelConfig, cache_root
from tandem.config.observability import ObservabilityConfig
from tandem.config.quantization import PRECISIONS, QuantizationConfig
from tandem.config.role import InstanceRole
from tandem.config.scheduler import PreemptionMode, QueueOrder, SchedulerConfig, SchedulingPolicy
from tandem.config.serving_yaml import load_yaml
from tandem.config.speculative import SpeculativeConfig

__all__ = [
    "PRECISIONS",
    "AttentionBackend",
    "CacheConfig",
    "DeviceConfig",
    "EngineConfig",
    "InstanceRole",
    "LoRAConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "PreemptionMode",
    "QuantizationConfig",
    "QueueOrder",
    "SchedulerConfig",
    "SchedulingPolicy",
    "SpeculativeConfig",
    "cache_root",
    "load_yaml",
]
