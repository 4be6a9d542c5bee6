"""A decoder layer's step, written once, over plain callables bound once.

A layer declares which module serves each op of its step (its `bind(binder)`); a binder turns
that into a `DecoderOps`. `ModuleOps` binds the modules' own forwards (any step, any device),
which look their linear up at each call: the builder replaces linears after the layer is made.
The decode plan (models/decode_plan.py) binds the same declaration to prebound native calls, so
its steps are the modules' bit for bit: the calls and their order are this one `step`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from tandem.models.layers.activation import Gate
from tandem.models.layers.layernorm import add_rms_norm, rms_norm
from tandem.models.layers.rotary_embedding import RotaryEmbedding, StepRope

Gemm = Callable[[torch.Tensor], torch.Tensor]


class NormWeights(NamedTuple):
    """A layer's RMSNorm weights: before the attention and before the MLP (after the residual
    add); Gemma's also on the attention's and the MLP's outputs."""

    input: torch.Tensor
    mlp_input: torch.Tensor
    after_attention: torch.Tensor | None = None
    after_mlp: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class DecoderOps:
    """One pre-norm decoder layer's step and the callables it makes."""

    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps)
    # (x, residual, weight, eps) -> (residual + x, its norm)
    add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    eps: float
    norms: NormWeights
    qkv: Gemm
    attend: Callable[..., torch.Tensor]  # (qkv, rope, kv_cache, meta): QK-norm, RoPE, attention
    o: Gemm
    rope: int  # which of the model's RoPE tables this layer turns by (its `rotaries()`)
    gate_up: Gemm | None = None  # act(gate) * up of the [gate | up] projection
    down: Gemm | None = None
    moe: Gemm | None = None  # a sparse layer's MoE block, in the MLP's place (layers/fused_moe.py)

    def step(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: StepRope,
        kv_cache: torch.Tensor,
        meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the add of the two is left
        to the next layer's input norm (one fused add + norm, vLLM's residual passing).
        `residual` None: x is the embedding (the first layer)."""
        norms, eps = self.norms, self.eps
        if residual is None:
            residual, h = x, self.norm(x, norms.input, eps)
        else:
            residual, h = self.add_norm(x, residual, norms.input, eps)
        out = self.o(self.attend(self.qkv(h), rope, kv_cache, meta))
        if norms.after_attention is not None:
            out = self.norm(out, norms.after_attention, eps)
        residual, h = self.add_norm(out, residual, norms.mlp_input, eps)
        x = self.down(self.gate_up(h)) if self.moe is None else self.moe(h)
        if norms.after_mlp is not None:
            x = self.norm(x, norms.after_mlp, eps)
        return x, residual


class OpBinder(Protocol):
    """What a layer's `bind` asks: the norm calls, one call per linear, and its attention's."""

    norm: Callable[..., torch.Tensor]
    add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def gemm(self, parent: nn.Module, name: str, gate: Gate | None = None) -> Gemm:
        """The call of linear `name` of `parent`; with `gate`, act(gate) * up of its output."""
        ...

    def attention(self, attention: nn.Module) -> Callable[..., torch.Tensor]:
        """The call of an attention module's `attend`."""
        ...


class ModuleOps:
    """Binds the modules' own forwards: each linear is looked up in its parent at the call."""

    norm = staticmethod(rms_norm)
    add_norm = staticmethod(add_rms_norm)

    @staticmethod
    def gemm(parent: nn.Module, name: str, gate: Gate | None = None) -> Gemm:
        if gate is None:
            return functools.partial(_forward, parent._modules, name)
        return functools.partial(_forward_gated, parent._modules, name, gate)

    @staticmethod
    def attention(attention: nn.Module) -> Callable[..., torch.Tensor]:
        return attention.attend


def _forward(modules: dict[str, nn.Module], name: str, x: torch.Tensor) -> torch.Tensor:
    return modules[name].forward(x)


def _forward_gated(
    modules: dict[str, nn.Module], name: str, gate: Gate, x: torch.Tensor
) -> torch.Tensor:
    return modules[name].forward_gated(x, gate)


class DecodeRun(Protocol):
    """A model's stand-in forward for the steps it takes (the decode plan)."""

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: Any,
    ) -> torch.Tensor | None:
        """Hidden states, or None: not such a step (run the modules)."""
        ...


def run_layers(
    embed: Callable[[torch.Tensor], torch.Tensor],
    rotaries: list[RotaryEmbedding],
    layers: list[DecoderOps],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: Any,
) -> torch.Tensor:
    """The decoder stack: the embedding, each layer's step in turn, the last residual add;
    hidden states before the final norm, one row per input token."""
    x, residual = embed(input_ids), None
    ropes = [rotary(positions, x.dtype) for rotary in rotaries]
    for ops, kv_cache, layer_meta in zip(layers, kv_caches, per_layer(meta)):
        x, residual = ops.step(x, residual, ropes[ops.rope], kv_cache, layer_meta)
    return residual + x


def per_layer(meta: Any) -> Iterable[Any]:
    """A step's attention metadata for each layer in turn: a list holds one per layer (KV groups,
    core/kv_groups.py), anything else serves every layer."""
    return meta if isinstance(meta, list) else itertools.repeat(meta)
