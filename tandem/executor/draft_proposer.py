"""The draft-model proposer for speculative decoding: the target's own precision variant
(`self:int4`, `self:int8`, or the target's float weights, whose drafts the target accepts all
but always) proposes k tokens greedily after each step that samples.

A self-draft has the target's architecture, so it reads the target's paged KV for the context:
no draft prefill and no KV of its own. After a step samples a request's token at position P,
the draft runs k one-token forwards (batched over the drafting requests) at P .. P+k-1, writing
its KV into those positions' slots, which the scheduler allocated for this step past its own
positions (`SchedulerOutput.num_lookahead_tokens`); the verify step that follows writes the
target's KV over them, and rejected positions are written again later, as for n-gram drafts.
The drafts are one-hot (argmax), so the rejection sampler stays exact.

Another model (alias or path) cannot read the target's KV; it is checked for a vocabulary equal
to the target's and then refused in words: only self-drafts are served so far.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tandem.core.spec_decode import SpeculativeConfig
from tandem.executor.attention import build_attention_metadata
from tandem.models.builder import build_model, resolve_precision, weight_bytes
from tandem.models.llama import LlamaForCausalLM, ModelConfig
from tandem.models.loader import gguf_source, load_config, load_tokenizer, resolve_model
from tandem.models.variants import ModelVariants

log = logging.getLogger(__name__)


def build_draft_model(spec: SpeculativeConfig, engine_model: str, model_dir, cfg: ModelConfig,
                      variants: ModelVariants, device: torch.device, attention) -> LlamaForCausalLM:
    """The draft of `spec` (method "draft"): a variant the engine already holds, or a new one
    built in the engine's dtype (its weight bytes join `variants.weight_bytes` as draft:<p>)."""
    precision = spec.self_draft
    if precision is None:
        _refuse_external(spec.model, model_dir, cfg)
    if precision in variants.models:
        log.info("speculative draft self:%s: the engine's own %s variant (no extra weights)", precision, precision)
        return variants.models[precision]
    _, weights, dtype = resolve_precision(precision, variants.dtype, device)
    if dtype != variants.dtype:
        raise ValueError(f"speculative model self:{precision} computes in {dtype} but the engine's dtype is "
                         f"{variants.dtype}: a self-draft reads the target's KV, so it shares its dtype "
                         f"(use self:int4 or self:int8, whose activations are the engine's)")
    try:
        model = build_model(model_dir, cfg, weights, device, dtype, attention, gguf_source(engine_model))
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"speculative model self:{precision} cannot be built here: {e}") from e
    variants.weight_bytes[f"draft:{precision}"] = weight_bytes(model)
    log.info("weights of draft self:%s: %.1f MiB", precision, weight_bytes(model) / 2**20)
    return model


def _refuse_external(name: str, model_dir, cfg: ModelConfig) -> None:
    """A draft of another model: a vocabulary unlike the target's is refused as such; one alike
    is refused because its own KV layers are not built."""
    draft_dir = resolve_model(name)
    draft_cfg = ModelConfig.from_hf(load_config(draft_dir))
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"speculative model {name!r} has a vocabulary of {draft_cfg.vocab_size} tokens, the "
                         f"target's has {cfg.vocab_size}: a draft must share the target's tokenizer")
    ours, theirs = load_tokenizer(model_dir), load_tokenizer(draft_dir)
    if (ours is None) != (theirs is None) or (ours is not None and ours.get_vocab() != theirs.get_vocab()):
        raise ValueError(f"speculative model {name!r} has another tokenizer than the target's: "
                         "a draft must share the target's tokenizer")
    raise ValueError(f"speculative model {name!r}: only the target's own variants (self:int4, self:int8, "
                     "self:bf16) are served as drafts so far; another model would need KV layers of its own")


class DraftModelProposer:
    """k greedy one-token forwards of the draft over the target's paged KV (see the module)."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, decode_kernel, triton: bool) -> None:
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.decode_kernel, self.triton = decode_kernel, triton
        self.max_position = model.rotary.cos_sin.shape[0] - 1
        self.num_forwards, self.seconds = 0, 0.0  # draft forwards run and their time (bench spec's step costs)

    @torch.inference_mode()
    def propose(self, token_ids: list[list[int]], block_ids: list[list[int]], num_drafts: list[int]) -> list[list[int]]:
        """Per request (its tokens, the last one just sampled and not yet in the KV; its block
        ids, lookahead included; drafts wanted): the draft's greedy continuation."""
        start, dev = time.perf_counter(), self.device
        pos0 = np.array([len(t) - 1 for t in token_ids], dtype=np.int64)
        ks = np.minimum(np.array(num_drafts, dtype=np.int64), self.max_position - pos0 + 1)
        order = np.argsort(pos0, kind="stable")  # shortest context first: the decode buckets want it
        tables = np.zeros((len(order), max(len(block_ids[i]) for i in order)), dtype=np.int64)
        for row, i in enumerate(order):
            tables[row, :len(block_ids[i])] = block_ids[i]
        ids = torch.tensor([token_ids[i][-1] for i in order], dtype=torch.long, device=dev)
        drafts: list[torch.Tensor] = []
        rows = np.arange(len(order))
        for step in range(int(ks.max(initial=0))):
            active = np.flatnonzero(ks[order] > step)
            if len(active) < len(rows):  # some requests want fewer drafts: the rest runs on
                ids = ids[torch.from_numpy(np.searchsorted(rows, active)).to(dev)]
                rows = active
            ids = self._forward(ids, pos0[order[rows]] + step, tables[rows])
            drafts.append((rows, ids))
        out = [[] for _ in token_ids]
        for rows_i, ids_i in drafts:
            for row, token in zip(rows_i.tolist(), ids_i.tolist()):
                out[int(order[row])].append(token)
        self.num_forwards += len(drafts)
        self.seconds += time.perf_counter() - start
        return out

    def _forward(self, ids: torch.Tensor, positions: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """One decode position per row: write the draft's KV there, return its argmax token."""
        bs, dev, b = self.block_size, self.device, len(positions)
        slots = tables[np.arange(b), positions // bs] * bs + positions % bs
        meta = build_attention_metadata(tables, positions + 1, np.ones(b, dtype=np.int64), slots, bs, dev,
                                        self.decode_kernel, self.triton)
        hidden = self.model(ids, torch.from_numpy(positions).to(dev), self.kv_caches, meta)
        return self.model.compute_logits(hidden).argmax(dim=-1)
