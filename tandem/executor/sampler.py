"""Turns one step's logits into token ids with vLLM's semantics: min_tokens, logit_bias, penalties,
greedy or temperature / top-k / top-p / min-p sampling, and logprobs of the raw logits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.core.sampling_params import SamplingParams
from tandem.executor.device import to_device

_NEG_INF = float("-inf")
# Stands in for a greedy row's options in the random path: temperature 1, no top-k/top-p/min-p.
_NEUTRAL = SamplingParams()


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A per-request RNG, so a seeded request samples the same tokens whatever batch it lands in."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


LogitBias = tuple[torch.Tensor, torch.Tensor]  # a request's (token ids, biases) on the device


def make_logit_bias(params: SamplingParams, device: torch.device) -> LogitBias | None:
    """The request's logit_bias as device tensors, built once when it joins the batch; None
    without one."""
    if not params.logit_bias:
        return None
    return (
        to_device(torch.tensor(list(params.logit_bias), dtype=torch.long), device),
        to_device(torch.tensor(list(params.logit_bias.values()), dtype=torch.float32), device),
    )


@dataclass(slots=True)
class SamplingRow:
    """One logits row's request, as the model runner sees it this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far (penalties, min_tokens)
    generator: torch.Generator | None  # from make_generator; None = the global RNG
    eos_token_id: int | None  # blocked while len(output) < min_tokens, unless ignore_eos
    logit_bias: LogitBias | None  # from make_logit_bias


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row
    # Per row: [(sampled_id, logprob), (top1_id, logprob), ...] with params.logprobs alternatives,
    # [] for rows that did not ask; None when no row asked.
    logprobs: list[list[tuple[int, float]]] | None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), the same index (the first maximum; a NaN counts as the maximum). On CPU it
    goes through numpy's vectorised argmax: torch's CPU argmax is a scalar loop, 0.3-0.5 ms a row
    over Gemma 3's 262k-token vocabulary in fp32 (1.3 ms in bf16), numpy's 0.03 ms."""
    if x.device.type != "cpu":
        return x.argmax(dim=-1)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32  # exact for every dtype
    return torch.from_numpy(np.argmax(x.detach().to(wide).numpy(), axis=-1))


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _pad(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Ragged id lists -> [B, max len]; numpy fills it much faster than torch.tensor would."""
    padded = np.full((len(rows), max(map(len, rows), default=0)), pad_id, dtype=np.int64)
    for i, ids in enumerate(rows):
        padded[i, : len(ids)] = ids
    return to_device(padded, device)


@dataclass(slots=True)
class SamplingMetadata:
    """Per-step batch of sampling options, built once per step from the rows' requests (copied to
    the device without a host sync).

    Optional tensors are None when no row needs them, so the common cases skip their work.
    """

    all_greedy: bool
    temperature: torch.Tensor | None  # [B] fp32, 1.0 on greedy rows; None when all greedy
    greedy_mask: torch.Tensor | None  # [B] bool; None unless greedy and random rows mix
    top_k: torch.Tensor | None  # [B] long, vocab_size where disabled
    max_top_k: int  # largest enabled top_k (0 when top_k is None)
    top_p: torch.Tensor | None  # [B] fp32, 1.0 where disabled
    min_p: torch.Tensor | None  # [B] fp32, 0.0 where disabled
    generators: dict[int, torch.Generator]  # row -> RNG, random rows of seeded requests only
    no_penalties: bool
    prompt_token_ids: torch.Tensor | None  # [B, P] padded with vocab_size; [] w/o rep. penalty
    output_token_ids: torch.Tensor | None  # [B, O] padded with vocab_size; [] w/o penalties
    presence_penalties: torch.Tensor | None  # [B] fp32
    frequency_penalties: torch.Tensor | None  # [B] fp32
    repetition_penalties: torch.Tensor | None  # [B] fp32
    min_tokens_blocked: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) set to -inf
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, biases)
    num_logprobs: list[int | None]  # per row, params.logprobs
    max_num_logprobs: int | None  # None when no row asked

    @classmethod
    def build(
        cls, rows: list[SamplingRow], vocab_size: int, device: torch.device
    ) -> SamplingMetadata:
        """vocab_size must be the logits' last dimension (it pads token lists and disables
        top-k)."""
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.float32), device)

        all_greedy = all(greedy)
        temperature = greedy_mask = top_k = top_p = min_p = None
        max_top_k = 0
        if not all_greedy:
            sampling = [_NEUTRAL if g else p for p, g in zip(params, greedy)]
            temperature = floats([p.temperature for p in sampling])
            if any(greedy):
                greedy_mask = to_device(torch.tensor(greedy, dtype=torch.bool), device)
            ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in sampling]
            max_top_k = max((k for k in ks if k < vocab_size), default=0)
            if max_top_k:
                top_k = to_device(torch.tensor(ks, dtype=torch.long), device)
            if any(p.top_p < 1.0 for p in sampling):
                top_p = floats([p.top_p for p in sampling])
            if any(p.min_p > 0.0 for p in sampling):
                min_p = floats([p.min_p for p in sampling])
        generators = {
            i: r.generator
            for i, (r, g) in enumerate(zip(rows, greedy))
            if r.generator is not None and not g
        }

        no_penalties = not any(map(_has_penalty, params))
        prompt_ids = output_ids = presence = frequency = repetition = None
        if not no_penalties:
            output_ids = _pad(
                [r.output_token_ids if _has_penalty(r.params) else [] for r in rows],
                vocab_size,
                device,
            )
            prompt_ids = _pad(
                [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else [] for r in rows],
                vocab_size,
                device,
            )
            presence = floats([p.presence_penalty for p in params])
            frequency = floats([p.frequency_penalty for p in params])
            repetition = floats([p.repetition_penalty for p in params])

        min_tokens_blocked = _min_tokens_blocked(rows, vocab_size, device)
        logit_bias = _logit_bias(rows, device)
        num_logprobs = [p.logprobs for p in params]
        max_num_logprobs = max((k for k in num_logprobs if k is not None), default=None)
        return cls(
            all_greedy,
            temperature,
            greedy_mask,
            top_k,
            max_top_k,
            top_p,
            min_p,
            generators,
            no_penalties,
            prompt_ids,
            output_ids,
            presence,
            frequency,
            repetition,
            min_tokens_blocked,
            logit_bias,
            num_logprobs,
            max_num_logprobs,
        )


def _min_tokens_blocked(
    rows: list[SamplingRow], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row indices, token ids) of the stop tokens blocked in rows short of min_tokens, or None."""
    blocked_rows: list[int] = []
    blocked_ids: list[int] = []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens:
            stop_ids = set(r.params.stop_token_ids)
            if r.eos_token_id is not None and not r.params.ignore_eos:
                stop_ids.add(r.eos_token_id)
            ids = sorted(t for t in stop_ids if t < vocab_size)
            blocked_rows += [i] * len(ids)
            blocked_ids += ids
    if not blocked_ids:
        return None
    return (
        to_device(torch.tensor(blocked_rows, dtype=torch.long), device),
        to_device(torch.tensor(blocked_ids, dtype=torch.long), device),
    )


def _logit_bias(
    rows: list[SamplingRow], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(row indices, token ids, biases) of the rows' logit_bias entries; None if no row has any."""
    biased = [(i, r.logit_bias) for i, r in enumerate(rows) if r.logit_bias is not None]
    if not biased:
        return None
    counts = [len(bias[0]) for _, bias in biased]
    row_ids = np.repeat(np.array([i for i, _ in biased], dtype=np.int64), counts)
    return (
        to_device(row_ids, device),
        torch.cat([bias[0] for _, bias in biased]),
        torch.cat([bias[1] for _, bias in biased]),
    )


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids -> [B, V] occurrence counts; the pad id vocab_size lands in a dropped column."""
    counts = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.long, device=token_ids.device
    )
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """OpenAI / vLLM semantics: the repetition penalty divides positive (multiplies negative) logits
    of tokens seen in prompt or output; frequency (per occurrence) and presence penalties subtract,
    output tokens only."""
    vocab_size = logits.shape[-1]
    output_counts = _bin_counts(metadata.output_token_ids, vocab_size)
    output_mask = output_counts > 0
    seen = output_mask | (_bin_counts(metadata.prompt_token_ids, vocab_size) > 0)
    penalty = torch.where(seen, metadata.repetition_penalties.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits -= metadata.frequency_penalties.unsqueeze(1) * output_counts
    logits -= metadata.presence_penalties.unsqueeze(1) * output_mask
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set logits outside each row's top-k (ties at the k-th value kept) and then its top-p nucleus
    (smallest set with probability >= top_p, never empty) to -inf."""
    vocab_size = logits.shape[-1]
    if top_p is None:
        if top_k is None:
            return logits
        # top-k alone: a partial topk is much cheaper than sorting the vocabulary.
        kth = logits.topk(max_top_k, dim=-1).values.gather(
            1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1)
        )
        kth.masked_fill_((top_k >= vocab_size).unsqueeze(1), _NEG_INF)
        return logits.masked_fill(logits < kth, _NEG_INF)

    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail whose total mass is <= 1 - top_p; the most likely token always stays.
    drop = cum_probs <= 1.0 - top_p.unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Stateless: everything per request lives in SamplingMetadata (and its generators)."""

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        md = metadata
        plain_argmax = (
            md.no_penalties
            and md.min_tokens_blocked is None
            and md.logit_bias is None
            and md.max_num_logprobs is None
        )
        if md.all_greedy and plain_argmax:
            return SamplerOutput(argmax(logits).tolist(), None)

        # A private fp32 copy: the steps below work in place and must not touch the caller's logits.
        logits = logits.to(torch.float32, copy=True)
        # vLLM v1's default ("raw_logprobs"): logprobs of the model's logits, before any processing.
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        if md.min_tokens_blocked is not None:
            logits[md.min_tokens_blocked] = _NEG_INF
        if md.logit_bias is not None:
            rows, ids, biases = md.logit_bias
            logits.index_put_((rows, ids), biases, accumulate=True)
        if not md.no_penalties:
            logits = apply_penalties(logits, md)

        sampled = self._sample(logits, md)
        sampled_ids = sampled.tolist()
        logprobs = None
        if raw_logprobs is not None:
            logprobs = self._gather_logprobs(raw_logprobs, sampled, sampled_ids, md)
        return SamplerOutput(sampled_ids, logprobs)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax (penalties applied, top-k/p ignored); the others sample."""
        if md.all_greedy:
            return argmax(logits)
        sampled = self._sample_random(logits, md)
        if md.greedy_mask is None:
            return sampled
        return torch.where(md.greedy_mask, argmax(logits), sampled)

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        logits = apply_top_k_top_p(
            logits / md.temperature.unsqueeze(1), md.top_k, md.max_top_k, md.top_p
        )
        probs = logits.softmax(dim=-1)
        if md.min_p is not None:
            threshold = md.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            probs.masked_fill_(probs < threshold, 0.0)
        # Exponential race: argmax(probs / q), q ~ Exp(1), draws token i with probability
        # probs[i] / sum(probs), without renormalising and batched. Seeded rows draw q from their
        # own generator so their tokens do not depend on the batch.
        q = torch.empty_like(probs)
        if len(md.generators) < q.shape[0]:
            q.exponential_()
        for i, generator in md.generators.items():
            q[i].exponential_(generator=generator)
        # Exp(1) can round to 0 on some backends; 0 / 0 = NaN would win the argmax.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return argmax(probs.div_(q))

    @staticmethod
    def _gather_logprobs(
        logprobs: torch.Tensor, sampled: torch.Tensor, sampled_ids: list[int], md: SamplingMetadata
    ) -> list[list[tuple[int, float]]]:
        sampled_lps = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
        top_lps, top_ids = logprobs.topk(min(md.max_num_logprobs, logprobs.shape[-1]), dim=-1)
        top_lps, top_ids = top_lps.tolist(), top_ids.tolist()
        out: list[list[tuple[int, float]]] = []
        for i, k in enumerate(md.num_logprobs):
            if k is None:
                out.append([])
                continue
            out.append(
                [(sampled_ids[i], sampled_lps[i])] + list(zip(top_ids[i][:k], top_lps[i][:k]))
            )
        return out
