"""The automatic migration policy, without a cluster: which request leaves which short decode
instance for which one, and what keeps it from moving (no room, cooldown, a target that would
itself run short); and the router's loop, which decides again only on states polled after a
move has landed."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.responses import JSONResponse

from tandem.cluster.policy.migration import (
    DecodingRequest,
    Migration,
    MigrationConfig,
    choose_migration,
    usage_after,
)
from tandem.cluster.policy.routing import InstanceState, RoutingWeights
from tandem.cluster.router.migrate_loop import MigrationLoop
from tandem.cluster.router.pd_decode import DecodeLeg
from tandem.cluster.router.pool import Instance, InstancePool

CFG = MigrationConfig(kv_usage=0.9, target_kv_usage=0.8, cooldown_s=10)


def dec(iid: str, used: int, capacity: int = 1000, **kw) -> InstanceState:
    return InstanceState(
        iid, "m", "decode", kv_usage=used / capacity, kv_free_tokens=capacity - used, **kw
    )


def req(rid: str, on: str, num_tokens: int, kv_tokens: int | None = None) -> DecodingRequest:
    return DecodingRequest(
        rid, on, num_tokens, kv_tokens if kv_tokens is not None else num_tokens + 50
    )


def test_the_request_freeing_the_most_goes_where_there_is_most_room():
    states = [dec("a", 950), dec("b", 100), dec("c", 300)]
    reqs = [req("small", "a", 200), req("big", "a", 500), req("elsewhere", "b", 100)]
    assert choose_migration(states, reqs, CFG, 0.0, {}) == Migration("big", "a", "b")


def test_nothing_moves_without_a_short_instance_or_a_target():
    assert (
        choose_migration([dec("a", 850), dec("b", 0)], [req("r", "a", 800)], CFG, 0.0, {}) is None
    )
    # both short: no target
    assert (
        choose_migration([dec("a", 950), dec("b", 920)], [req("r", "a", 500)], CFG, 0.0, {}) is None
    )


def test_a_request_that_would_fill_the_target_stays_and_a_smaller_one_goes():
    # b takes 300 more tokens at most while staying at <= 0.8 usage
    states = [dec("a", 950), dec("b", 500)]
    reqs = [req("big", "a", 600), req("mid", "a", 250), req("tiny", "a", 50)]
    assert choose_migration(states, reqs, CFG, 0.0, {}) == Migration("mid", "a", "b")
    # the quota (prompt + max_tokens) counts, not only what it holds now
    assert choose_migration(states, [req("growing", "a", 100, kv_tokens=900)], CFG, 0.0, {}) is None


def test_preempted_requests_mean_short_even_at_low_usage():
    states = [dec("a", 500, num_preempted=2), dec("b", 0)]
    assert choose_migration(states, [req("r", "a", 300)], CFG, 0.0, {}) == Migration("r", "a", "b")
    off = MigrationConfig(preempted=0)
    assert choose_migration(states, [req("r", "a", 300)], off, 0.0, {}) is None
    # an instance with preempted requests is no target either
    assert (
        choose_migration(
            [dec("a", 950), dec("b", 0, num_preempted=1)], [req("r", "a", 300)], CFG, 0.0, {}
        )
        is None
    )


def test_only_available_decode_instances_take_a_request():
    reqs = [req("r", "a", 300)]
    for other in (
        dec("b", 0, draining=True),
        dec("b", 0, healthy=False),
        InstanceState("b", "m", "prefill", kv_free_tokens=1000),
    ):
        assert choose_migration([dec("a", 950), other], reqs, CFG, 0.0, {}) is None
    # a draining source may still shed a request
    assert choose_migration(
        [dec("a", 950, draining=True), dec("b", 0)], reqs, CFG, 0.0, {}
    ) == Migration("r", "a", "b")


def test_the_fullest_source_goes_first():
    states = [dec("a", 920), dec("b", 990), dec("c", 0, capacity=4000)]
    reqs = [req("ra", "a", 300), req("rb", "b", 300)]
    assert choose_migration(states, reqs, CFG, 0.0, {}) == Migration("rb", "b", "c")


def test_a_moved_request_waits_out_its_cooldown_and_never_ping_pongs():
    reqs = [req("r", "a", 400)]
    states = [dec("a", 950), dec("b", 100)]
    assert choose_migration(states, reqs, CFG, 5.0, {"r": 0.0}) is None
    assert choose_migration(states, reqs, CFG, 10.0, {"r": 0.0}) == Migration("r", "a", "b")
    # after the move b holds it under target_kv_usage, so b is not short: nothing moves back
    after = [dec("a", 550), dec("b", 550)]
    assert choose_migration(after, [req("r", "b", 400)], CFG, 100.0, {}) is None


def test_usage_after():
    s = dec("a", 250)  # 750 free of 1000
    assert usage_after(s, 250) == pytest.approx(0.5)
    assert usage_after(s, 751) == float("inf")
    assert usage_after(dec("full", 1000), 1) == float("inf")


@pytest.mark.parametrize(
    "kw,error",
    [
        ({"kv_usage": 0.8, "target_kv_usage": 0.8}, "target_kv_usage < kv_usage"),
        ({"kv_usage": 1.2}, "kv_usage <= 1"),
        ({"interval_s": 0}, "interval_s > 0"),
        ({"preempted": -1}, "preempted >= 0"),
    ],
)
def test_bad_settings_fail_at_construction(kw, error):
    with pytest.raises(ValueError, match=error):
        MigrationConfig(**kw)


class Chain:
    """DecodeChain's live legs and migrate(), without instances: a move sets `move_to`."""

    def __init__(self, pool: InstancePool, legs: list[DecodeLeg]) -> None:
        self.pool, self.live, self.calls = pool, {leg.id: leg for leg in legs}, []

    async def migrate(self, request_id: str, to: str, reason: str) -> JSONResponse:
        self.calls.append((request_id, to, reason))
        self.live[request_id].move_to = self.pool.instances[to]
        return JSONResponse({"id": request_id})


def test_the_loop_decides_again_only_on_states_polled_after_a_move_landed():
    a, b = Instance("a", "http://a", "m"), Instance("b", "http://b", "m")
    pool = InstancePool([a, b], RoutingWeights(), client=None)
    a.state, b.state = dec("a", 950), dec("b", 100)
    legs = [
        DecodeLeg("r1", "m", a, 450, num_tokens=400),
        DecodeLeg("r2", "m", a, 350, num_tokens=300),
    ]
    chain = Chain(pool, legs)
    loop = MigrationLoop(CFG, chain, pool)
    pool.polled_at = 0.0
    assert asyncio.run(loop.step(1.0)) == Migration("r1", "a", "b")
    assert asyncio.run(loop.step(1.5)) is None  # r1 is moving
    legs[0].dec, legs[0].move_to = b, None  # it has landed; the states polled at 0.0 do not show it
    assert asyncio.run(loop.step(2.0)) is None and asyncio.run(loop.step(2.5)) is None
    pool.polled_at, a.state, b.state = (
        2.1,
        dec("a", 920),
        dec("b", 420),
    )  # a fresh poll: a is still short
    assert asyncio.run(loop.step(3.0)) == Migration("r2", "a", "b")
    assert chain.calls == [("r1", "b", "kv_short"), ("r2", "b", "kv_short")]
