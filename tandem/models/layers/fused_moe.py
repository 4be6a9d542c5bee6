"""A sparse mixture-of-experts block, in a decoder layer's MLP place: a float router picks each
token's top-k experts (softmax, then renormalised over the k where the model says), each chosen
expert's gated MLP runs once over the tokens that chose it, and every token sums its experts'
outputs weighted by the router; a shared expert (Qwen2-MoE) adds its output scaled by a sigmoid
gate.

The experts are gated MLPs of ordinary linears, so the builder serves each one as it serves any
linear (float, int8, or int4 / Q6_K / Q8_0 from a GGUF's own blocks, expert by expert), and a
step reads only the experts its tokens chose. Where every expert runs on the integer kernel, all
of them run in one native call (the kernel's `experts`: each token's activations quantised once,
the tokens grouped by expert, the weighting and sum in it); else expert after expert here.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tandem.kernels import cpu_quant_gemm
from tandem.models.layers.activation import Gate
from tandem.models.layers.linear import Linear
from tandem.models.quantization.base import IntegerKernelLayer


class Expert(nn.Module):
    """One gated MLP: act(gate) * up of the fused [gate | up] projection, then down; the two
    linears named as the checkpoint names the expert's tensors (Qwen's gate_up_proj / down_proj,
    Mixtral's w13 / w2)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        names: tuple[str, str] = ("gate_up_proj", "down_proj"),
    ) -> None:
        super().__init__()
        self.gate_up_name, self.down_name = names
        self.add_module(names[0], Linear(hidden_size, 2 * intermediate_size))
        self.add_module(names[1], Linear(intermediate_size, hidden_size))

    def forward(self, x: torch.Tensor, act: Gate) -> torch.Tensor:
        linears = self._modules  # looked up at the call: the builder replaces the linears
        return linears[self.down_name].forward(linears[self.gate_up_name].forward_gated(x, act))


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]): the top-k of the router's fp32 softmax, divided by
    their sum where `renormalize`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """The sparse block: `gate` the router, `experts` the routed experts, and for Qwen2-MoE
    `shared_expert` with its one-output `shared_expert_gate` (the checkpoint's names)."""

    # kept in float in every variant: a quantised router picks other experts (llama.cpp's
    # quantiser leaves them F32 too)
    ROUTERS = ("gate", "shared_expert_gate")

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        act: Gate,
        shared_expert_size: int = 0,
        expert_names: tuple[str, str] = ("gate_up_proj", "down_proj"),
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.act = top_k, renormalize, act
        self.gate = Linear(hidden_size, num_experts)
        self.experts = nn.ModuleList(
            Expert(hidden_size, intermediate_size, expert_names) for _ in range(num_experts)
        )
        self.shared_expert: Expert | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_expert_size:
            self.shared_expert = Expert(hidden_size, shared_expert_size)
            self.shared_expert_gate = Linear(hidden_size, 1)
        # the native call with every expert's tables bound, or False; found at the first forward,
        # once the builder has put the served linears in
        self._native: functools.partial | bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.run_experts(x, weights.to(x.dtype), ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x, self.act)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out

    def native_experts(self) -> functools.partial | bool:
        """The kernel's `experts` bound to every expert's tables, where each expert's gate_up
        applies its gate in the kernel and its down runs on it as one table; else False."""
        ext = cpu_quant_gemm()
        gate_ups, downs = [], []
        for expert in self.experts:
            gate_up, down = expert._modules[expert.gate_up_name], expert._modules[expert.down_name]
            if not (
                ext is not None
                and isinstance(gate_up, IntegerKernelLayer)
                and isinstance(down, IntegerKernelLayer)
                and gate_up.gates_in_kernel
                and down.int8_act
                and down.bias is None
                and len(gate_up.gemm_weights) == len(down.gemm_weights) == 1
            ):
                return False
            gate_ups += gate_up.gemm_weights
            downs += down.gemm_weights
        return functools.partial(ext.experts, gate_up=gate_ups, down=downs, gate=int(self.act))

    def run_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """All in the native call where it serves (see native_experts), else `loop_experts`."""
        if self._native is None:
            self._native = self.native_experts()
        if self._native and x.dim() == 2:
            return self._native(x.contiguous(), ids, weights.contiguous())
        return self.loop_experts(x, weights, ids)

    def loop_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Each chosen expert once over the rows that chose it (the choices grouped by a stable
        sort), its outputs times their weights added into those rows, expert after expert."""
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        chosen, counts = torch.unique_consecutive(flat[order], return_counts=True)
        rows, weights = order // self.top_k, weights.flatten()[order, None]
        out = torch.zeros_like(x)
        experts = self.experts
        start = 0
        for expert, n in zip(chosen.tolist(), counts.tolist()):
            taken = rows[start : start + n]
            y = experts[expert](x[taken], self.act)
            out.index_add_(0, taken, y * weights[start : start + n])
            start += n
        return out
