"""The Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3) over flattened
variable-length batches with a paged KV cache; Mistral's and Qwen's sliding windows are the
layers' (ModelConfig.layer_windows).

The attention backend is given to the model (the model runner passes executor/attention.py's):
how K/V are cached and attended, and the per-step metadata that says where, belong to the
executor; the model only projects, rotates and passes them on."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from tandem.models.config import ModelConfig
from tandem.models.layers.activation import Gate
from tandem.models.layers.decoder_ops import (
    DecoderOps,
    DecodeRun,
    Gemm,
    ModuleOps,
    NormWeights,
    OpBinder,
    run_layers,
)
from tandem.models.layers.layernorm import RMSNorm, fused_ops_for
from tandem.models.layers.linear import Linear, can_pack_cpu, cpu_packed_linear, pack_cpu_weight
from tandem.models.layers.rotary_embedding import RotaryEmbedding, StepRope

# Our fused linears and the checkpoint tensors they hold, in row order (Mixtral's experts name
# theirs w1, w3).
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "w13": ("w1", "w3"),
}


class AttentionBackend(Protocol):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: Any
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]: write k, v into kv_cache where `meta` says, attend,
        return [T, Hq * D]. `meta` is the backend's own per-step metadata."""
        ...

    def forward_qkv(
        self, qkv: torch.Tensor, kv_cache: torch.Tensor, meta: Any
    ) -> torch.Tensor | None:
        """The same from the fused projection qkv [T, (Hq + 2 Hkv) D] (RoPE applied) in one
        call, where the backend has such a path for this step; else None."""
        ...

    def decodes_qkv(self, meta: Any, rows: int) -> bool:
        """Whether forward_qkv runs a step of `rows` rows with this metadata (given a contiguous
        qkv)."""
        ...


# (num_heads, num_kv_heads, head_dim, scale, sliding_window) -> one layer's backend; scale None:
# head_dim ** -0.5; sliding_window None: the whole context
AttentionFactory = Callable[[int, int, int, float | None, int | None], AttentionBackend]


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, attention: AttentionFactory, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.nq, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, (self.nq + 2 * self.nkv) * self.hd, bias=cfg.qkv_bias
        )
        self.o_proj = Linear(self.nq * self.hd, cfg.hidden_size)
        self.qk_norm = None  # qk_rms_norm_'s q / k weights, heads, head_dim and eps
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.qk_norm = (
                self.q_norm.weight,
                self.k_norm.weight,
                self.nq,
                self.nkv,
                self.hd,
                cfg.rms_norm_eps,
            )
        self.attn = attention(self.nq, self.nkv, self.hd, cfg.attn_scale, sliding_window)

    def attend(
        self, qkv: torch.Tensor, rope: StepRope, kv_cache: torch.Tensor, meta: Any
    ) -> torch.Tensor:
        """QK-norm, RoPE and attention on the fused projection qkv: in place with the native
        kernels where they serve qkv (`attend_native`, the decode plan's call), else on its
        split."""
        ext = fused_ops_for(qkv)
        if ext is not None:
            out = attend_native(
                ext,
                self.attn.forward_qkv,
                self.qk_norm,
                self.nq + self.nkv,
                self.hd,
                qkv,
                rope,
                kv_cache,
                meta,
            )
            if out is not None:
                return out
        t = qkv.shape[0]
        q, k, v = qkv.split([self.nq * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        q, k, v = (
            q.view(t, self.nq, self.hd),
            k.view(t, self.nkv, self.hd),
            v.view(t, self.nkv, self.hd),
        )
        if ext is None:  # else normed and turned in place above
            if self.qk_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope.rotate(q), rope.rotate(k)
        return self.attn.forward(q, k, v, kv_cache, meta)

    def prebound(self, ext) -> Callable[..., torch.Tensor | None]:
        """`attend` on the native kernels with its arguments bound once (the decode plan's)."""
        return functools.partial(
            attend_native, ext, self.attn.forward_qkv, self.qk_norm, self.nq + self.nkv, self.hd
        )


def attend_native(
    ext,
    forward_qkv: Callable[..., torch.Tensor | None],
    qk_norm: tuple | None,
    heads: int,
    head_dim: int,
    qkv: torch.Tensor,
    rope: StepRope,
    kv_cache: torch.Tensor,
    meta: Any,
) -> torch.Tensor | None:
    """QK-norm and RoPE in place on qkv with the native kernels, then the backend's attention on
    it (`forward_qkv`: None where this step is not one it runs)."""
    if qk_norm is not None:
        ext.qk_rms_norm_(qkv, *qk_norm)
    ext.rope_(qkv, rope.positions, rope.table, heads, head_dim)
    return forward_qkv(qkv, kv_cache, meta)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, gate: Gate) -> None:
        super().__init__()
        self.gate = gate
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)


class DecoderLayer(nn.Module):
    gate: Gate = Gate.SILU

    def __init__(
        self, cfg: ModelConfig, attention: AttentionFactory, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.rope = 0  # which of the model's rotaries() the layer turns by
        self.self_attn = Attention(cfg, attention, sliding_window)
        self.mlp = MLP(cfg, self.gate)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def norm_weights(self) -> NormWeights:
        return NormWeights(self.input_layernorm.weight, self.post_attention_layernorm.weight)

    def bind(self, bind: OpBinder) -> DecoderOps:
        """This layer's step (layers/decoder_ops.py), each op served by the module named here and
        bound by `bind`: ModuleOps for the modules' forwards, or the decode plan's binder."""
        attn = self.self_attn
        return DecoderOps(
            bind.norm,
            bind.add_norm,
            self.input_layernorm.eps,
            self.norm_weights(),
            qkv=bind.gemm(attn, "qkv_proj"),
            attend=bind.attention(attn),
            o=bind.gemm(attn, "o_proj"),
            rope=self.rope,
            **self.bind_mlp(bind),
        )

    def bind_mlp(self, bind: OpBinder) -> dict[str, Gemm]:
        """The MLP's ops of the step (a sparse layer binds its MoE block instead)."""
        mlp = self.mlp
        return dict(
            gate_up=bind.gemm(mlp, "gate_up_proj", mlp.gate), down=bind.gemm(mlp, "down_proj")
        )


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionFactory) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            self.decoder_layer(cfg, attention, i) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_context_len, cfg.rope_theta, cfg.rope_scaling
        )
        self.packed_lm_head: torch.Tensor | None = None
        self.layer_ops = [layer.bind(ModuleOps) for layer in self.layers]
        # a decode-only step as prebound native calls (models/decode_plan.py), set by the builder
        self.decode_plan: DecodeRun | None = None

    @staticmethod
    def decoder_layer(cfg: ModelConfig, attention: AttentionFactory, index: int) -> DecoderLayer:
        """Layer `index` of the stack, with its sliding window if it has one (a subclass builds
        its own kind)."""
        return DecoderLayer(cfg, attention, cfg.layer_windows[index] if cfg.layer_windows else None)

    def embedding(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The input embedding as a callable that holds its parts, not the model."""
        return self.embed_tokens

    def rotaries(self) -> list[RotaryEmbedding]:
        """The RoPE tables the layers turn by (a layer's `rope` indexes them)."""
        return [self.rotary]

    def pack_for_cpu(self) -> bool:
        """bf16 on CPU: pre-pack every GEMM weight for oneDNN. Returns whether it did."""
        if not can_pack_cpu(self.embed_tokens.weight):
            return False
        for module in self.modules():
            if isinstance(module, Linear) and module is not self.lm_head:
                module.pack_for_cpu()
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_lm_head = pack_cpu_weight(head.data)
        return True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: Any,
    ) -> torch.Tensor:
        """Hidden states before the final norm (compute_logits applies it), one row per input token.
        `meta`: the attention metadata of every layer, or a list of one per layer."""
        plan = self.decode_plan
        if (
            plan is not None
            and (hidden := plan.run(input_ids, positions, kv_caches, meta)) is not None
        ):
            return hidden
        return self.forward_modules(input_ids, positions, kv_caches, meta)

    def forward_modules(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: Any,
    ) -> torch.Tensor:
        """The forward through the layers' modules (any step; `forward` without a plan)."""
        return run_layers(
            self.embedding(), self.rotaries(), self.layer_ops, input_ids, positions, kv_caches, meta
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Only the rows that need a token pass the final norm and the LM head; fp32 logits."""
        hidden = self.norm(hidden)
        if self.packed_lm_head is not None:
            return cpu_packed_linear(hidden, self.packed_lm_head, None).float()
        if self.lm_head is not None:  # untied, or a quantised copy of the tied embedding
            return self.lm_head(hidden).float()
        return torch.nn.functional.linear(hidden, self.embed_tokens.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up as they arrive."""
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        fused = {p: (new, i) for new, parts in FUSED_PARTS.items() for i, p in enumerate(parts)}
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            parts = name.split(".")
            target, index = name, None
            for i, p in enumerate(parts):
                if p in fused:
                    new, index = fused[p]
                    target = ".".join(parts[:i] + [new] + parts[i + 1 :])
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} for a {cfg.model_type} model")
            dst = param.data
            if index is not None:  # q, k, v by heads; a gate / up pair (an MLP's, expert's) halves
                sizes = [q, kv, kv] if new == "qkv_proj" else [dst.shape[0] // 2] * 2
                dst = dst.narrow(0, sum(sizes[:index]), sizes[index])
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            if (
                index is None
                and (tensor.dtype, tensor.device) == (dst.dtype, dst.device)
                and tensor.is_contiguous()
            ):
                param.data = (
                    tensor  # taken as it is: a large embedding is not held twice while copied
                )
            else:
                dst.copy_(tensor)
            loaded.add(name)
        expected = {n for n in params}
        got = set()
        for n in loaded:
            parts = n.split(".")
            for i, p in enumerate(parts):
                if p in fused:
                    parts[i] = fused[p][0]
            got.add(".".join(parts))
        missing = expected - got
        if missing:
            raise ValueError(
                f"checkpoint is missing weights: {sorted(missing)[:5]}"
                f"{' ...' if len(missing) > 5 else ''}"
            )
