"""Mixture-of-experts models of the Llama family: Qwen3-MoE, Qwen2-MoE and Mixtral. The
attention, norms, embedding and head are Llama's (QK-norm for Qwen3-MoE, a q/k/v bias for
Qwen2-MoE); a sparse layer's MLP is a FusedMoE block (layers/fused_moe.py) under the checkpoint's
name for it (Mixtral's `block_sparse_moe`, whose experts name their linears w1 / w3 / w2), and a
Qwen model's layers that its config keeps dense have Llama's MLP."""

from __future__ import annotations

from tandem.models.architectures.llama import AttentionFactory, DecoderLayer, LlamaForCausalLM
from tandem.models.config import ModelConfig
from tandem.models.layers.decoder_ops import Gemm, OpBinder
from tandem.models.layers.fused_moe import FusedMoE


class MoEDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, attention: AttentionFactory, sparse: bool) -> None:
        super().__init__(cfg, attention)
        self.moe_name: str | None = None  # the sparse block's attribute; None: a dense layer
        moe = cfg.moe
        if not sparse or moe is None:
            return
        mixtral = cfg.model_type == "mixtral"
        del self.mlp  # the sparse block takes the dense MLP's place
        self.moe_name = "block_sparse_moe" if mixtral else "mlp"
        block = FusedMoE(
            cfg.hidden_size,
            moe.num_experts,
            moe.top_k,
            moe.intermediate_size,
            moe.renormalize,
            self.gate,
            moe.shared_expert_size,
            ("w13", "w2") if mixtral else ("gate_up_proj", "down_proj"),
        )
        self.add_module(self.moe_name, block)

    def bind_mlp(self, bind: OpBinder) -> dict[str, Gemm]:
        """A sparse layer's block runs as its own forward under every binder: its expert calls
        depend on the step's routing."""
        if self.moe_name is None:
            return super().bind_mlp(bind)
        return dict(moe=self._modules[self.moe_name].forward)


class MoEForCausalLM(LlamaForCausalLM):
    @staticmethod
    def decoder_layer(cfg: ModelConfig, attention: AttentionFactory, index: int) -> DecoderLayer:
        return MoEDecoderLayer(cfg, attention, cfg.moe is not None and cfg.moe.sparse_layers[index])
