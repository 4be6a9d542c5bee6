"""AdaptiveK (core/adaptive_k.py): k per step from batch size, acceptance and step costs."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.config import SpeculativeConfig
from tandem.core.adaptive_k import AdaptiveK, batch_bucket
from tandem.core.spec_decode import SpecDecodeStats, num_drafts


def _trained(acceptance: float, fixed: float, per_token: float, k_max: int = 4) -> AdaptiveK:
    """A policy that saw verify steps with this acceptance and steps costing fixed + per_token *
    tokens."""
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


def test_draft_size_from_acceptance_and_step_cost():
    """A bandwidth-bound step (a large fixed part) pays for 3 drafts at batch 1; at batch 64
    the extra tokens cost more, so fewer; high acceptance drafts more."""
    policy = _trained(0.4, fixed=0.02, per_token=0.0005)
    assert (
        policy.num_to_draft(1) == 3
    )  # E(k) * 0.0205 / (0.02 + 0.0005 (1 + k)) peaks at k = 3 (1.51x)
    assert policy.num_to_draft(64) == 1
    assert 1 < _trained(0.9, fixed=0.02, per_token=0.0005).num_to_draft(64) <= policy.k_max
    assert AdaptiveK(4).num_to_draft(8) == 4  # no cost fit yet: k_max
    assert AdaptiveK(4).acceptance == 0.5  # the prior


def _decode_step(
    policy: AdaptiveK,
    batch: int,
    drafted: bool,
    seconds: float,
    drafts: int = 4,
    proposal_seconds: float = 0.0,
) -> None:
    """A pure-decode step at `batch`, every request with `drafts` drafts when `drafted`,
    `proposal_seconds` of it proposing the next step's drafts."""
    policy.observe_step(
        batch * (1 + drafts if drafted else 1),
        seconds,
        batch,
        drafted,
        (drafts,) * batch if drafted else (),
        proposal_seconds,
    )


def _plain_steps(policy: AdaptiveK, batch: int, seconds: float) -> None:
    """Enough plain steps for the bucket to be judged: the first (maybe a new shape) and
    min_samples."""
    for _ in range(1 + policy.min_samples):
        _decode_step(policy, batch, False, seconds)


def test_plain_first_then_one_probe_then_the_faster_mode():
    policy = AdaptiveK(
        4, explore_verifies=0
    )  # acceptance 0.5: a request with 4 drafts is credited E(4) = 1.94 tokens
    assert policy.choose(8) == 0  # nothing measured: plain steps cost nothing extra
    _decode_step(policy, 8, False, seconds=0.02)  # a new shape: not a sample
    assert policy.rate(8, False) is None
    for _ in range(policy.min_samples - 1):
        _decode_step(policy, 8, False, seconds=0.02)
        assert policy.choose(8) == 0  # not yet min_samples plain samples
    _decode_step(policy, 8, False, seconds=0.02)
    assert policy.choose(8) == 4  # the probe, once the bucket has min_samples plain samples
    _decode_step(policy, 8, True, seconds=0.04)  # 1.94x the tokens for 2x the time: slower
    assert [policy.choose(8) for _ in range(63)] == [
        0
    ] * 63  # a probe costing 2 steps: every 64 choices
    assert policy.choose(8) > 0  # the next probe (k now from the cost fit)
    _decode_step(policy, 8, True, seconds=0.01)  # now cheap: the decayed rate beats plain's
    assert (
        policy.choose(8) > 0 and policy.choose(5) > 0
    )  # 5-8 is one bucket (k now from the cost fit)
    assert policy.choose(9) == 0  # another bucket: its plain rate first


def test_one_unlucky_probe_is_credited_the_measured_acceptance():
    """The yield of a drafting step comes from the acceptance over all verify steps, so a probe
    whose drafts were all rejected still counts what drafting is expected to give."""
    policy = _trained(0.8, fixed=0.02, per_token=0.0001)
    _plain_steps(policy, 1, seconds=0.02)
    assert policy.choose(1) > 0  # the probe
    policy.observe_verify(4, 0)  # all rejected this once
    _decode_step(policy, 1, True, seconds=0.022)
    assert policy.choose(1) > 0


def _serve(
    policy: AdaptiveK, batches: list[int], plain_seconds, draft_seconds, propose_seconds=None
) -> list[int]:
    """Run the policy as the scheduler does against a step cost model: step i's k was chosen
    when step i - 1 was scheduled, and step i proposes when step i + 1 drafts. A step costs
    plain_seconds(batch, i) (i counting the steps at that batch so far) or draft_seconds(batch,
    k), plus propose_seconds(batch, k) when it proposes; all drafts are accepted. Returns the k
    of each step."""
    ks, seen = [policy.choose(batches[0])], {}
    for step, batch in enumerate(batches):
        i = seen[batch] = seen.get(batch, -1) + 1
        k, k_next = ks[-1], policy.choose(batches[min(step + 1, len(batches) - 1)])
        seconds = draft_seconds(batch, k) if k else plain_seconds(batch, i)
        proposal = propose_seconds(batch, k_next) if k_next and propose_seconds is not None else 0.0
        if k:
            policy.observe_verify(k, k)
        policy.observe_step(
            batch * (1 + k), seconds + proposal, batch, k > 0, (k,) * batch if k else (), proposal
        )
        ks.append(k_next)
    return ks[:-1]


def test_a_new_bucket_is_not_judged_from_its_first_slow_steps():
    """§20's trace: bucket 33-64 decided drafting off (~300 tok/s against 1,000 plain), then
    requests finished and the batch fell to 30, a new bucket whose first plain steps are the
    slowest it sees (new shapes, load: 150 ms against 30, 200 tok/s). A probe judged against
    those would find drafting faster and keep it on; it must stay off, but for rare probes."""
    policy = _trained(0.93, fixed=0.01, per_token=0.0006)

    def plain(batch, i):
        return 0.15 if batch == 30 and i < 3 else 0.001 * batch

    ks = _serve(
        policy,
        [40] * 40 + [30] * 200,
        plain,
        draft_seconds=lambda batch, k: 0.003 * batch * (1 + k),
    )
    assert policy.rate(30, False) > policy.min_gain * policy.rate(30, True)  # drafting truly slower
    assert sum(k > 0 for k in ks[:40]) <= 1  # bucket 33-64 decides off
    assert sum(k > 0 for k in ks[40:]) <= 2  # the first probe, and at most one more


def test_a_bucket_where_drafting_wins_turns_it_on_at_its_first_probe():
    """Batch 1, slow first steps too: once the bucket is judged, the first probe shows drafting
    (4.7 tokens for 1.5 plain steps) faster and it stays on, but for rare plain probes."""
    policy = _trained(0.93, fixed=0.01, per_token=0.0001)
    ks = _serve(
        policy,
        [1] * 200,
        lambda batch, i: 0.05 if i < 3 else 0.01,
        draft_seconds=lambda batch, k: 0.015,
    )
    first = next(i for i, k in enumerate(ks) if k)
    assert first <= 2 + policy.min_samples
    assert sum(k == 0 for k in ks[first:]) <= 2 * (
        1 + len(ks) // policy.probe_every
    )  # plain probes: 2 steps


def test_an_unlucky_first_probe_is_soon_retried():
    """Grounded text at batch 1 on a fresh engine: the first probe comes early in an answer,
    where prompt lookup's drafts all fail (the acceptance, mostly the prior's, drops to 0.33 and
    drafting looks no faster); later drafts copy the prompt and are all accepted. While few
    verify steps are known, probes come every probe_every / 8 choices, so drafting is on soon."""
    policy = AdaptiveK(4)
    ks, accepted = [policy.choose(1)], []
    for _ in range(120):
        k, k_next = ks[-1], policy.choose(1)
        if k:
            accepted.append(0 if not accepted else k)  # the first verify: all rejected
            policy.observe_verify(k, accepted[-1])
        policy.observe_step(1 + k, 0.016 if k else 0.010, 1, k > 0, (k,) if k else ())
        ks.append(k_next)
    first_on = next(i for i in range(len(ks) - 4) if all(ks[i : i + 4]))
    assert accepted[0] == 0 and first_on <= 40


def test_a_step_with_nothing_proposed_is_no_drafting_sample():
    """Grounded text at batch 1: drafting wins when prompt lookup finds a match (4 drafts, 76%
    accepted, 14 ms against a 10 ms plain step), but runs of steps find none. Such a step was
    planned to draft and costs a plain step (plus the lost overlap); counted as drafting, six
    in a row dragged drafting's rate under plain's and turned it off until the next probe."""
    policy = _trained(0.76, fixed=0.01, per_token=0.0001)
    _plain_steps(policy, 1, seconds=0.01)
    assert policy.choose(1) > 0
    _decode_step(policy, 1, True, seconds=0.014)
    spec = policy.rate(1, True)
    for _ in range(6):
        assert policy.choose(1) > 0
        policy.observe_step(1, 0.011, 1, True, ())  # planned to draft; nobody had a draft
    assert policy.rate(1, True) == spec and policy.choose(1) > 0


def test_probes_of_a_costly_draft_are_rarer():
    """At large batch a drafting probe that costs 6 plain steps runs 3 times as rarely, so
    probes take about the same share of time as at small batch."""
    policy = _trained(0.9, fixed=0.02, per_token=0.0005)
    ks = _serve(policy, [64] * 1200, lambda batch, i: 0.05, draft_seconds=lambda batch, k: 0.3)
    probes = sum(k > 0 for k in ks)
    assert 1 <= probes <= 1 + len(ks) // (policy.probe_every * 3)


def test_a_drafting_probe_is_charged_its_proposal():
    """A self-draft's forwards run in the step before the one that verifies them. A probe is a
    plain step that proposes, then a verify step that does not: drafting must be charged the
    proposal, and the proposing step is a plain sample without it. Here a verify step costs 1.2
    plain steps but the proposal 4 more, so drafting (4.7 tokens for 5.2 steps) loses."""
    policy = _trained(0.93, fixed=0.01, per_token=0.0001)
    ks = _serve(
        policy,
        [8] * 300,
        lambda batch, i: 0.01,
        draft_seconds=lambda batch, k: 0.012,
        propose_seconds=lambda batch, k: 0.04,
    )
    assert policy.rate(8, True) < policy.rate(8, False)
    assert policy.rate(8, False) == pytest.approx(800)  # no plain sample holds a proposal
    assert 1 <= sum(k > 0 for k in ks) <= 1 + len(ks) // (policy.probe_every * 2)


def test_a_plain_probe_while_drafting_is_a_clean_plain_sample():
    """Where drafting wins, the plain probe proposes for the drafting step after it; its plain
    sample is its seconds without that proposal, and drafting stays on."""
    policy = _trained(0.93, fixed=0.01, per_token=0.0001)
    ks = _serve(
        policy,
        [1] * 300,
        lambda batch, i: 0.01,
        draft_seconds=lambda batch, k: 0.012,
        propose_seconds=lambda batch, k: 0.004,
    )
    assert policy.rate(1, False) == pytest.approx(100)
    plain = [i for i, k in enumerate(ks) if k == 0]
    assert len(plain) <= policy.min_samples + 2 + 2 * len(ks) // policy.probe_every


def test_the_trace_records_every_choice_and_step_and_changes_nothing():
    """`bench spec --trace-adaptive`: pure recording, the same choices with it and without."""

    def run(trace):
        policy = _trained(0.8, fixed=0.01, per_token=0.0005)
        policy.trace = trace
        return _serve(policy, [4] * 50 + [3] * 50, lambda batch, i: 0.01, lambda batch, k: 0.012)

    events = []
    assert run(events.append) == run(None)
    kinds = [e["event"] for e in events]
    assert kinds.count("choose") == 101 and kinds.count("observe_step") == 100
    choose = next(e for e in events if e["event"] == "choose" and e["k"])
    assert choose["bucket"] == 2 and choose["plain"] > 0 and choose["drafting"]
    step = next(e for e in events if e["event"] == "observe_step" and e["drafted"])
    assert step["draft_counts"] == [step["tokens"] // 4 - 1] * 4 and step["decodes"] == 4


def test_bench_spec_policy_cost_reads_a_trace(tmp_path):
    """`bench spec --policy-cost`: a drafting step costs its seconds beyond the plain rate for
    the tokens its drafts are expected to yield; a plain step, the proposal it made."""
    from tandem.bench.spec_policy_cost import policy_cost

    case = {"proposer": "ngram", "set": "chat", "batch": 4, "round": 0}
    step = {
        "event": "observe_step",
        "decodes": 4,
        "drafted": False,
        "proposal_seconds": 0.0,
        "draft_counts": [],
    }
    events = [
        {"event": "choose", "acceptance": 0.5},
        {**step, "seconds": 0.04},
        {**step, "seconds": 0.05, "proposal_seconds": 0.005},
        {**step, "seconds": 0.06, "drafted": True, "draft_counts": [2, 2]},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(json.dumps({**case, **e}) + "\n" for e in events)
        + json.dumps({**case, **events[1], "batch": 8})
        + "\n"
    )
    [row] = policy_cost(str(trace), [4])
    # 2 requests at E(2) = 1.75 tokens and 2 at 1, at 0.01 s a token: 0.055 s; plus the 0.005 s
    # proposal
    assert (row["drafting_steps"], row["step_s"]) == (1, pytest.approx(0.15))
    assert row["extra_s"] == pytest.approx(0.005 + 0.005)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 256), st.floats(1e-3, 1.0), st.floats(0.3, 3.0), st.integers(0, 200))
def test_the_other_mode_runs_only_as_rare_probes(batch, plain_seconds, ratio, steps):
    """Whatever the costs, once both are measured the slower mode runs at most one probe per
    probe_every choices (a plain probe is two steps); where drafting does not pay, k = 0 (off)
    is the rule."""
    policy = AdaptiveK(4, explore_verifies=0)
    _plain_steps(policy, batch, plain_seconds)
    policy.choose(batch)  # the first probe
    _decode_step(policy, batch, True, plain_seconds * ratio)
    faster = policy.rate(batch, True) >= policy.min_gain * policy.rate(batch, False)
    choices = [policy.choose(batch) for _ in range(steps)]
    slower = sum(1 for k in choices if (k > 0) != faster)
    assert slower <= 2 * (1 + steps // policy.probe_every)


def test_a_full_power_of_two_batch_shares_its_bucket_with_what_it_falls_to():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64)] == [
        0,
        1,
        2,
        2,
        3,
        3,
        4,
        4,
        5,
        5,
        6,
        6,
    ]


def test_num_drafts_fits_budget_and_max_tokens():
    assert num_drafts(4, budget_left=3, tokens_left=10) == 2
    assert num_drafts(4, budget_left=10, tokens_left=2) == 1
    assert num_drafts(4, budget_left=1, tokens_left=10) == 0


def test_stats_and_yaml_mapping():
    stats = SpecDecodeStats()
    stats.observe(4, 2)
    stats.observe(2, 0)
    assert (stats.acceptance_rate, stats.mean_accepted_length, stats.accepted_per_pos) == (
        2 / 6,
        2.0,
        [1, 1, 0, 0],
    )
    assert SpeculativeConfig.from_yaml({"draft_model": "ngram", "verify_interval": 3}) == {
        "num_speculative_tokens": 3
    }


def test_serve_flags_override_the_yaml_section(tmp_path):
    import argparse

    from tandem.server.launch import add_arguments, build_configs

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    path = tmp_path / "serving.yaml"
    path.write_text("serving:\n  speculative_decoding: {verify_interval: 3, adaptive: false}\n")
    args = parser.parse_args(
        [
            "--config",
            str(path),
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 6}',
        ]
    )
    spec = build_configs(args)[0].speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.adaptive) == ("ngram", 6, False)
    assert build_configs(parser.parse_args([]))[0].speculative_config is None
    with pytest.raises(ValueError, match=r"in \[1, 16\]"):
        build_configs(parser.parse_args(["--speculative-config", '{"num_speculative_tokens": 0}']))


def test_a_buckets_samples_compare_at_the_batch_size_asked_for():
    """Plain samples taken as the batch fell to 5 and a drafting probe at 8 share bucket 5-8.
    Taken as they are, 5 requests in a bandwidth-bound step read as 5/8 of the plain rate at 8,
    and a drafting probe that loses at 8 looks like a win; rescaled to 8 by the step-cost fit,
    it loses."""
    policy = _trained(0.5, fixed=0.02, per_token=0.0001)
    _plain_steps(policy, 5, seconds=0.0205)  # on the fit's line: fixed + per_token * 5
    assert policy.rate(5, False) == pytest.approx(5 / 0.0205, rel=1e-3)
    assert policy.rate(8, False) == pytest.approx(
        8 / 0.0208, rel=2e-2
    )  # the fit's step at 8 tokens
    assert policy.choose(8) > 0  # the probe
    _decode_step(policy, 8, True, seconds=0.041)  # E(4) = 1.94 tokens a request for 2x a plain step
    assert policy.rate(8, True) < policy.rate(8, False)
    assert [policy.choose(8) for _ in range(10)] == [0] * 10


def test_a_verify_step_pays_the_proposal_that_fed_it_not_its_own():
    """Near max_tokens the drafts shrink: a verify step of requests with 4 drafts each (fed by
    a 40 ms proposal) proposes 1 draft each for the next step (5 ms). It costs its own 12 ms
    plus the 40 ms that fed it; charged its own proposal instead (the executor's seconds as
    they are), drafting looked 3x cheaper than it is."""
    policy = _trained(0.93, fixed=0.01, per_token=0.0001)
    _plain_steps(policy, 8, seconds=0.01)
    assert policy.choose(8) > 0
    _decode_step(
        policy, 8, False, seconds=0.05, proposal_seconds=0.04
    )  # plain, proposing 4 drafts each
    _decode_step(policy, 8, True, seconds=0.017, proposal_seconds=0.005)  # verify, proposing 1 each
    assert policy.rate(8, False) == pytest.approx(800)  # the proposing plain step: 10 ms of its own
    a = policy.acceptance
    assert policy.rate(8, True) == pytest.approx(
        8 * (1 - a**5) / (1 - a) / 0.052
    )  # E(4) tokens a request
