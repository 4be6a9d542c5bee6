"""Engine configuration: one dataclass, filled from keyword arguments, CLI flags or YAML."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from tandem.core.request_class import CLASS_NAMES
from tandem.core.scheduler_config import SchedulerConfig
from tandem.core.spec_decode import SpeculativeConfig
from tandem.flags import FLOAT_DTYPES, parse_size

log = logging.getLogger(__name__)
KNOWN_SECTIONS = ("engine", "cache", "scheduler", "server", "quantization", "speculative_decoding", "deterministic")
# Quantisation: a precision names one variant of the model. fp16 is the device's 16-bit float
# (bf16 on CPU, float16 on CUDA); int8 / int4 are weight-only, activations in the engine dtype.
PRECISIONS = ("bf16", "fp16", "fp32", "int8", "int4")
ROLES = ("colocated", "prefill", "decode")  # an instance's role in a cluster's model group


def cache_root() -> Path:
    """Where converted GGUFs live: $TANDEM_CACHE_DIR, else ~/.cache/tandem/models (compiled
    kernels go beside it). Here, below models/ and kernels/, so both can read it."""
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem" / "models")


@dataclass(slots=True)
class EngineConfig:
    model: str = "smollm2-135m"
    # The tokenizer served (engine/tokenizer.py): None, the model's own; else a tokenizer folder,
    # a tokenizer.json, or a model. chat_template: a Jinja file or the template itself, in place
    # of the tokenizer's.
    tokenizer: str | None = None
    chat_template: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (executor/device.py: resolve_kv_cache_dtype)
    kv_cache_memory: int | None = None  # bytes; None: a share of free memory
    gpu_memory_utilization: float | None = None  # or the KV pool sized from a share of memory
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context, capped by the KV pool
    enable_prefix_caching: bool = True
    max_prefix_tokens: int | None = None
    min_match_length: int = 0
    seed: int = 0
    num_threads: int | None = None  # CPU threads for torch; None: all cores
    # Scheduling (see core/scheduler.py): fcfs is the baseline every benchmark compares with.
    scheduler_policy: str = "fcfs"  # fcfs | multilevel
    queue_order: str = "fcfs"  # within a level: fcfs | spf
    l2_min_share: float = 0.2
    max_preemptions: int = 4
    preemption_mode: str = "auto"  # auto | swap | recompute
    swap_space: int = 512 << 20  # bytes of host memory for swapped-out KV blocks
    l1_max_prompt_tokens: int = 256  # unlabelled requests this short (prompt and max_tokens) go to L1
    l1_max_tokens: int = 256
    l1_hold_s: float = 2.0  # multilevel: lower levels stay throttled this long after L1 traffic was seen
    l1_step_time: float | None = None  # multilevel: s per step the throttle aims at; None: the share
    # Overlap: schedule step N+1 (and process step N-1's outputs) while step N runs on a
    # worker thread; see engine/step_pipeline.py.
    async_scheduling: bool = True
    step_trace: str | None = None  # append one JSON line per executed step to this file
    # GPU path: attention kernels (auto: Triton on CUDA when installed, else PyTorch) and CUDA
    # graphs for decode-only steps (see executor/cuda_graphs.py), off with enforce_eager.
    attention_backend: str = "auto"  # auto | torch | triton
    enforce_eager: bool = False
    # Quantisation (see models/builder.py): the default precision; auto (or None): the precision
    # the weights are stored in (models/variants.py). With a fallback or classes the engine holds
    # one variant per precision named.
    quantization: str | None = "auto"
    precision_fallback: str | None = None  # serves requests whose variant could not be built
    precision_classes: dict[str, str] | None = None  # request class (priority name) -> precision
    # Speculative decoding (core/spec_decode.py): a dict of SpeculativeConfig keys, kept as one.
    speculative_config: SpeculativeConfig | dict | None = None
    # A request's tokens do not depend on what shares its steps (batch-invariant kernels,
    # every position attended as a one-token row; models/batch_invariant.py). CPU only for now.
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu_memory_utilization is not None and self.kv_cache_memory is not None:
            raise ValueError("kv_cache_memory and gpu_memory_utilization both size the KV pool: give one of them")
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be auto, float32, bfloat16 or float16, got {getattr(self, name)!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be true or false, got {self.deterministic!r}")
        self._check_precisions()
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        draft = getattr(self.speculative_config, "self_draft", None)
        if draft is not None and draft not in PRECISIONS:
            raise ValueError(f"speculative model self:{draft}: unknown precision {draft!r}; a self-draft is "
                             f"one of self:{', self:'.join(PRECISIONS)}")
        self.scheduler_config(self.max_model_len or 1, 0.0, 0.0)  # its checks, now, not after the model loads

    def _check_precisions(self) -> None:
        named = {"quantization": self.quantization, "fallback": self.precision_fallback}
        for cls, precision in (self.precision_classes or {}).items():
            if cls not in CLASS_NAMES:
                raise ValueError(f"quantization class {cls!r} is not a request class; known: {', '.join(CLASS_NAMES)}")
            named[f"class {cls!r}"] = precision
        for what, precision in named.items():
            known = ("auto", *PRECISIONS) if what == "quantization" else PRECISIONS  # auto: as stored
            if precision is not None and precision not in known:
                raise ValueError(f"{what}: unknown precision {precision!r}; known: {', '.join(known)}")

    def precisions(self, default: str) -> list[str]:
        """The variants to build, default first; `default` names what `quantization: auto` chose."""
        first = default if self.quantization in (None, "auto") else self.quantization
        names = [first, *(self.precision_classes or {}).values(), self.precision_fallback]
        return list(dict.fromkeys(n for n in names if n is not None))

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**values)

    def scheduler_config(self, max_model_len: int, swap_cost: float, recompute_cost: float) -> SchedulerConfig:
        """The scheduler's part of this config (the engine and the simulator build it alike)."""
        return SchedulerConfig(
            self.max_num_seqs, self.max_num_batched_tokens, max_model_len, self.scheduler_policy,
            self.queue_order, self.l2_min_share, self.max_preemptions, self.preemption_mode,
            swap_cost, recompute_cost, self.l1_hold_s, self.l1_step_time,
            **self._speculation(),
        )

    def _speculation(self) -> dict:
        spec = self.speculative_config
        if not isinstance(spec, SpeculativeConfig):
            return {}
        return {"num_speculative_tokens": spec.num_speculative_tokens, "adaptive_speculation": spec.adaptive,
                "num_lookahead_tokens": spec.num_lookahead_tokens}


def load_yaml(path: str | Path, section: str = "engine") -> dict:
    """Read a config file with the mission's `serving:` shape.

    section "engine": serving.cache.{enabled, max_prefix_tokens, min_match_length} map to the
    prefix cache (another key there is refused); serving.engine holds any other EngineConfig field
    by name (kv_cache_memory and swap_space in bytes, or a string with a unit: "4GiB");
    serving.speculative_decoding.{draft_model, verify_interval} is speculative_config;
    serving.deterministic (true / false) is deterministic.
    section "server": serving.server (host-independent server options, e.g. api_key).
    """
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read config {path}: {e}") from e
    serving = doc.get("serving", doc)
    if not isinstance(serving, dict):
        raise ValueError(f"{path}: 'serving' must be a mapping")
    for name in serving:
        if name not in KNOWN_SECTIONS:
            log.warning("%s: serving.%s is not supported yet and is ignored", path, name)
    if section != "engine":
        return dict(serving.get(section) or {})
    out = dict(serving.get("engine") or {})
    scheduler = dict(serving.get("scheduler") or {})
    if "policy" in scheduler:
        out["scheduler_policy"] = scheduler.pop("policy")
    out.update(scheduler)
    cache = serving.get("cache") or {}
    unknown = set(cache) - {"enabled", "max_prefix_tokens", "min_match_length"}
    if unknown:  # the KV pool's own settings (kv_cache_memory, kv_cache_dtype, ...) are serving.engine's
        raise ValueError(f"{path}: unknown serving.cache key(s): {', '.join(sorted(unknown))} (serving.cache is the "
                         f"prefix cache: enabled, max_prefix_tokens, min_match_length; the KV pool's settings, "
                         f"e.g. kv_cache_dtype, go in serving.engine)")
    if "enabled" in cache:
        out["enable_prefix_caching"] = bool(cache["enabled"])
    for key in ("max_prefix_tokens", "min_match_length"):
        if key in cache:
            out[key] = cache[key]
    for key in ("kv_cache_memory", "swap_space"):  # bytes, or a size with its unit ("4GiB")
        if isinstance(out.get(key), str):
            out[key] = parse_size(out[key])
    if "deterministic" in serving:
        out["deterministic"] = serving["deterministic"]
    out.update(_quantization_options(serving.get("quantization"), path))
    if serving.get("speculative_decoding"):
        out["speculative_config"] = SpeculativeConfig.from_yaml(serving["speculative_decoding"])
    return out


def _quantization_options(section: dict | str | None, path) -> dict:
    """serving.quantization: a precision, or {default, fallback, classes: {class: precision}}."""
    if section is None:
        return {}
    if isinstance(section, str):
        return {"quantization": section}
    if not isinstance(section, dict):
        raise ValueError(f"{path}: serving.quantization must be a precision or a mapping")
    unknown = set(section) - {"default", "fallback", "classes"}
    if unknown:
        raise ValueError(f"{path}: unknown serving.quantization key(s): {', '.join(sorted(unknown))}")
    out = {"quantization": section.get("default"), "precision_fallback": section.get("fallback")}
    if section.get("classes") is not None:
        if not isinstance(section["classes"], dict):
            raise ValueError(f"{path}: serving.quantization.classes must map a class to a precision")
        out["precision_classes"] = dict(section["classes"])
    return {k: v for k, v in out.items() if v is not None}
