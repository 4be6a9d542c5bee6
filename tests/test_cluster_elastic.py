"""The elastic role controller, without a cluster: a switch needs its pressure signal to persist,
a switched instance dwells in its new role, and bad settings fail at construction."""

from __future__ import annotations

import pytest

from tandem.cluster.policy.elastic import ElasticConfig, RoleController, TimeSchedule
from tandem.cluster.policy.routing import InstanceState


def cluster(backlog: int, kv_usage: float) -> list[InstanceState]:
    """One prefill, one decode, one elastic instance (decode) under the given load."""
    return [
        InstanceState("p", "m", "prefill", waiting_prefill_tokens=backlog),
        InstanceState("d", "m", "decode", kv_usage=kv_usage),
        InstanceState("e", "m", "decode", elastic=True, kv_usage=kv_usage),
    ]


def test_a_switch_needs_the_signal_to_persist():
    ctl = RoleController(
        ElasticConfig(cooldown_s=0, persist_checks=3, min_dwell_s=0, prefill_backlog_tokens=100)
    )
    prefill_short, calm = cluster(1000, 0.0), cluster(0, 0.0)
    # A flickering signal (two checks, a calm one, two again) never switches.
    for t, state in enumerate([prefill_short, prefill_short, calm, prefill_short, prefill_short]):
        assert ctl.decide(t, state) is None
    assert ctl.decide(5, prefill_short) == ("e", "prefill")  # the third check in a row
    assert ctl.switches == [(5, "e", "prefill")]


def test_a_switched_instance_dwells_in_its_role():
    ctl = RoleController(
        ElasticConfig(
            cooldown_s=0,
            persist_checks=1,
            min_dwell_s=10,
            prefill_backlog_tokens=100,
            decode_kv_usage=0.5,
        )
    )
    assert ctl.decide(0, cluster(1000, 0.0)) == ("e", "prefill")
    flipped = cluster(0, 0.9)  # now decode is short: the elastic instance is wanted back
    flipped[2].role = "prefill"
    assert [ctl.decide(t, flipped) for t in (1, 5, 9.9)] == [None] * 3  # within its dwell time
    assert ctl.decide(10, flipped) == ("e", "decode")


def test_a_schedule_is_followed_at_once():
    ctl = RoleController(ElasticConfig(cooldown_s=0, persist_checks=5), TimeSchedule(((0.0, 2),)))
    assert ctl.decide(0, cluster(0, 0.0)) == ("e", "prefill")


@pytest.mark.parametrize("bad", [{"persist_checks": 0}, {"min_dwell_s": -1}, {"cooldown_s": -5}])
def test_bad_settings(bad):
    with pytest.raises(ValueError, match="persist_checks"):
        ElasticConfig(**bad)
