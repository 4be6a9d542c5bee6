"""Verification by sampling leaves the target's distribution unchanged: a chi-square test on a
toy model (6 tokens, next-token logits a function of the previous token) with a deliberately
poor draft, under temperature, top-k and a presence penalty."""

from __future__ import annotations

import torch

from tandem.core.sampling_params import SamplingParams
from tandem.executor.proposers import NgramProposer
from tandem.executor.rejection_sampler import RejectionSampler, VerifyRow, logits_indices
from tandem.executor.sampler import Sampler, apply_top_k_top_p, make_logit_bias

V = 6
PARAMS = SamplingParams(temperature=0.7, top_k=4, presence_penalty=0.5, max_tokens=2)


def _toy_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(V, V, generator=g) * 1.5  # row: the previous token


def _target(logits_row: torch.Tensor, output: list[int]) -> torch.Tensor:
    """The target's next-token law with PARAMS (presence penalty, temperature, top-k)."""
    row = logits_row.clone()
    for t in set(output):
        row[t] -= PARAMS.presence_penalty
    row = apply_top_k_top_p(
        (row / PARAMS.temperature)[None], torch.tensor([PARAMS.top_k]), PARAMS.top_k, None
    )
    return row.softmax(-1)[0]


def _generate_pairs(num: int, drafts: list[int]) -> torch.Tensor:
    """`num` two-token continuations of the prompt [0], each drafted by `drafts` every step."""
    table, verify = _toy_logits(), RejectionSampler(Sampler())
    outs: list[list[int]] = [[] for _ in range(num)]
    while True:
        live = [o for o in outs if len(o) < 2]
        if not live:
            break
        rows, logits = [], []
        for o in live:
            d = drafts[: 2 - len(o) - 1] if len(o) < 2 else []
            rows.append(VerifyRow(PARAMS, [0], list(o), None, None, None, d))
            seq = [0] + o
            logits += [table[(seq + d[:j])[-1]] for j in range(len(d) + 1)]
        for o, (tokens, _) in zip(live, verify(torch.stack(logits), rows, torch.device("cpu"))):
            o.extend(tokens[: 2 - len(o)])
    return torch.tensor(outs)


def _chi2_pvalue(pairs: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double()
    exp = expected.flatten().double() * len(pairs)
    keep = exp > 0
    if counts[~keep].sum() > 0:
        return 0.0  # a pair outside the law's support was emitted
    chi2 = ((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = torch.tensor(keep.sum().item() - 1, dtype=torch.double)
    return torch.special.gammaincc(df / 2, chi2 / 2).item()


def _joint(penalised: bool = True) -> torch.Tensor:
    table = _toy_logits()
    first = _target(table[0], [])
    return torch.stack([first[a] * _target(table[a], [a] if penalised else []) for a in range(V)])


def test_sampled_tokens_follow_the_target_with_a_poor_draft():
    torch.manual_seed(0)
    joint = _joint()
    poor = int(joint.sum(1).argsort()[1])  # an unlikely first token (still in the top-k)
    pairs = _generate_pairs(20_000, [poor, poor])
    assert _chi2_pvalue(pairs, joint) > 1e-3
    # the test has power: the law without the penalty is rejected
    assert _chi2_pvalue(pairs, _joint(penalised=False)) < 1e-6


def test_greedy_accepts_the_longest_matching_prefix_plus_a_bonus():
    logits = torch.full((4, V), -5.0)
    for row, tok in enumerate([2, 3, 1, 4]):  # the target's argmax at each position
        logits[row, tok] = 5.0
    greedy = SamplingParams(temperature=0, logprobs=0)
    verify = RejectionSampler(Sampler())
    [(tokens, lps)] = verify(
        logits, [VerifyRow(greedy, [], [], None, None, None, [2, 3, 5])], torch.device("cpu")
    )
    assert tokens == [2, 3, 1] and [lp[0][0] for lp in lps] == [2, 3, 1]
    [(tokens, _)] = verify(
        logits, [VerifyRow(greedy, [], [], None, None, None, [2, 3, 1])], torch.device("cpu")
    )
    assert tokens == [2, 3, 1, 4]


def test_logit_bias_applies_to_every_drafted_position():
    logits = torch.full((3, V), -5.0)
    logits[:, 1] = 5.0
    greedy = SamplingParams(temperature=0, logit_bias={2: 20.0})
    bias = make_logit_bias(greedy, torch.device("cpu"))
    [(tokens, _)] = RejectionSampler(Sampler())(
        logits, [VerifyRow(greedy, [], [], None, None, bias, [2, 2])], torch.device("cpu")
    )
    assert tokens == [2, 2, 2]


def test_logits_indices_take_the_last_k_plus_one_positions():
    assert logits_indices([3, 8, 9], [0, 2, 0]) == [2, 5, 6, 7, 8]


def test_ngram_proposes_what_followed_the_longest_suffix():
    p = NgramProposer(3, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 4, 9, 2, 3]) == [4, 9, 2]
    assert p.propose([5, 6, 7]) == []
    assert p.propose([7] * 8) == [7, 7, 7]  # a repeating tail: a match with k tokens after it
    assert NgramProposer(3, min_n=2, max_n=2).propose([1, 2, 3, 1]) == []


def test_a_seeded_stream_drops_the_rejected_positions_draws():
    """Verifying drafts draws one row of noise per position; after a rejection the generator is
    where sampling the emitted tokens alone would have left it, so later tokens equal speculation
    off."""
    torch.manual_seed(0)
    logits, params = torch.randn(4, V), SamplingParams(temperature=1.0, seed=3, max_tokens=8)
    spec, plain = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    verify = RejectionSampler(Sampler())
    [(tokens, _)] = verify(
        logits, [VerifyRow(params, [], [], spec, None, None, [V, V, V])], torch.device("cpu")
    )
    assert len(tokens) == 1  # draft V is never a token: the first position rejects
    [(alone, _)] = verify(
        logits[:1], [VerifyRow(params, [], [], plain, None, None, [])], torch.device("cpu")
    )
    assert alone == tokens and torch.equal(spec.get_state(), plain.get_state())
