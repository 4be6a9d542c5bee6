"""The draft-model proposer for speculative decoding: k tokens proposed greedily after each step
that samples, by the target's own precision variant (`self:int4`, `self:int8`, or the target's
float weights, whose drafts the target accepts all but always) or by another model that shares
the target's tokenizer (an alias or a path: a smaller model of the family, a copy truncated to
its first layers).

A self-draft has the target's architecture, so it reads the target's paged KV for the context:
no draft prefill and no KV of its own. After a step samples a request's token at position P,
the draft runs k one-token forwards (batched over the drafting requests) at P .. P+k-1, writing
its KV into those positions' slots, which the scheduler allocated for this step past its own
positions (`SchedulerOutput.num_lookahead_tokens`); the verify step that follows writes the
target's KV over them, and rejected positions are written again later, as for n-gram drafts.

Another model keeps KV of its own layers, in a cache of its own with the target's slots: one
allocator and one block table serve both (the engine's KV budget pays for both per block), so
preemption, swap and freeing stay the target's. Its KV is valid for the positions whose tokens
it was fed: the known ones, and the drafts it fed after them as far as the target accepted them.
Before drafting, it catches up in the same forward on what it has not seen (the prompt on the
first proposal, a prefix hit, the tokens of steps that did not draft, a P/D handoff); after a
preemption it starts again from position 0.
The drafts are one-hot (argmax), so the rejection sampler stays exact.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from tandem.core.spec_decode import SpeculativeConfig
from tandem.executor.attention import build_attention_metadata
from tandem.kernels import cpu_paged_decode
from tandem.models.builder import build_model, resolve_precision, weight_bytes
from tandem.models.llama import LlamaForCausalLM, ModelConfig
from tandem.models.loader import gguf_source, load_config, load_tokenizer, resolve_model
from tandem.models.variants import ModelVariants

log = logging.getLogger(__name__)


def build_draft_model(spec: SpeculativeConfig, engine_model: str, model_dir, cfg: ModelConfig,
                      variants: ModelVariants, device: torch.device, attention) -> LlamaForCausalLM:
    """The draft of `spec` (method "draft"): a variant the engine already holds, a new one built in
    the engine's dtype, or another model sharing the tokenizer (its weight bytes join
    `variants.weight_bytes` as draft:<p> or draft:<model>)."""
    precision = spec.self_draft
    if precision is None:
        return _external_draft(spec.model, model_dir, cfg, variants, device, attention)
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


def _external_draft(name: str, model_dir, cfg: ModelConfig, variants: ModelVariants, device: torch.device,
                    attention) -> LlamaForCausalLM:
    """Another model as the draft, in the engine's dtype, once its vocabulary and tokenizer are
    the target's (a draft's token ids must mean the target's tokens)."""
    draft_dir = resolve_model(name)
    draft_cfg = ModelConfig.from_hf(load_config(draft_dir))
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"speculative model {name!r} has a vocabulary of {draft_cfg.vocab_size} tokens, the "
                         f"target's has {cfg.vocab_size}: a draft must share the target's tokenizer")
    ours, theirs = load_tokenizer(model_dir), load_tokenizer(draft_dir)
    if (ours is None) != (theirs is None) or (ours is not None and ours.get_vocab() != theirs.get_vocab()):
        raise ValueError(f"speculative model {name!r} has another tokenizer than the target's: "
                         "a draft must share the target's tokenizer")
    model = build_model(draft_dir, draft_cfg, "float", device, variants.dtype, attention)
    variants.weight_bytes[f"draft:{name}"] = weight_bytes(model)
    log.info("weights of draft %s (%d layers): %.1f MiB", name, draft_cfg.num_layers, weight_bytes(model) / 2**20)
    return model


class DraftModelProposer:
    """k greedy forwards of the draft (see the module): the first over what its KV lacks, the rest
    one token each."""

    def __init__(self, model: LlamaForCausalLM, target_kv_caches: list[torch.Tensor], own_kv: bool,
                 block_size: int, device: torch.device, native_decode: bool, triton: bool) -> None:
        self.model, self.block_size, self.device, self.triton = model, block_size, device, triton
        self.own_kv = own_kv
        cfg = model.cfg
        self.kv_caches = target_kv_caches if not own_kv else list(torch.zeros(
            cfg.num_layers, 2, target_kv_caches[0].shape[1], cfg.num_kv_heads, cfg.head_dim,
            dtype=target_kv_caches[0].dtype, device=device).unbind(0))
        if own_kv:
            log.info("draft KV cache: %d layers beside the target's (%.1f MiB)", cfg.num_layers,
                     sum(c.numel() * c.element_size() for c in self.kv_caches) / 2**20)
        self.decode_kernel = cpu_paged_decode(cfg.head_dim) if native_decode else None
        self.max_position = model.rotary.cos_sin.shape[0] - 1
        # own KV: per request, positions fed known tokens, and the drafts fed after them
        self._fed: dict[str, tuple[int, list[int]]] = {}
        self.num_forwards = 0  # draft forwards run (bench spec's cost per forward)

    def forget(self, req_ids) -> None:
        """Requests finished or preempted: their blocks (and this KV) go back to the pool."""
        for req_id in req_ids:
            self._fed.pop(req_id, None)

    def _kv_len(self, req_id: str, token_ids: list[int]) -> int:
        """Positions of `token_ids` whose KV this draft holds (all but the last for a self-draft)."""
        if not self.own_kv:
            return len(token_ids) - 1
        known, tail = self._fed.get(req_id, (0, []))
        for token in token_ids[known:len(token_ids) - 1]:
            if not tail or tail[0] != token:
                break
            known, tail = known + 1, tail[1:]
        return min(known, len(token_ids) - 1)

    @torch.inference_mode()
    def propose(self, req_ids: list[str], token_ids: list[list[int]], block_ids: list[list[int]],
                num_drafts: list[int]) -> list[list[int]]:
        """Per request (its tokens, the last one just sampled and not yet in the KV; its block
        ids, lookahead included; drafts wanted): the draft's greedy continuation."""
        pos0 = np.array([len(t) - 1 for t in token_ids], dtype=np.int64)
        ks = np.minimum(np.array(num_drafts, dtype=np.int64), self.max_position - pos0 + 1)
        tables = np.zeros((len(token_ids), max(len(b) for b in block_ids)), dtype=np.int64)
        for i, b in enumerate(block_ids):
            tables[i, :len(b)] = b
        drafting = np.flatnonzero(ks > 0)
        # the first forward: what each request's KV lacks, its last token included
        queries = [token_ids[i][self._kv_len(req_ids[i], token_ids[i]):] for i in drafting]
        rows, out = drafting, [[] for _ in token_ids]
        for step in range(int(ks.max(initial=0))):
            rows = rows[ks[rows] > step]
            if step:
                queries = [[out[i][-1]] for i in rows]
            starts = pos0[rows] + step - np.array([len(q) - 1 for q in queries], dtype=np.int64)
            for i, token in zip(rows.tolist(), self._forward(queries, starts, tables[rows])):
                out[i].append(token)
        if self.own_kv:
            for i in drafting.tolist():
                self._fed[req_ids[i]] = (len(token_ids[i]), out[i][:-1])  # the last draft was never fed
        self.num_forwards += int(ks.max(initial=0))
        return out

    def _forward(self, queries: list[list[int]], starts: np.ndarray, tables: np.ndarray) -> list[int]:
        """Each row's query tokens from position starts[row]: write the draft's KV there, return
        the argmax token after each row's last."""
        bs, dev = self.block_size, self.device
        qlens = np.array([len(q) for q in queries], dtype=np.int64)
        order = np.lexsort((starts + qlens, qlens > 1))  # one-token rows first, by context length
        qlens, starts, tables = qlens[order], starts[order], tables[order]
        ids = [token for i in order.tolist() for token in queries[i]]
        row = np.repeat(np.arange(len(order)), qlens)
        qsl = np.concatenate([[0], np.cumsum(qlens)])
        positions = np.arange(len(ids)) - qsl[:-1][row] + starts[row]
        slots = tables[row, positions // bs] * bs + positions % bs
        meta = build_attention_metadata(tables, starts + qlens, qlens, slots, bs, dev, self.decode_kernel, self.triton)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev), torch.from_numpy(positions).to(dev),
                            self.kv_caches, meta)
        last = torch.from_numpy(qsl[1:] - 1).to(dev)
        tokens = self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        result = [0] * len(order)
        for sorted_row, original in enumerate(order.tolist()):
            result[original] = tokens[sorted_row]
        return result
