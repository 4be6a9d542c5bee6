"""Perplexity of one precision variant over a text, measured in the runner itself (one prefill
per chunk), and a perplexity change's spread over the chunks: the standard error of the paired
per-chunk NLL differences, and each half's change."""

from __future__ import annotations

import math


def perplexity(runner, precision: str, token_ids: list[int], window: int) -> float:
    """exp(mean NLL) of every token after the first of each `window`-token chunk."""
    return perplexity_of_chunks(chunk_nlls(runner, precision, token_ids, window))


def perplexity_of_chunks(chunks: list[tuple[float, int]]) -> float:
    """exp(mean NLL) over `chunk_nlls`' chunks, pooled."""
    return math.exp(sum(n for n, _ in chunks) / sum(c for _, c in chunks))


def paired_change(chunks: list[tuple[float, int]], base: list[tuple[float, int]]) -> dict:
    """`chunks`' perplexity against `base`'s over the same text: the change, the standard error
    of its log over the chunks (each chunk's mean NLL difference, paired), and each half's
    change: a change inside a few standard errors, or of opposite signs in the halves, is noise."""
    diffs = [(a - b) / n for (a, n), (b, _) in zip(chunks, base)]
    k, mean = len(diffs), sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (k - 1) if k > 1 else math.nan
    half = k // 2
    return {
        "change": perplexity_of_chunks(chunks) / perplexity_of_chunks(base) - 1,
        "stderr": math.sqrt(var / k),
        "chunks": k,
        "halves": [
            perplexity_of_chunks(chunks[s]) / perplexity_of_chunks(base[s]) - 1
            for s in (slice(0, half), slice(half, k))
        ]
        if half
        else [],
    }


def chunk_nlls(
    runner, precision: str, token_ids: list[int], window: int
) -> list[tuple[float, int]]:
    """(summed NLL, tokens) of every token after the first of each `window`-token chunk,
    computed by one prefill per chunk (the runner's own input building, on blocks 0..n: G
    entries per logical block with KV groups)."""
    import numpy as np
    import torch

    from tandem.core.sampling_params import SamplingParams
    from tandem.executor.input_batch import CachedRequestState

    model, chunks = runner.variants.models[precision], []
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window]
        if len(chunk) < 2:
            break
        blocks = list(
            range(math.ceil(len(chunk) / runner.block_size) * len(runner.kv_group_windows))
        )
        state = CachedRequestState(
            "ppl", len(chunk), chunk + [0], SamplingParams(), blocks, 0, None, precision
        )
        inputs, *_ = runner.input_batch.prepare_inputs([state], np.array([len(chunk)]))
        input_ids = inputs.input_ids
        with torch.inference_mode():
            logits = model.compute_logits(
                model(input_ids, inputs.positions, runner.kv_caches, inputs.attn_metadata)
            )
        logp = torch.log_softmax(logits[:-1], -1).gather(1, input_ids[1:, None])
        chunks.append((-logp.sum().item(), len(chunk) - 1))
    return chunks
