"""The persistent batch (what the executor keeps of each request between steps, updated from each
`SchedulerOutput`'s diff) and the flattening of a step's rows into model inputs: token ids,
positions, `slot_mapping` and attention metadata. One `InputBuilder` serves the target and a
draft model, so both read the same paged layout the same way."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.config import AttentionBackend
from tandem.core.kv_groups import KVGroups
from tandem.core.outputs import NewRequestData, SchedulerOutput
from tandem.core.sampling_params import SamplingParams
from tandem.executor.attention import AttentionMetadata, build_attention_metadata
from tandem.executor.device import to_device
from tandem.executor.rejection_sampler import logits_indices
from tandem.executor.sampler import LogitBias, make_generator, make_logit_bias
from tandem.kernels import cpu_paged_decode, cpu_paged_prefill


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
    logit_bias: LogitBias | None = None  # the sampler's copy of params.logit_bias
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified this step


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    # one for every layer, or with KV groups one per layer (its group's block table)
    attn_metadata: AttentionMetadata | list[AttentionMetadata]
    query_start_loc: np.ndarray  # [num_rows + 1], on the host
    seq_lens: np.ndarray  # [num_rows] context length after this step, on the host


def block_table(block_ids: list[list[int]]) -> np.ndarray:
    """Rows' block ids padded with 0 into one [rows, max_blocks] array."""
    table = np.zeros((len(block_ids), max(len(b) for b in block_ids)), dtype=np.int64)
    for i, ids in enumerate(block_ids):
        table[i, : len(ids)] = ids
    return table


class InputBuilder:
    """Flattens rows (a query of tokens each, after its computed context, in its blocks) for one
    model's attention: the native CPU decode kernel where the model's head_dim has one.

    deterministic: every position of every query is a one-token row on that kernel, so a token's
    attention is the same arithmetic whether it is decoded, prefilled in any chunk, recomputed
    after preemption or verified as a draft (its context length alone shapes it)."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        attention_backend: AttentionBackend,
        head_dim: int,
        deterministic: bool = False,
        groups: KVGroups | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.block_size, self.device, self.attention_backend = block_size, device, attention_backend
        self.kv_dtype = kv_dtype
        self.groups = groups  # None: the plain layout
        self.triton = attention_backend == AttentionBackend.TRITON
        native = attention_backend == AttentionBackend.TORCH and device.type == "cpu"
        self.decode_kernel = cpu_paged_decode(head_dim) if native else None
        # the native prefill reads float caches only; an int8 cache's prefill dequantises on SDPA
        float_kv = kv_dtype != torch.int8
        self.prefill_kernel = cpu_paged_prefill(head_dim) if native and float_kv else None
        self.deterministic = deterministic
        if deterministic and self.decode_kernel is None:
            raise ValueError(
                "deterministic serving attends on the native CPU paged kernel "
                "(attention_backend torch on CPU, head_dim 64 or 128, a C++ compiler); "
                f"here: {attention_backend} on "
                f"{device.type}, head_dim {head_dim}"
            )

    def build(
        self,
        token_ids: list[int],
        query_lens: np.ndarray,
        computed: np.ndarray,
        block_tables: np.ndarray,
        num_split: int = 0,
    ) -> ModelInputs:
        """Row i's query_lens[i] tokens from position computed[i]. The first `num_split` rows run
        each position as a one-token attention row (a verify query on the paged decode kernel);
        one-token rows come first. With KV groups, block_tables holds G entries per logical block
        and each group gets metadata of its own."""
        bs, b = self.block_size, len(query_lens)
        seq_lens = computed + query_lens
        qsl = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        token_row = np.repeat(np.arange(b), query_lens)
        positions = np.arange(int(qsl[-1])) - qsl[:-1][token_row] + computed[token_row]
        nt = int(qsl[num_split])
        rest = np.arange(num_split, b)
        attn_row = np.concatenate([token_row[:nt], rest])
        attn_seq_lens = np.concatenate([positions[:nt] + 1, seq_lens[rest]])
        attn_query_lens = np.concatenate([np.ones(nt, dtype=np.int64), query_lens[rest]])

        def metadata(table: np.ndarray) -> AttentionMetadata:
            slot_mapping = table[token_row, positions // bs] * bs + positions % bs
            return build_attention_metadata(
                table[attn_row],
                attn_seq_lens,
                attn_query_lens,
                slot_mapping,
                bs,
                self.device,
                self.decode_kernel,
                self.triton,
                self.prefill_kernel,
            )

        if self.groups is None or self.groups.num_groups == 1:
            meta = metadata(block_tables)
        else:
            tables = block_tables.reshape(b, -1, self.groups.num_groups)
            per_group = [
                metadata(np.ascontiguousarray(tables[:, :, k]))
                for k in range(self.groups.num_groups)
            ]
            meta = [per_group[k] for k, _ in self.groups.layer_slots]
        input_ids = to_device(np.array(token_ids, dtype=np.int64), self.device)
        return ModelInputs(input_ids, to_device(positions, self.device), meta, qsl, seq_lens)


class InputBatch:
    """The requests the executor holds (`requests`), their RNGs, and a step's flattened inputs."""

    def __init__(self, builder: InputBuilder, default_precision: str) -> None:
        self.builder, self.default_precision = builder, default_precision
        self.requests: dict[str, CachedRequestState] = {}
        # Generators outlive preemption so a seeded request resumes its random stream.
        self.generators: dict[str, torch.Generator | None] = {}

    def update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
            self.generators.pop(req_id, None)
        for req_id in sched.preempted_req_ids:
            self.requests.pop(req_id, None)
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
            new.req_id,
            len(new.prompt_token_ids),
            new.prompt_token_ids + new.output_token_ids,
            new.sampling_params,
            list(new.block_ids),
            new.num_computed_tokens,
            new.eos_token_id,
            new.precision or self.default_precision,
            make_logit_bias(new.sampling_params, self.builder.device),
        )
        if new.req_id not in self.generators:
            self.generators[new.req_id] = make_generator(
                new.sampling_params.seed, self.builder.device
            )

    def by_variant(self, num_scheduled_tokens: dict[str, int]) -> dict[str, list[tuple[str, int]]]:
        """The step's (request, tokens) per precision variant: one-token rows (decodes, verify
        queries) first, shortest context first, so length buckets pad little."""
        order = sorted(
            num_scheduled_tokens.items(),
            key=lambda kv: (
                not self.one_token_rows(self.requests[kv[0]], kv[1]),
                self.requests[kv[0]].num_computed_tokens,
            ),
        )
        by_variant: dict[str, list[tuple[str, int]]] = {}
        for req_id, n in order:  # one forward per variant present (one KV pool, disjoint blocks)
            by_variant.setdefault(self.requests[req_id].precision, []).append((req_id, n))
        return by_variant

    def one_token_rows(self, state: CachedRequestState, n: int) -> bool:
        """Whether the request's n positions run as one-token attention rows: a decode, or (except
        under Triton, whose kernel takes queries of any length) a verify query, whose positions
        then take the paged decode kernel instead of the chunked-prefill path; and every row in the
        deterministic mode."""
        return (
            n == 1
            or self.builder.deterministic
            or (bool(state.spec_token_ids) and not self.builder.triton)
        )

    def prepare_inputs(
        self, states: list[CachedRequestState], counts: np.ndarray
    ) -> tuple[ModelInputs, list[int], torch.Tensor]:
        """The step's inputs for `states` (in `by_variant`'s order), the rows that sample (their
        last scheduled position is their last token, or a verify query's) and their logits'
        indices in the flattened batch."""
        computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        ids: list[int] = []
        for s, c, n in zip(states, computed.tolist(), counts.tolist()):
            ids.extend(s.token_ids[c : c + n])
            ids.extend(s.spec_token_ids)  # after the request's next position (a decode)
        split = [self.one_token_rows(s, n) for s, n in zip(states, counts.tolist())]
        num_split = split.index(False) if False in split else len(states)
        inputs = self.builder.build(
            ids, counts, computed, block_table([s.block_ids for s in states]), num_split
        )
        seq_lens = inputs.seq_lens
        logits_rows = [
            i
            for i, s in enumerate(states)
            if seq_lens[i] == len(s.token_ids) + len(s.spec_token_ids)
        ]
        logits_index = to_device(
            np.array(
                logits_indices(
                    inputs.query_start_loc[1:][logits_rows].tolist(),
                    [len(states[i].spec_token_ids) for i in logits_rows],
                ),
                dtype=np.int64,
            ),
            self.builder.device,
        )
        return inputs, logits_rows, logits_index

    def finish_step(self, states: list[CachedRequestState], counts: np.ndarray) -> None:
        """The KV the step wrote: a verify step keeps the accepted drafts' only (the rest is
        written again)."""
        for s, n in zip(states, counts.tolist()):
            s.num_computed_tokens = (
                len(s.token_ids) - 1 if s.spec_token_ids else s.num_computed_tokens + n
            )
            s.spec_token_ids = []
