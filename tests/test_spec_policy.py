"""AdaptiveK (core/spec_decode.py): k per step from batch size, acceptance and step costs."""
from __future__ import annotations

import pytest

from tandem.core.spec_decode import AdaptiveK, SpecDecodeStats, SpeculativeConfig, num_drafts


def _trained(acceptance: float, fixed: float, per_token: float, k_max: int = 4) -> AdaptiveK:
    """A policy that saw verify steps with this acceptance and steps costing fixed + per_token * tokens."""
    policy = AdaptiveK(k_max)
    for i in range(200):
        accepted = int(i * acceptance) - int((i - 1) * acceptance) if i else 0  # a steady share
        policy.observe_verify(1, accepted)
        tokens = 1 + i % 50
        policy.observe_step(tokens, fixed + per_token * tokens)
    return policy


def test_fit_recovers_the_step_cost_and_the_acceptance():
    policy = _trained(0.5, fixed=0.02, per_token=0.001)
    fixed, per_token = policy.step_cost()
    assert fixed == pytest.approx(0.02, rel=1e-6) and per_token == pytest.approx(0.001, rel=1e-6)
    assert policy.acceptance == pytest.approx(0.5, abs=0.02)


def test_drafts_at_batch_one_and_turns_off_at_large_batch():
    """A bandwidth-bound step (a large fixed part) pays for drafts at batch 1; at batch 64 the
    extra tokens cost more than the accepted ones save."""
    policy = _trained(0.4, fixed=0.02, per_token=0.0005)
    assert policy.choose(1) == 3  # E(k) * 0.0205 / (0.02 + 0.0005 (1 + k)) peaks at k = 3 (1.51x)
    assert policy.choose(64) == 0


def test_high_acceptance_keeps_drafting_at_large_batch_with_fewer_drafts():
    policy = _trained(0.9, fixed=0.02, per_token=0.0005)
    assert 0 < policy.choose(64) <= policy.choose(1)


def test_off_probes_now_and_then_and_drafts_before_measuring():
    assert AdaptiveK(4).choose(64) == 4  # nothing measured: draft, to measure
    policy = _trained(0.1, fixed=0.01, per_token=0.001, k_max=4)
    choices = [policy.choose(32) for _ in range(128)]
    assert choices.count(0) == 126 and choices.count(1) == 2


def test_one_step_size_alternates_until_the_costs_can_be_told_apart():
    policy = AdaptiveK(4)
    policy.observe_verify(4, 2)
    for _ in range(5):
        policy.observe_step(8, 0.1)
    assert policy.step_cost() is None
    assert {policy.choose(8), policy.choose(8)} == {0, 4}


def test_num_drafts_fits_budget_and_max_tokens():
    assert num_drafts(4, budget_left=3, tokens_left=10) == 2
    assert num_drafts(4, budget_left=10, tokens_left=2) == 1
    assert num_drafts(4, budget_left=1, tokens_left=10) == 0


def test_stats_and_yaml_mapping():
    stats = SpecDecodeStats()
    stats.observe(4, 2)
    stats.observe(2, 0)
    assert (stats.acceptance_rate, stats.mean_accepted_length, stats.accepted_per_pos) == (2 / 6, 2.0, [1, 1, 0, 0])
    assert SpeculativeConfig.from_yaml({"draft_model": "ngram", "verify_interval": 3}) == {"num_speculative_tokens": 3}


def test_serve_flags_override_the_yaml_section():
    import argparse

    from tandem.config import EngineConfig
    from tandem.server.launch import add_arguments, with_speculation_flags
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculative-method", "ngram", "--num-speculative-tokens", "6"])
    opts = with_speculation_flags({"speculative_config": {"num_speculative_tokens": 3, "adaptive": False}}, args)
    spec = EngineConfig.from_dict(opts).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.adaptive) == ("ngram", 6, False)
    assert with_speculation_flags({}, parser.parse_args([])) == {}
    with pytest.raises(ValueError, match=r"in \[1, 16\]"):
        EngineConfig.from_dict(with_speculation_flags({}, parser.parse_args(["--num-speculative-tokens", "0",
                                                                             "--speculative-method", "ngram"])))
