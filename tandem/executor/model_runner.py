"""Runs one scheduled step on a real model: applies the swaps, updates the persistent batch, runs
each precision variant's forward and sampling, then asks the proposer for the next step's drafts.

Its parts, one job each: the persistent batch and the flattening of inputs (input_batch.py), the
KV cache (kv_cache.py) and its host tier (kv_transfer/host_tier.py), the weights, precision
variants and draft model (models/variants.py), CUDA graphs (cuda_graphs.py), grammar masks
(structured_output.py), drafts (proposers/)."""

from __future__ import annotations

import time

import numpy as np
import torch

from tandem.config import EngineConfig
from tandem.core.kv_groups import KVGroups, kv_groups, plain_groups
from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.core.sampling_params import LoRARequest
from tandem.executor.attention import TorchAttention, resolve_attention_backend
from tandem.executor.cuda_graphs import capture_graphs
from tandem.executor.device import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from tandem.executor.grammar_compiler import GrammarCompiler
from tandem.executor.input_batch import CachedRequestState, InputBatch, InputBuilder
from tandem.executor.kv_cache import KVCache
from tandem.executor.kv_transfer.host_tier import HostTierWorker
from tandem.executor.prompt_logprobs import PromptLogprobs
from tandem.executor.proposers import build_proposer
from tandem.executor.rejection_sampler import RejectionSampler, VerifyRow
from tandem.executor.sampler import Sampler
from tandem.executor.step_events import StepGapTimer
from tandem.executor.structured_output import StructuredOutputMatchers
from tandem.executor.thinking_budget import ThinkingBudgets
from tandem.kernels import cpu_fused_ops
from tandem.models.config import ModelConfig
from tandem.models.layers.batch_invariant import check_supported
from tandem.models.loader.model_files import gguf_source, load_config, weight_source
from tandem.models.loader.variants import build_draft, build_variants
from tandem.models.lora.manager import LoRAManager


def kv_layout(cfg: ModelConfig, device: torch.device, own_draft_kv: bool) -> KVGroups:
    """KV groups (sliding-window layers' blocks freed behind the window) for a model with
    sliding-window layers, on CPU; the plain layout elsewhere: with a draft model keeping KV of
    its own (one block table serves both) and on CUDA (its graphs capture one metadata for
    every layer; not yet measured there)."""
    windows = cfg.layer_windows
    if not windows or all(w is None for w in windows) or device.type != "cpu" or own_draft_kv:
        return plain_groups(cfg.num_layers)
    return kv_groups(windows)


class ModelRunner:
    """The model executor (see executor/base.py)."""

    def __init__(
        self, config: EngineConfig, model_dir, grammar_compiler: GrammarCompiler | None = None
    ) -> None:
        model, run = config.model_config, config.device_config
        torch.manual_seed(model.seed)  # the stream of requests sampled without a seed of their own
        self.device = resolve_device(run.device)
        if self.device.type == "cpu" and run.num_threads:
            torch.set_num_threads(run.num_threads)
        self.model_config = cfg = ModelConfig.from_hf(load_config(model_dir))
        dtype = resolve_dtype(model.dtype, self.device)
        if run.deterministic:  # refused before the weights load, not after
            check_supported(self.device, dtype)
        # the weights every variant is read from, opened once (a self-draft reads them too)
        source = weight_source(model_dir, gguf_source(model.model))
        self.variants = build_variants(
            config.quant_config,
            source,
            model.dtype,
            cfg,
            self.device,
            dtype,
            TorchAttention,
            run.deterministic,
        )
        self.dtype = self.variants.dtype
        self.model = self.variants.models.get(self.variants.default)  # None: the default fell back
        self.lora = (
            LoRAManager(config.lora_config, cfg, self.variants.models)
            if config.lora_config.enabled
            else None
        )
        spec = config.speculative_config
        draft = (
            None
            if spec is None or spec.method != "draft"
            else build_draft(
                self.variants,
                source,
                spec.self_draft,
                spec.model,
                model_dir,
                cfg,
                self.device,
                TorchAttention,
            )
        )
        own_draft_kv = (
            draft is not None and spec.self_draft is None
        )  # another model: KV layers of its own
        groups = kv_layout(cfg, self.device, own_draft_kv)
        self.kv_group_windows = groups.windows
        self.attention_backend = resolve_attention_backend(run.attention_backend, self.device)
        kv_dtype = resolve_kv_cache_dtype(
            config.cache_config.kv_cache_dtype,
            model.dtype,
            self.dtype,
            self.device,
            self.attention_backend,
        )
        self.kv = KVCache(
            config.cache_config,
            cfg,
            draft.cfg if own_draft_kv else None,
            kv_dtype,
            self.device,
            groups,
        )
        self.host_tier = HostTierWorker(self.kv)
        self.block_size, self.num_kv_blocks, self.num_host_blocks = (
            self.kv.block_size,
            self.kv.num_kv_blocks,
            self.kv.num_host_blocks,
        )
        self.kv_caches, self.kv_device = self.kv.kv_caches, self.kv.kv_cache.device
        if self.device.type == "cpu":
            # built (or found in the cache) now, not inside the first request's step
            cpu_fused_ops()
        max_len = model.max_model_len or min(cfg.max_context_len, self.kv.num_slots)
        self.graph_runner = capture_graphs(
            self.model,
            self.kv_caches,
            self.block_size,
            max_len,
            config.scheduler_config.max_num_seqs,
            self.device,
            self.attention_backend,
            run.enforce_eager,
        )
        self.step_gaps = StepGapTimer() if self.device.type == "cuda" else None
        self.sampler = RejectionSampler(Sampler())
        self.structured_output = (
            StructuredOutputMatchers(grammar_compiler) if grammar_compiler else None
        )
        self.thinking_budgets = ThinkingBudgets()
        self.prompt_logprobs = PromptLogprobs()
        builder = InputBuilder(
            self.block_size,
            self.device,
            self.attention_backend,
            cfg.head_dim,
            run.deterministic,
            groups,
            kv_dtype,
        )
        self.input_batch = InputBatch(builder, self.variants.default)
        self.proposer = build_proposer(spec, draft, self.kv, builder)
        # Host-side seconds per step before the model runs (swap copies, state update, inputs),
        # summed: the part of a step the accelerator waits for.
        self.prepare_time = 0.0

    @property
    def requests(self) -> dict[str, CachedRequestState]:
        """The requests the persistent batch holds."""
        return self.input_batch.requests

    def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter (ValueError: refused, in words; or LoRA is off)."""
        if self.lora is None:
            raise ValueError("LoRA adapters are off: start the engine with enable_lora")
        self.lora.add(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_int_id)

    def lora_stats(self) -> dict[str, dict[str, int]]:
        return {} if self.lora is None else self.lora.stats()

    def preemption_costs(self) -> tuple[float, float]:
        return self.kv.preemption_costs()

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.kv.read_blocks(block_ids)

    def write_kv_blocks(
        self, block_ids: list[int], kv: torch.Tensor, layer: int | None = None
    ) -> None:
        self.kv.write_blocks(block_ids, kv, layer)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        self.host_tier.start_load_kv(sched)
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        out = ModelRunnerOutput()
        by_variant = self.input_batch.by_variant(sched.num_scheduled_tokens)
        self.prepare_time += time.perf_counter() - start
        if self.step_gaps is not None:
            self.step_gaps.step_started()
        for precision, part in by_variant.items():
            for rows in self._lora_parts(part):
                self._run_variant(precision, rows, out)
        if (
            self.proposer is not None and sched.spec.propose
        ):  # only when the next step may verify them
            propose_start = time.perf_counter()
            out.spec_token_ids = self.proposer.propose_drafts(
                sched, self.input_batch.requests, out.sampled_token_ids
            )
            out.propose_time = time.perf_counter() - propose_start
        if self.step_gaps is not None:
            self.step_gaps.step_ended()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out.execute_time = time.perf_counter() - start
        return out

    def _update_states(self, sched: SchedulerOutput) -> None:
        self.input_batch.update_states(sched)
        if self.structured_output is not None:
            self.structured_output.update(sched)
        self.thinking_budgets.update(sched)
        if self.proposer is not None and (sched.finished_req_ids or sched.preempted_req_ids):
            self.proposer.forget(sched.finished_req_ids | sched.preempted_req_ids)
        self.prompt_logprobs.forget(sched.finished_req_ids)

    def _lora_parts(self, part: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
        """The variant's rows by adapter, in forwards of at most max_loras adapters each."""
        if self.lora is None:
            return [part]
        states = [self.requests[r] for r, _ in part]
        return self.lora.groups(
            part,
            [s.params.lora_request for s in states],
            [self.input_batch.one_token_rows(s, n) for s, (_, n) in zip(states, part)],
        )

    def _run_variant(
        self, precision: str, order: list[tuple[str, int]], out: ModelRunnerOutput
    ) -> None:
        """Forward, logits and sampling of the step's requests that run on variant `precision`."""
        start = time.perf_counter()
        model = self.variants.models[precision]
        states = [self.input_batch.requests[req_id] for req_id, _ in order]
        counts = np.array([n for _, n in order], dtype=np.int64)
        inputs, logits_rows, logits_index = self.input_batch.prepare_inputs(states, counts)
        adapted = self.lora is not None and self.lora.set_step(
            precision, [s.params.lora_request for s in states], counts
        )
        self.prepare_time += time.perf_counter() - start
        # CUDA graphs were captured on the default variant's model, without adapters
        graph = self.graph_runner if model is self.model and not adapted else None
        logits = (
            None
            if graph is None
            else graph.run(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        )
        if logits is None:  # adapted rows run the modules (the decode plan has no LoRA)
            forward = model.forward_modules if adapted else model
            hidden = forward(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata
            )
        if any(s.params.prompt_logprobs is not None for s in states):
            every_row = logits  # a graph computed every row's logits; else from the hidden rows
            self.prompt_logprobs.add_step(
                states,
                counts,
                inputs.query_start_loc,
                lambda a, b: (
                    every_row[a:b] if every_row is not None else model.compute_logits(hidden[a:b])
                ),
            )
        if logits_rows:
            if (
                logits is None
            ):  # indices are ascending and distinct: as many as rows means every row
                logits = model.compute_logits(
                    hidden if len(logits_index) == len(hidden) else hidden[logits_index]
                )
            else:  # a graph computed every row's logits (a decode-only step: every row samples)
                logits = logits[logits_index]
            self._sample(logits, [states[i] for i in logits_rows], out)
        self.input_batch.finish_step(states, counts)

    def _sample(
        self, logits: torch.Tensor, rows: list[CachedRequestState], out: ModelRunnerOutput
    ) -> None:
        """Mask the constrained rows and those out of thinking budget, verify the drafts and
        sample; the tokens join the batch."""
        grammar, generators = self.structured_output, self.input_batch.generators
        budgets = self.thinking_budgets if self.thinking_budgets.active else None
        if grammar is not None or budgets is not None:  # such rows have no drafts: one row each
            row_req_ids = [s.req_id for s in rows for _ in range(len(s.spec_token_ids) + 1)]
            if grammar is not None:
                out.structured_output_time += grammar.apply(logits, row_req_ids)
            if budgets is not None:
                budgets.apply(logits, row_req_ids)
        verified = self.sampler(
            logits,
            [
                # the prompt is only read by the repetition penalty: skip the copy
                VerifyRow(
                    s.params,
                    s.token_ids[: s.prompt_len] if s.params.repetition_penalty != 1.0 else [],
                    s.token_ids[s.prompt_len :],
                    generators[s.req_id],
                    s.eos_token_id,
                    s.logit_bias,
                    s.spec_token_ids,
                )
                for s in rows
            ],
            self.device,
        )
        for s, (token_ids, lps) in zip(rows, verified):
            if s.params.prompt_logprobs is not None and len(s.token_ids) == s.prompt_len:
                out.prompt_logprobs[s.req_id] = self.prompt_logprobs.take(s.req_id)
            s.token_ids.extend(token_ids)
            for token_id in token_ids:
                if grammar is not None:
                    grammar.accept(s.req_id, token_id)
                if budgets is not None:
                    budgets.accept(s.req_id, token_id)
            out.sampled_token_ids[s.req_id] = token_ids
            if lps is not None:
                out.logprobs[s.req_id] = lps
