"""Mixture of experts in the cost model: a step reads only the routed experts its tokens choose.

Each of `tokens` tokens routes to k of a layer's E experts. Taken as uniform and independent
(a router trained with a load-balancing loss spreads tokens about evenly), one token leaves an
expert out with probability 1 - k/E and all of them with (1 - k/E)^tokens, so a step touches
E * (1 - (1 - k/E)^tokens) experts per layer on average. For Qwen3-30B-A3B (8 of 128): 8 at
one token, 82 at 16, all 128 by 256. Decode at batch 1 reads the active weights; a large batch
reads them all while its FLOPs still follow the active parameters.
"""

from __future__ import annotations

from tandem.workload.model_shapes import ModelShape


def touched_experts(num_experts: float, top_k: float, tokens: float) -> float:
    """Expected distinct experts (per layer) that `tokens` tokens routing to `top_k` choose."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def expert_read_time(experts: tuple[float, ...], tokens: float) -> float:
    """Seconds a step of `tokens` tokens spends reading experts, from a cost-model term's
    (experts, experts per token, seconds to read every expert)."""
    num_experts, top_k, seconds = experts
    return seconds * touched_experts(num_experts, top_k, tokens) / num_experts


def weight_bytes_read(shape: ModelShape, tokens: int, dtype_bytes: int = 2) -> float:
    """Weight bytes a step of `tokens` tokens reads: every dense weight, the touched experts."""
    touched = touched_experts(shape.num_experts, shape.num_experts_per_tok, tokens)
    dense = shape.num_params - shape.expert_params
    share = touched / shape.num_experts if shape.num_experts else 0.0
    return (dense + shape.expert_params * share) * dtype_bytes
