"""A decode-only step of a model whose linears all run on CPU's integer kernel, as one loop of
prebound native calls: the CPU's stand-in for a captured CUDA graph.

At batch 1 each layer streams its weights through the caches, so the Python between two GEMMs
runs cold. Through the modules a Llama layer makes ~66 Python calls (nn.Module dispatch, the
checks that pick a path, the helpers between); the plan makes the native calls, bound once.
The plan is derived, not written: each layer's own declaration (its `bind`) is bound here to the
native calls the modules make on such a step, and run by the same step (layers/decoder_ops.py),
so the hidden states are the modules' bit for bit. `build` returns None where a layer would take
another path (a bias, a float or batch-invariant linear, a model off the CPU, no native fused
ops).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tandem.kernels import cpu_fused_ops
from tandem.models.layers.activation import Gate
from tandem.models.layers.decoder_ops import DecoderOps, Gemm, per_layer, run_layers
from tandem.models.layers.rotary_embedding import RotaryEmbedding
from tandem.models.quantization.base import IntegerKernelLayer


class NotNative(Exception):
    """A layer's op has no prebound native call: the model gets no plan."""


class NativeOps:
    """Binds a layer's ops to the native calls its modules make on a decode step."""

    def __init__(self, ext) -> None:
        self.ext, self.norm, self.add_norm = ext, ext.rms_norm, ext.add_rms_norm
        # each attention's decodes_qkv, in layer order
        self.decodes: list[Callable[[Any, int], bool]] = []

    @staticmethod
    def gemm(parent: nn.Module, name: str, gate: Gate | None = None) -> Gemm:
        """The call a quantised layer on the integer kernel makes for a 2-D contiguous x (with the
        gate_up's activation-and-mul where its forward_gated makes it)."""
        layer = parent._modules[name]
        if (
            not isinstance(layer, IntegerKernelLayer)
            or not layer.int8_act
            or layer.bias is not None
        ):
            raise NotNative(name)
        if gate is not None and not layer.gates_in_kernel:  # as forward_gated: after the GEMM
            return functools.partial(_gate_after, layer.prebound(0), gate)
        return layer.prebound(int(gate) if gate else 0)

    def attention(self, attention: nn.Module) -> Callable[..., torch.Tensor]:
        self.decodes.append(attention.attn.decodes_qkv)
        return attention.prebound(self.ext)


def _gate_after(gemm: Gemm, gate: Gate, x: torch.Tensor) -> torch.Tensor:
    return gate(gemm(x))


class DecodePlan:
    """Every layer's ops, bound natively; `run` is the model's forward for the steps it takes."""

    def __init__(
        self,
        embed: Callable[[torch.Tensor], torch.Tensor],
        rotaries: list[RotaryEmbedding],
        layers: list[DecoderOps],
        decodes: list[Callable[[Any, int], bool]],
    ) -> None:
        # the model's parts, not the model: it holds the plan
        self.embed, self.rotaries, self.layers, self.decodes = embed, rotaries, layers, decodes

    @classmethod
    def build(cls, model: nn.Module) -> DecodePlan | None:
        """The plan of a built model (its `layers`' `bind`, `embedding` and `rotaries`), or None."""
        ext = cpu_fused_ops()
        if ext is None or model.norm.weight.device.type != "cpu":
            return None
        bind = NativeOps(ext)
        try:
            layers = [layer.bind(bind) for layer in model.layers]
        except NotNative:
            return None
        return cls(model.embedding(), model.rotaries(), layers, bind.decodes)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: Any,
    ) -> torch.Tensor | None:
        """The model's forward on a decode-only step whose attention takes the fused decode;
        None: not such a step (run the modules)."""
        rows = input_ids.shape[0]
        metas = zip(self.decodes, per_layer(meta))
        if not all(decodes(layer_meta, rows) for decodes, layer_meta in metas):
            return None
        return run_layers(
            self.embed, self.rotaries, self.layers, input_ids, positions, kv_caches, meta
        )
