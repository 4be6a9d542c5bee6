"""Runs one scheduled step on a real model: keeps the persistent batch, builds the
flattened inputs and attention metadata, runs the model and samples."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.config import EngineConfig
from tandem.core.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from tandem.core.sampling_params import SamplingParams
from tandem.executor.attention import TorchAttention, build_attention_metadata, resolve_attention_backend
from tandem.executor.cuda_graphs import CUDAGraphRunner
from tandem.executor.draft_proposer import DraftModelProposer, build_draft_model
from tandem.executor.device import default_kv_cache_memory, resolve_device, resolve_dtype, to_device
from tandem.kernels import cpu_fused_ops, cpu_paged_decode
from tandem.executor.grammar_compiler import GrammarCompiler
from tandem.executor.proposers import NgramProposer
from tandem.executor.rejection_sampler import RejectionSampler, VerifyRow, logits_indices
from tandem.executor.sampler import Sampler, make_generator
from tandem.executor.step_events import StepGapTimer
from tandem.executor.structured_output import StructuredOutputMatchers
from tandem.models.llama import ModelConfig
from tandem.models.loader import load_config
from tandem.models.variants import build_variants

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    precision: str
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified this step


class ModelRunner:
    """The model executor (see executor/base.py)."""

    def __init__(self, config: EngineConfig, model_dir, grammar_compiler: GrammarCompiler | None = None) -> None:
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_config = ModelConfig.from_hf(load_config(model_dir))
        self.variants = build_variants(config, model_dir, self.model_config, self.device,
                                       resolve_dtype(config.dtype, self.device), TorchAttention)
        self.dtype = self.variants.dtype
        self.model = self.variants.models.get(self.variants.default)  # None: the default fell back

        spec = config.speculative_config
        draft = None if spec is None or spec.method != "draft" else build_draft_model(
            spec, config.model, model_dir, self.model_config, self.variants, self.device, TorchAttention)
        own_draft_kv = draft is not None and spec.self_draft is None  # another model: KV layers of its own

        self.block_size = config.block_size
        budget = config.kv_cache_memory or default_kv_cache_memory(self.device)
        target_per_block = per_block = self.model_config.kv_bytes_per_token(self.dtype) * self.block_size
        if own_draft_kv:  # the draft's KV shares the target's slots: each block holds both
            per_block += draft.cfg.kv_bytes_per_token(self.dtype) * self.block_size
        self.num_kv_blocks = budget // per_block
        if self.num_kv_blocks < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block (one block is {per_block} bytes)")
        cfg = self.model_config
        num_slots = self.num_kv_blocks * self.block_size
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_slots, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=self.dtype, device=self.device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.kv_device = self.kv_cache.device
        self.num_host_blocks = config.swap_space // target_per_block  # a swapped-out draft starts again
        self._host_kv_cache: torch.Tensor | None = None  # allocated at the first swap-out
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s)", self.num_kv_blocks, self.block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**20, self.dtype)

        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        native = self.attention_backend == "torch" and self.device.type == "cpu"  # the paged decode kernel
        self.decode_kernel = cpu_paged_decode(cfg.head_dim) if native else None
        if self.device.type == "cpu":
            cpu_fused_ops()  # built (or found in the cache) now, not inside the first request's step
        self.graph_runner = None
        if (self.device.type == "cuda" and self.attention_backend == "triton" and not config.enforce_eager
                and self.model is not None):
            max_len = config.max_model_len or min(cfg.max_position_embeddings, num_slots)
            self.graph_runner = CUDAGraphRunner(self.model, self.kv_caches, self.block_size,
                                                -(-max_len // self.block_size), config.max_num_seqs, self.device)
            self.graph_runner.capture()
        self.step_gaps = StepGapTimer() if self.device.type == "cuda" else None
        self.sampler = RejectionSampler(Sampler())
        self.structured_output = StructuredOutputMatchers(grammar_compiler) if grammar_compiler else None
        self.proposer = None if spec is None or spec.method != "ngram" else NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.drafter = None if draft is None else DraftModelProposer(
            draft, self.kv_caches, own_draft_kv, self.block_size, self.device, native,
            self.attention_backend == "triton")
        # Host-side seconds per step before the model runs (swap copies, state update, inputs),
        # summed: the part of a step the accelerator waits for.
        self.prepare_time = 0.0
        self.requests: dict[str, CachedRequestState] = {}
        # Generators outlive preemption so a seeded request resumes its random stream.
        self.generators: dict[str, torch.Generator | None] = {}

    def preemption_costs(self) -> tuple[float, float]:
        """Rough seconds per token to swap a request's KV out and back, and to prefill it
        again: what the scheduler weighs when it picks swap or recompute for a victim."""
        copy_bandwidth = 20e9  # host memcpy, or PCIe-class host<->device
        prefill_rate = 50_000.0 if self.device.type == "cuda" else 1_500.0
        kv_bytes = self.model_config.kv_bytes_per_token(self.dtype)
        return 2 * kv_bytes / copy_bandwidth, 1.0 / prefill_rate

    def _swap(self, src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V) from src to dst (device and host tiers)."""
        blocks = _read_blocks(src, [a for a, _ in pairs], self.block_size)
        _write_blocks(dst, [b for _, b in pairs], blocks.to(dst.device, non_blocking=True), self.block_size)

    # ---- KV blocks (P/D) ------------------------------------------------------------
    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of the blocks' K/V, all layers, on the cache's device."""
        return _read_blocks(self.kv_cache, block_ids, self.block_size)

    def write_kv_blocks(self, block_ids: list[int], kv: torch.Tensor, layer: int | None = None) -> None:
        """Place [num_layers, 2, n, ...] blocks, or one layer's [2, n, ...] when `layer` is given."""
        cache = self.kv_cache  # [num_layers, 2, slots, heads, head_dim]
        expect = (self.block_size, *cache.shape[3:])
        if tuple(kv.shape[-3:]) != expect or (layer is None and kv.shape[0] != cache.shape[0]):
            raise ValueError(f"KV payload blocks of shape {tuple(kv.shape)} do not fit this cache "
                             f"({cache.shape[0]} layers of blocks {expect})")
        _write_blocks(cache if layer is None else cache[layer], block_ids, kv.to(self.device, self.dtype),
                      self.block_size)

    # ---- persistent batch -----------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
            self.generators.pop(req_id, None)
        for req_id in sched.preempted_req_ids:
            self.requests.pop(req_id, None)
        if self.structured_output is not None:
            for req_id in sched.finished_req_ids | sched.preempted_req_ids:
                self.structured_output.remove(req_id)
        if self.drafter is not None:
            self.drafter.forget(sched.finished_req_ids | sched.preempted_req_ids)
        for new in sched.scheduled_new_reqs:
            self._add(new)
        for cached in sched.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        for req_id, drafts in sched.spec.draft_token_ids.items():
            self.requests[req_id].spec_token_ids = drafts

    def _add(self, new: NewRequestData) -> None:
        self.requests[new.req_id] = CachedRequestState(
            new.req_id, len(new.prompt_token_ids), new.prompt_token_ids + new.output_token_ids,
            new.sampling_params, list(new.block_ids), new.num_computed_tokens, new.eos_token_id,
            new.precision or self.variants.default,
        )
        if new.sampling_params.structured_outputs is not None:  # rebuilt after a preemption
            self.structured_output.add(new.req_id, new.sampling_params.structured_outputs, new.output_token_ids)
        if new.req_id not in self.generators:
            self.generators[new.req_id] = make_generator(new.sampling_params.seed, self.device)

    @property
    def host_kv_cache(self) -> torch.Tensor:
        """The host tier (pinned on GPU machines); zeros, like the device cache, so a
        masked-out slot never holds NaN."""
        if self._host_kv_cache is None:
            _, _, _, heads, dim = self.kv_cache.shape
            self._host_kv_cache = torch.zeros(
                self.kv_cache.shape[0], 2, self.num_host_blocks * self.block_size, heads, dim,
                dtype=self.dtype, device="cpu", pin_memory=self.device.type == "cuda")
        return self._host_kv_cache

    # ---- one step -----------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        if sched.blocks_to_swap_out:  # before anything can reuse the freed device blocks
            self._swap(self.kv_cache, self.host_kv_cache, sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self._swap(self.host_kv_cache, self.kv_cache, sched.blocks_to_swap_in)
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        # One-token rows (decodes, verify queries) first, shortest context first, so length
        # buckets pad little.
        order = sorted(sched.num_scheduled_tokens.items(),
                       key=lambda kv: (not self._one_token_rows(self.requests[kv[0]], kv[1]),
                                       self.requests[kv[0]].num_computed_tokens))
        out = ModelRunnerOutput()
        by_variant: dict[str, list[tuple[str, int]]] = {}
        for req_id, n in order:  # one forward per variant present (one KV pool, disjoint blocks)
            by_variant.setdefault(self.requests[req_id].precision, []).append((req_id, n))
        self.prepare_time += time.perf_counter() - start
        if self.step_gaps is not None:
            self.step_gaps.step_started()
        for precision, part in by_variant.items():
            self._run_variant(self.variants.models[precision], part, out, sched.spec.propose)
        if self.drafter is not None and sched.spec.num_lookahead_tokens:
            propose_start = time.perf_counter()
            self._propose_drafts(sched.spec.num_lookahead_tokens, out)
            out.propose_time += time.perf_counter() - propose_start
        if self.step_gaps is not None:
            self.step_gaps.step_ended()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out.execute_time = time.perf_counter() - start
        return out

    def _propose_drafts(self, lookahead: dict[str, int], out: ModelRunnerOutput) -> None:
        """The draft model's proposals after this step's tokens, for the requests that sampled
        and were given lookahead slots (the scheduler gives none to grammar-constrained ones)."""
        states = [self.requests[r] for r in lookahead if r in out.sampled_token_ids]
        if states:
            drafts = self.drafter.propose([s.req_id for s in states], [s.token_ids for s in states],
                                          [s.block_ids for s in states],
                                          [lookahead[s.req_id] for s in states])
            out.spec_token_ids.update((s.req_id, d) for s, d in zip(states, drafts))

    def _run_variant(self, model, order: list[tuple[str, int]], out: ModelRunnerOutput, propose: bool) -> None:
        """Forward, logits and sampling of the step's requests that run on `model`; drafts for
        the next step when `propose` (the scheduler plans to verify some)."""
        start = time.perf_counter()
        states = [self.requests[req_id] for req_id, _ in order]
        counts = np.array([n for _, n in order], dtype=np.int64)
        input_ids, positions, meta, logits_rows, logits_index = self._prepare_inputs(states, counts)
        self.prepare_time += time.perf_counter() - start
        # CUDA graphs were captured on the default variant's model
        graph = self.graph_runner if model is self.model else None
        logits = None if graph is None else graph.run(input_ids, positions, meta)
        if logits is None:
            hidden = model(input_ids, positions, self.kv_caches, meta)
        if logits_rows:
            rows = [states[i] for i in logits_rows]
            if logits is None:
                logits = model.compute_logits(hidden[logits_index])
            else:  # a graph computed every row's (a decode-only step: every row samples)
                logits = logits[logits_index]
            if self.structured_output is not None:  # constrained rows have no drafts: one logits row each
                row_req_ids = [s.req_id for s in rows for _ in range(len(s.spec_token_ids) + 1)]
                out.structured_output_time += self.structured_output.apply(logits, row_req_ids)
            verified = self.sampler(logits, [
                # the prompt is only read by the repetition penalty: skip the copy
                VerifyRow(s.params, s.token_ids[:s.prompt_len] if s.params.repetition_penalty != 1.0 else [],
                          s.token_ids[s.prompt_len:],
                          self.generators[s.req_id], s.eos_token_id, s.spec_token_ids) for s in rows],
                self.device)
            for s, (token_ids, lps) in zip(rows, verified):
                s.token_ids.extend(token_ids)
                if self.structured_output is not None:
                    for token_id in token_ids:
                        self.structured_output.accept(s.req_id, token_id)
                out.sampled_token_ids[s.req_id] = token_ids
                if lps is not None:
                    out.logprobs[s.req_id] = lps
                if propose and self.proposer is not None and s.params.drafts:
                    propose_start = time.perf_counter()
                    out.spec_token_ids[s.req_id] = self.proposer.propose(s.token_ids)
                    out.propose_time += time.perf_counter() - propose_start
        for s, n in zip(states, counts.tolist()):
            # a verify step keeps the accepted drafts' KV only: the rest is written again
            s.num_computed_tokens = len(s.token_ids) - 1 if s.spec_token_ids else s.num_computed_tokens + n
            s.spec_token_ids = []

    def _one_token_rows(self, state: CachedRequestState, n: int) -> bool:
        """Whether the request's n positions run as one-token attention rows: a decode, or (except
        under Triton, whose kernel takes queries of any length) a verify query, whose positions
        then take the paged decode kernel instead of the chunked-prefill path."""
        return n == 1 or (bool(state.spec_token_ids) and self.attention_backend != "triton")

    def _prepare_inputs(self, states: list[CachedRequestState], counts: np.ndarray):
        bs, dev = self.block_size, self.device
        b = len(states)
        computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        seq_lens = computed + counts
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        total = int(qsl[-1])

        ids: list[int] = []
        for s, c, n in zip(states, computed.tolist(), counts.tolist()):
            ids.extend(s.token_ids[c:c + n])
            ids.extend(s.spec_token_ids)  # after the request's next position (a decode)
        token_req = np.repeat(np.arange(b), counts)
        positions = np.arange(total) - qsl[:-1][token_req] + computed[token_req]

        max_blocks = max(len(s.block_ids) for s in states)
        block_tables = np.zeros((b, max_blocks), dtype=np.int64)
        for i, s in enumerate(states):
            block_tables[i, :len(s.block_ids)] = s.block_ids
        slot_mapping = block_tables[token_req, positions // bs] * bs + positions % bs

        # Attention rows: each position of the leading one-token-row requests (execute_model puts
        # them first), then one row per remaining request.
        split = [self._one_token_rows(s, n) for s, n in zip(states, counts.tolist())]
        num_split = split.index(False) if False in split else b
        nt = int(qsl[num_split])
        rest = np.arange(num_split, b)
        row_req = np.concatenate([token_req[:nt], rest])
        meta = build_attention_metadata(
            block_tables[row_req], np.concatenate([positions[:nt] + 1, seq_lens[rest]]),
            np.concatenate([np.ones(nt, dtype=np.int64), counts[rest]]), slot_mapping, bs, dev,
            self.decode_kernel, self.attention_backend == "triton")

        logits_rows = [i for i, s in enumerate(states) if seq_lens[i] == len(s.token_ids) + len(s.spec_token_ids)]
        input_ids = to_device(np.array(ids, dtype=np.int64), dev)
        logits_index = to_device(np.array(logits_indices(
            qsl[1:][logits_rows].tolist(), [len(states[i].spec_token_ids) for i in logits_rows]), dtype=np.int64), dev)
        return input_ids, to_device(positions, dev), meta, logits_rows, logits_index


def _blocks_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., 2, slots, heads, dim] as [..., 2, blocks, block_size, heads, dim] (a view)."""
    return cache.view(*cache.shape[:-3], -1, block_size, *cache.shape[-2:])


def _read_blocks(cache: torch.Tensor, block_ids: list[int], block_size: int) -> torch.Tensor:
    blocks = _blocks_view(cache, block_size)
    return blocks.index_select(blocks.dim() - 4, torch.tensor(block_ids, dtype=torch.long, device=cache.device))


def _write_blocks(cache: torch.Tensor, block_ids: list[int], kv: torch.Tensor, block_size: int) -> None:
    blocks = _blocks_view(cache, block_size)
    blocks.index_copy_(blocks.dim() - 4, torch.tensor(block_ids, dtype=torch.long, device=cache.device), kv)
