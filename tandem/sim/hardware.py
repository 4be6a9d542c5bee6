"""Accelerator specs and the roofline cost model built from them and a model shape; a cost
model by name (`load_cost_model`: a measured profile or a roofline).

Assumptions (each one a number an operator can change):
- Achievable fractions of peak: 70% of dense bf16 FLOP/s (large GEMMs reach 60-75%) and 85%
  of HBM bandwidth (a decode GEMV at batch 1 streams weights at 80-90%).
- 1.5 ms of fixed cost per step: a vLLM-class engine with CUDA graphs for decode and its
  scheduling overlapped with the GPU; an eager engine pays 3-5 ms, pass step_overhead for it.
- The KV pool is 90% of device memory less the weights and a 2 GiB activation reserve per
  device (what vLLM's memory profiling leaves for a 2k-token step plus CUDA graphs).
- Tensor parallelism over `tp` devices divides FLOPs, bytes and weights; the all-reduces it
  adds (~10-20% at tp 4-8) are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tandem.sim.cost_model import CostModel
from tandem.workload.model_shapes import ModelShape, get_shape, kv_bytes_per_token

GiB = 1 << 30


@dataclass(slots=True, frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory_bytes: int
    link_bandwidth: float  # NVLink-class, bytes/s per direction
    host_bandwidth: float  # PCIe to host memory, bytes/s
    flops_efficiency: float = 0.70
    bandwidth_efficiency: float = 0.85
    step_overhead: float = 1.5e-3


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("h100", 989e12, 3.35e12, 80 * GiB, 450e9, 55e9),  # SXM5, NVLink 4, PCIe 5
        Accelerator("h200", 989e12, 4.8e12, 140 * GiB, 450e9, 55e9),  # 141 GB (140 GiB usable)
        Accelerator("a100-80gb", 312e12, 2.0e12, 80 * GiB, 300e9, 25e9),  # SXM4, NVLink 3, PCIe 4
    )
}

# P -> D KV transfer paths: (bytes/s, seconds per transfer). None: the accelerator's own link.
INTERCONNECTS: dict[str, tuple[float | None, float]] = {
    "nvlink": (None, 10e-6),  # same node, device to device
    "rdma": (50e9, 20e-6),  # 400 Gb/s InfiniBand / RoCE per device, across nodes
    "pcie": (0.0, 10e-6),  # bounced through the host (0.0: the accelerator's host link)
}


def get_accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}"
        ) from None


def roofline(
    accelerator: str | Accelerator,
    model: str | ModelShape,
    tp: int = 1,
    interconnect: str = "nvlink",
    dtype_bytes: int = 2,
    gpu_memory_utilization: float = 0.9,
    activation_reserve: int = 2 * GiB,
    host_memory: int = 32 * GiB,
    max_num_batched_tokens: int = 2048,
    step_overhead: float | None = None,
) -> CostModel:
    """step = overhead + the sum, over three kernel groups run one after the other, of
    max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth):

    linear layers:      FLOPs 2 * params * (prefill tokens + decode seqs); bytes: the weights
    prefill attention:  FLOPs 4 * layers * heads * head_dim * prefill pairs (QK^T and PV);
                        bytes: each new token's KV written (a chunk's KV reads are left out:
                        it is compute-bound long before they matter)
    decode attention:   FLOPs 4 * layers * heads * head_dim * decode context; bytes: the KV
                        read (decode context) and written (one token per sequence).
    Decodes riding a prefill chunk share its weight reads (one linear term) but not its
    attention kernels: that is what a mixed step costs.

    A mixture of experts holds every parameter in memory (weights, and so the KV pool), but
    its GEMM FLOPs follow the active parameters and its linear layers read the dense weights
    plus the experts the step's tokens touch (sim/moe.py)."""
    acc = get_accelerator(accelerator) if isinstance(accelerator, str) else accelerator
    shape = get_shape(model) if isinstance(model, str) else model
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    if interconnect not in INTERCONNECTS:
        raise ValueError(
            f"unknown interconnect {interconnect!r}; known: {', '.join(INTERCONNECTS)}"
        )
    flops = acc.peak_flops * acc.flops_efficiency * tp
    bandwidth = acc.hbm_bandwidth * acc.bandwidth_efficiency * tp
    weights = shape.num_params * dtype_bytes
    experts = shape.expert_params * dtype_bytes
    kv_bytes = kv_bytes_per_token(shape, dtype_bytes)
    gemm = 2 * shape.active_params / flops
    attn = 4 * shape.num_layers * shape.num_attention_heads * shape.head_dim / flops
    kv = kv_bytes / bandwidth
    free = acc.memory_bytes * tp * gpu_memory_utilization - weights - activation_reserve * tp
    if free < kv_bytes * max_num_batched_tokens:
        raise ValueError(
            f"{shape.name} ({weights / GiB:.0f} GiB of weights) leaves no room for KV on "
            f"{tp} x {acc.name} ({acc.memory_bytes * tp / GiB:.0f} GiB): raise --tp"
        )
    link, latency = INTERCONNECTS[interconnect]
    link = acc.link_bandwidth if link is None else (link or acc.host_bandwidth)
    overhead = acc.step_overhead if step_overhead is None else step_overhead
    info = {
        "accelerator": {k: getattr(acc, k) for k in acc.__slots__},
        "model_shape": shape.name,
        "tensor_parallel": tp,
        "interconnect": interconnect,
        "dtype_bytes": dtype_bytes,
        "weight_bytes": weights,
        "gpu_memory_utilization": gpu_memory_utilization,
        "activation_reserve_bytes": activation_reserve,
        "achievable_flops": flops,
        "achievable_bandwidth": bandwidth,
    }
    # (const, prefill tokens, prefill pairs, decode seqs, decode context)
    terms: dict[str, dict[str, tuple[float, ...]]] = {
        "linear": {
            "compute": (0.0, gemm, 0.0, gemm, 0.0),
            "memory": ((weights - experts) / bandwidth, 0.0, 0.0, 0.0, 0.0),
        }
        | (
            {"experts": (shape.num_experts, shape.num_experts_per_tok, experts / bandwidth)}
            if shape.num_experts
            else {}
        ),
        "prefill_attention": {
            "compute": (0.0, 0.0, attn, 0.0, 0.0),
            "memory": (0.0, kv, 0.0, 0.0, 0.0),
        },
        "decode_attention": {
            "compute": (0.0, 0.0, 0.0, 0.0, attn),
            "memory": (0.0, 0.0, 0.0, kv, kv),
        },
    }
    return CostModel(
        "roofline",
        overhead,
        terms,
        kv_bytes_per_token=kv_bytes,
        kv_capacity_tokens=int(free // kv_bytes),
        host_kv_capacity_tokens=int(host_memory * tp // kv_bytes),
        host_bandwidth=acc.host_bandwidth * tp,
        link_bandwidth=link * tp,
        link_latency=latency,
        max_num_batched_tokens=max_num_batched_tokens,
        info=info,
    )


def load_cost_model(path_or_name: str) -> CostModel:
    """A profile JSON path, or `accelerator:model-shape` (e.g. h100:llama-3-8b) for a roofline."""
    if Path(path_or_name).exists() or path_or_name.endswith(".json"):
        return CostModel.load(path_or_name)
    accel, sep, shape = path_or_name.partition(":")
    if not sep:
        raise ValueError(
            f"{path_or_name!r}: expected a profile .json or accelerator:model-shape "
            "(h100:llama-3-8b)"
        )
    return roofline(accel, shape)
