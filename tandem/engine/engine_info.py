"""A read-only view of an offline engine, for the benches and tools that report on it: what it
built (`EngineInfo`: dtype, KV pool, precision variants and their weight bytes, CUDA graphs) and
what its steps did (`StepCounters`). Read here, in one place, so that no bench reaches into the
scheduler, the KV manager or the model runner, and a change there is followed here once."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.core.spec_decode import SpecDecodeStats
    from tandem.engine.core import EngineCore


@dataclass(frozen=True, slots=True)
class EngineInfo:
    dtype: str  # the float dtype the model runs in: float32, bfloat16, float16
    kv_cache_dtype: str  # the KV cache's: the same, or bfloat16 / float16 under float32
    block_size: int
    num_kv_blocks: int
    kv_bytes_per_token: int  # the target model's KV, all layers
    default_precision: str
    weight_bytes: dict[
        str, int
    ]  # precision (or draft:<name>) -> bytes of weights, each variant built
    decode_weight_bytes: int  # weight bytes a decode step of the default variant reads: the
    # embedding table aside when the output head is its own (a step reads only its tokens' rows)
    graphs_captured: bool  # CUDA graphs for decode steps
    graph_capture_seconds: float
    graph_capture_bytes: int
    async_scheduling: bool  # step N+1 planned while step N runs


@dataclass(frozen=True, slots=True)
class StepCounters:
    """The step figures since `LLMEngine.reset_stats` (num_steps, num_gaps, phase_times, KV
    figures) and since the engine started (the rest): a bench diffs the latter itself."""

    num_steps: int
    num_gaps: int  # executor idle between two steps while the engine had work
    phase_times: dict[str, float]  # seconds: schedule, execute, update, gap, propose
    kv_utilization_sum: float  # per step, summed: the mean is this / num_steps
    kv_usage_peak: float
    prepare_seconds: float  # building step inputs, within execute
    grammar_mask_seconds: float  # structured outputs' token masks, within execute
    num_preemptions: int
    prefix_hit_tokens: int
    spec: SpecDecodeStats
    gpu_busy_seconds: float | None  # CUDA events (None off CUDA): the GPU's own time per step
    gpu_gap_seconds: float | None  # ... and its idle time between steps
    gpu_num_steps: int | None
    gpu_num_gaps: int | None
    draft_forwards: int  # a draft model's one-token forwards (0 without one)


def engine_info(core: EngineCore) -> EngineInfo:
    ex = core.executor
    graphs = ex.graph_runner
    return EngineInfo(
        dtype=str(ex.dtype).removeprefix("torch."),
        kv_cache_dtype=str(ex.kv.dtype).removeprefix("torch."),
        block_size=ex.block_size,
        num_kv_blocks=ex.num_kv_blocks,
        kv_bytes_per_token=ex.kv.kv_bytes_per_token,
        default_precision=ex.variants.default,
        weight_bytes=dict(ex.variants.weight_bytes),
        decode_weight_bytes=_decode_weight_bytes(ex.model),
        graphs_captured=graphs is not None,
        graph_capture_seconds=graphs.capture_seconds if graphs else 0.0,
        graph_capture_bytes=graphs.capture_bytes if graphs else 0,
        async_scheduling=core.pipeline.overlap,
    )


def _decode_weight_bytes(model) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(
        m.packed.numel() * m.packed.element_size()
        for m in model.modules()
        if getattr(m, "packed", None) is not None
    )
    embedding = getattr(
        model.embed_tokens, "weight", None
    )  # an int8 embedding is the LM head's table
    if model.lm_head is not None and embedding is not None:
        total -= embedding.numel() * embedding.element_size()
    return total


def step_counters(core: EngineCore) -> StepCounters:
    stats, ex = core.stats, core.executor
    gaps, masks = ex.step_gaps, ex.structured_output
    return StepCounters(
        num_steps=stats.num_steps,
        num_gaps=stats.num_gaps,
        phase_times=dict(stats.phase_times),
        kv_utilization_sum=stats.kv_utilization_sum,
        kv_usage_peak=stats.kv_usage_peak,
        prepare_seconds=ex.prepare_time,
        grammar_mask_seconds=masks.seconds if masks is not None else 0.0,
        num_preemptions=core.scheduler.num_preemptions,
        prefix_hit_tokens=core.kv_manager.stats.hits,
        spec=copy.deepcopy(core.scheduler.spec_stats),
        gpu_busy_seconds=gaps.busy_seconds if gaps else None,
        gpu_gap_seconds=gaps.gap_seconds if gaps else None,
        gpu_num_steps=gaps.num_steps if gaps else None,
        gpu_num_gaps=gaps.num_gaps if gaps else None,
        draft_forwards=ex.proposer.num_forwards if ex.proposer is not None else 0,
    )
