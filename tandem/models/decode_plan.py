"""A decode-only step of a Llama-family model with quantised linears on CPU, as one loop of
prebound native calls: the CPU's stand-in for a captured CUDA graph.

At batch 1 each layer streams its weights through the caches, so the Python between two GEMMs
runs cold. Through the modules a layer makes ~66 Python calls (nn.Module dispatch, the checks
that pick a path, the helpers between); the plan makes ~13, chosen once when it is built. The
calls and their arguments are the ones the modules make on such a step, so the hidden states
are the modules' bit for bit. `build` returns None where a layer would take another path
(another layer kind, QK-norm, a bias, a float or batch-invariant linear, no native fused ops)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.kernels import cpu_fused_ops
from tandem.models.layers import Gate
from tandem.models.llama import DecoderLayer, LlamaForCausalLM
from tandem.models.quantization import IntegerKernelLayer, RowParts

Gemm = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """One decoder layer's calls: its two norms' weights, its GEMMs and its attention backend's
    fused decode (forward_qkv)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: Gemm
    o: Gemm
    gate_up_act: Gemm
    down: Gemm
    attend: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]  # forward_qkv: not None once decodes_qkv
    rotated_heads: int  # q and k heads, the ones RoPE turns
    head_dim: int


def _gemm(layer: nn.Module, gate: Gate | None = None) -> Gemm | None:
    """The call a quantised layer on the integer kernel makes for a 2-D contiguous x (with the
    gate_up's activation-and-mul where its forward_gated makes it); None: not such a layer."""
    if not isinstance(layer, IntegerKernelLayer) or not layer.int8_act or layer.bias is not None:
        return None
    if gate is not None and (isinstance(layer, RowParts) or layer.out_features % 32):  # forward_gated's other branch
        return functools.partial(_gate_after, functools.partial(layer._int8_act, gate=0), gate)
    return functools.partial(layer._int8_act, gate=int(gate) if gate else 0)


def _gate_after(gemm: Gemm, gate: Gate, x: torch.Tensor) -> torch.Tensor:
    return gate(gemm(x))


class DecodePlan:
    """Every layer's calls, in order; `run` is the model's forward for the steps it takes."""

    def __init__(self, model: LlamaForCausalLM, layers: list[LayerPlan]) -> None:
        # the model's parts, not the model: it holds the plan
        self.embed_tokens, self.rotary, self.layers = model.embed_tokens, model.rotary, layers
        self.backend = model.layers[0].self_attn.attn
        self.ext, self.eps = cpu_fused_ops(), model.norm.eps

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> DecodePlan | None:
        if type(model) is not LlamaForCausalLM or model.cfg.qk_norm or model.norm.weight.device.type != "cpu":
            return None
        if cpu_fused_ops() is None:
            return None
        layers = []
        for layer in model.layers:
            if type(layer) is not DecoderLayer:
                return None
            attn, mlp = layer.self_attn, layer.mlp
            gemms = (_gemm(attn.qkv_proj), _gemm(attn.o_proj), _gemm(mlp.gate_up_proj, mlp.gate),
                     _gemm(mlp.down_proj))
            if None in gemms:
                return None
            if {layer.input_layernorm.eps, layer.post_attention_layernorm.eps} != {model.norm.eps}:
                return None
            layers.append(LayerPlan(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *gemms,
                                    attn.attn.forward_qkv, attn.nq + attn.nkv, attn.hd))
        return cls(model, layers)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: Any) -> torch.Tensor | None:
        """The model's forward on a decode-only step whose attention takes the fused decode;
        None: not such a step (run the modules)."""
        if isinstance(meta, list) or not self.backend.decodes_qkv(meta, input_ids.shape[0]):
            return None
        ext, eps = self.ext, self.eps
        x = self.embed_tokens(input_ids)
        table = self.rotary(positions, x.dtype).table
        residual = None
        for plan, kv_cache in zip(self.layers, kv_caches):
            if residual is None:
                residual, h = x, ext.rms_norm(x, plan.input_norm, eps)
            else:
                residual, h = ext.add_rms_norm(x, residual, plan.input_norm, eps)
            qkv = plan.qkv(h)
            ext.rope_(qkv, positions, table, plan.rotated_heads, plan.head_dim)
            residual, h = ext.add_rms_norm(plan.o(plan.attend(qkv, kv_cache, meta)), residual,
                                           plan.post_attention_norm, eps)
            x = plan.down(plan.gate_up_act(h))
        return residual + x
