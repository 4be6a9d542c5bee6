"""A decode-only step of a Llama-family or Gemma 3 model with quantised linears on CPU, as one loop of
prebound native calls: the CPU's stand-in for a captured CUDA graph.

At batch 1 each layer streams its weights through the caches, so the Python between two GEMMs
runs cold. Through the modules a Llama layer makes ~66 Python calls (nn.Module dispatch, the
checks that pick a path, the helpers between); the plan makes ~13, chosen once when it is built.
The calls and their arguments are the ones the modules make on such a step, so the hidden states
are the modules' bit for bit. Gemma 3's layers take the same loop with its differences: QK-norm,
a RoPE table for the sliding-window layers, the norms after the attention and the MLP, the
scaled embedding, and one attention metadata per layer. `build` returns None where a layer
would take another path (another layer kind, a bias, a float or batch-invariant linear, a norm
whose eps is not the final norm's, a model off the CPU, no native fused ops)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.kernels import cpu_fused_ops
from tandem.models.architectures.gemma3 import (
    Gemma3DecoderLayer, Gemma3ForCausalLM, scaled_embedding,
)
from tandem.models.layers.activation import Gate
from tandem.models.layers.layernorm import RMSNorm
from tandem.models.architectures.llama import DecoderLayer, LlamaForCausalLM, per_layer
from tandem.models.quantization.base import IntegerKernelLayer
from tandem.models.quantization.row_parts import RowParts

Gemm = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """One decoder layer's calls: the weights of its norms before the attention and before the
    MLP (after the residual add), its GEMMs and its attention backend's fused decode
    (forward_qkv)."""

    input_norm: torch.Tensor
    mlp_input_norm: torch.Tensor
    qkv: Gemm
    o: Gemm
    gate_up_act: Gemm
    down: Gemm
    attend: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]  # forward_qkv: not None once decodes_qkv
    decodes: Callable[[Any, int], bool]  # its backend's decodes_qkv
    rotated_heads: int  # q and k heads, the ones RoPE turns
    head_dim: int
    rope: int  # its RoPE table: 0 the model's, 1 Gemma's sliding-window (local) one
    qk_norm: tuple[torch.Tensor, torch.Tensor, int, int, float] | None  # qk_rms_norm_'s q / k weights, heads, eps
    # Gemma's norms of the attention's and the MLP's outputs (its pre_feedforward is mlp_input_norm)
    post_norms: tuple[torch.Tensor, torch.Tensor] | None


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


def _layer_plan(layer: nn.Module, eps: float) -> LayerPlan | None:
    """A Llama or Gemma 3 layer's calls; None where it would take another path."""
    if type(layer) not in (DecoderLayer, Gemma3DecoderLayer):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    gemms = (_gemm(attn.qkv_proj), _gemm(attn.o_proj), _gemm(mlp.gate_up_proj, mlp.gate), _gemm(mlp.down_proj))
    norms = [m for m in layer.modules() if isinstance(m, RMSNorm)]
    if None in gemms or {n.eps for n in norms} != {eps}:
        return None
    gemma = type(layer) is Gemma3DecoderLayer
    qk_norm = (attn.q_norm.weight, attn.k_norm.weight, attn.nq, attn.nkv, eps) if attn.qk_norm else None
    mlp_input = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
    post_norms = (layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight) if gemma else None
    return LayerPlan(layer.input_layernorm.weight, mlp_input.weight, *gemms, attn.attn.forward_qkv,
                     attn.attn.decodes_qkv, attn.nq + attn.nkv, attn.hd, int(gemma and layer.sliding), qk_norm,
                     post_norms)


class DecodePlan:
    """Every layer's calls, in order; `run` is the model's forward for the steps it takes."""

    def __init__(self, model: LlamaForCausalLM, layers: list[LayerPlan]) -> None:
        # the model's parts, not the model: it holds the plan
        gemma = type(model) is Gemma3ForCausalLM
        self.embed = (functools.partial(scaled_embedding, model.embed_tokens, model.cfg.hidden_size) if gemma
                      else model.embed_tokens)
        self.rotaries = (model.rotary, model.rotary_local) if gemma else (model.rotary,)
        self.layers = layers
        self.ext, self.eps = cpu_fused_ops(), model.norm.eps

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> DecodePlan | None:
        if type(model) not in (LlamaForCausalLM, Gemma3ForCausalLM) or model.norm.weight.device.type != "cpu":
            return None
        if cpu_fused_ops() is None:
            return None
        layers = [_layer_plan(layer, model.norm.eps) for layer in model.layers]
        return None if None in layers else cls(model, layers)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: Any) -> torch.Tensor | None:
        """The model's forward on a decode-only step whose attention takes the fused decode;
        None: not such a step (run the modules)."""
        rows = input_ids.shape[0]
        metas = list(zip(self.layers, per_layer(meta)))
        if not all(plan.decodes(layer_meta, rows) for plan, layer_meta in metas):
            return None
        ext, eps = self.ext, self.eps
        x = self.embed(input_ids)
        tables = [rotary(positions, x.dtype).table for rotary in self.rotaries]
        residual = None
        for (plan, layer_meta), kv_cache in zip(metas, kv_caches):
            if residual is None:
                residual, h = x, ext.rms_norm(x, plan.input_norm, eps)
            else:
                residual, h = ext.add_rms_norm(x, residual, plan.input_norm, eps)
            qkv = plan.qkv(h)
            if plan.qk_norm is not None:
                q_weight, k_weight, q_heads, k_heads, qk_eps = plan.qk_norm
                ext.qk_rms_norm_(qkv, q_weight, k_weight, q_heads, k_heads, plan.head_dim, qk_eps)
            ext.rope_(qkv, positions, tables[plan.rope], plan.rotated_heads, plan.head_dim)
            out = plan.o(plan.attend(qkv, kv_cache, layer_meta))
            if plan.post_norms is None:
                residual, h = ext.add_rms_norm(out, residual, plan.mlp_input_norm, eps)
                x = plan.down(plan.gate_up_act(h))
            else:
                after_attention, after_mlp = plan.post_norms
                residual, h = ext.add_rms_norm(ext.rms_norm(out, after_attention, eps), residual,
                                               plan.mlp_input_norm, eps)
                x = ext.rms_norm(plan.down(plan.gate_up_act(h)), after_mlp, eps)
        return residual + x
