"""The simulator: the real scheduler and KV pool on a virtual clock. Coalesced decode runs
give exactly what stepping gives; no KV is leaked; P/D hands requests over; the elastic
controller moves roles under a load shift; policies change outcomes as they should."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tandem.cli import main as cli_main
from tandem.cluster.policy.elastic import ElasticConfig
from tandem.config import EngineConfig
from tandem.sim.cluster import ClusterConfig, ClusterSim
from tandem.sim.cost_model import CostModel
from tandem.sim.request import SimRequest
from tandem.sim.workload import mixed


def cost_model(kv_tokens: int = 60000) -> CostModel:
    # 4 ms a step, 20 us per prompt token, 0.1 ms per decode, a little for attention.
    return CostModel.from_json(
        {
            "kind": "measured",
            "overhead": 0.004,
            "terms": {"step": {"compute": [0.0, 2e-5, 1e-9, 1e-4, 2e-8], "memory": [0.0] * 5}},
            "kv_capacity_tokens": kv_tokens,
            "host_kv_capacity_tokens": kv_tokens // 4,
            "kv_bytes_per_token": 4096,
        }
    )


def workload(
    n: int = 300, rate: float = 10.0, seed: int = 0, shared: bool = False
) -> list[SimRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        hashes = tuple([0, 1 + i % 3]) if shared else ()
        out.append(SimRequest(i, t, rng.randint(20, 2500), rng.randint(2, 300), hash_ids=hashes))
    return out


def simulate(
    cfg: ClusterConfig,
    reqs: list[SimRequest],
    engine: EngineConfig | None = None,
    cost: CostModel | None = None,
) -> ClusterSim:
    sim = ClusterSim(
        cost or cost_model(), engine or EngineConfig.from_kwargs(max_num_batched_tokens=2048), cfg
    )
    sim.run(reqs)
    return sim


def assert_clean(sim: ClusterSim) -> None:
    for inst in sim.instances:
        assert inst.num_unfinished == 0 and not inst.busy and inst.reserved_tokens == 0
        assert inst.kv.num_free_blocks == inst.kv.pool.num_blocks, "KV blocks leaked"
        host = inst.kv.host_tier
        assert not host.req_to_host_blocks
        assert host.num_free_host_blocks + len(host._pending) == host.num_host_blocks


@pytest.mark.parametrize(
    "mode,policy,shared",
    [
        ("colocated", "fcfs", False),
        ("colocated", "multilevel", True),
        ("pd", "fcfs", True),
        ("elastic", "fcfs", False),
    ],
)
def test_coalesced_decode_runs_match_stepping(mode, policy, shared):
    engine = EngineConfig.from_kwargs(max_num_batched_tokens=1024, scheduling_policy=policy)
    runs = []
    for coalesce in (False, True):
        reqs = workload(shared=shared)
        cfg = ClusterConfig(
            3,
            mode,
            1,
            coalesce=coalesce,
            controller_interval=1.0,
            elastic=ElasticConfig(cooldown_s=2.0, prefill_backlog_tokens=1000),
        )
        sim = simulate(cfg, reqs, engine)
        assert_clean(sim)
        runs.append((sim, [r.record() for r in reqs]))
    (plain, a), (fast, b) = runs
    assert fast.instances[0].num_coalesced + fast.instances[1].num_coalesced > 0
    assert sum(i.num_steps for i in plain.instances) == sum(i.num_steps for i in fast.instances)
    assert a == b  # every request's TTFT, ITLs, E2E and queue time, exactly


def test_all_requests_finish_with_their_lengths_and_no_leak_under_memory_pressure():
    reqs = workload(200, rate=50.0)
    sim = simulate(ClusterConfig(2), reqs, cost=cost_model(kv_tokens=12000))
    assert_clean(sim)
    assert all(r.error is None and r.num_output == r.output_len for r in reqs)
    assert sum(i.scheduler.num_preemptions for i in sim.instances) > 0  # the pool really was short


def test_pd_hands_requests_from_prefill_to_decode():
    reqs = workload(100, shared=True)
    sim = simulate(ClusterConfig(3, "pd", 1), reqs)
    assert_clean(sim)
    handed = [r for r in reqs if len(r.instances) == 2]
    assert handed and all(r.instances[0] == "i0" and r.instances[1] in ("i1", "i2") for r in handed)
    assert all(r.num_output == r.output_len for r in reqs)
    assert sim.transfer_bytes > 0 and all(r.transfer_s > 0 for r in handed if r.output_len > 1)


def test_prefix_aware_routing_follows_the_cache():
    reqs = [SimRequest(i, i * 0.5, 2000, 5, hash_ids=(7, 8, 9)) for i in range(6)]
    simulate(ClusterConfig(4), reqs)
    assert len({r.instances[0] for r in reqs}) == 1  # all land where the shared prefix is cached


def test_elastic_controller_moves_roles_under_a_load_shift():
    short = [SimRequest(i, i * 0.02, 30, 200) for i in range(300)]
    long = [SimRequest(300 + i, 8.0 + i * 0.01, 3000, 20) for i in range(200)]
    cfg = ClusterConfig(
        4,
        "elastic",
        2,
        controller_interval=0.5,
        elastic=ElasticConfig(cooldown_s=1.0, prefill_backlog_tokens=2000, decode_kv_usage=0.05),
    )
    sim = simulate(cfg, short + long)
    assert_clean(sim)
    assert {role for _, _, role in sim.role_switches} == {"prefill", "decode"}, sim.role_switches
    assert all(r.error is None and r.num_output == r.output_len for r in short + long)


def test_multilevel_cuts_short_ttft_tail_on_a_long_short_mix():
    p99 = {}
    for policy in ("fcfs", "multilevel"):
        reqs, _ = mixed(400, 8.0, 0.1, (4000, 100), (30, 30), seed=1, priority_by_class=True)
        simulate(
            ClusterConfig(1),
            reqs,
            EngineConfig.from_kwargs(max_num_batched_tokens=2048, scheduling_policy=policy),
        )
        ttft = sorted(r.first_token - r.arrival for r in reqs if r.cls == "short")
        p99[policy] = ttft[int(0.99 * (len(ttft) - 1))]
    assert p99["multilevel"] < 0.75 * p99["fcfs"], p99


def test_simulate_cli_reports_and_rejects_bad_trace_lines(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
        "2023-11-16 18:15:47.00,oops,3\n2023-11-16 18:15:48.00,100,20\n"
    )
    profile = tmp_path / "p.json"
    cost_model().save(profile)
    json_out = tmp_path / "out.json"
    assert (
        cli_main(
            [
                "simulate",
                "--trace",
                str(trace),
                "--profile",
                str(profile),
                "--instances",
                "1,2",
                "--json",
                str(json_out),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert 'skipped_lines": 1' in out and "TTFT p50" in out
    assert cli_main(["simulate", "--trace", str(trace), "--profile", str(profile), "--strict"]) == 2
    assert ":3:" in capsys.readouterr().err
    assert (
        cli_main(["simulate", "--trace", str(tmp_path / "missing.csv"), "--profile", str(profile)])
        == 2
    )
    assert (
        cli_main(["simulate", "--trace", str(trace), "--profile", str(profile), "--mode", "pd"])
        == 2
    )


def test_policy_core_and_simulator_import_without_torch():
    code = (
        "import sys, tandem.sim.cluster, tandem.cluster.policy.routing, "
        "tandem.cluster.policy.elastic, tandem.tools.simulate_cli; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_frontend_delay_adds_to_each_isolated_requests_ttft_and_e2e():
    base, delayed = ([SimRequest(i, i * 10.0, 500, 20) for i in range(3)] for _ in range(2))
    simulate(ClusterConfig(1), base)
    simulate(ClusterConfig(1, frontend_delay=0.035), delayed)
    for a, b in zip(base, delayed):
        assert b.first_token - b.arrival == pytest.approx(a.first_token - a.arrival + 0.035)
        assert b.finished - b.arrival == pytest.approx(a.finished - a.arrival + 0.035)


def _simulate(tmp_path, config_yaml: str, *flags: str) -> list[dict]:
    """`tandem simulate` of a two-request trace under `config_yaml`; its results."""
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
        "2023-11-16 18:15:48.00,100,20\n"
    )
    profile, config = tmp_path / "p.json", tmp_path / "serving.yaml"
    cost_model().save(profile)
    config.write_text(config_yaml)
    out = tmp_path / "out.json"
    argv = ["--trace", str(trace), "--profile", str(profile), "--config", str(config)]
    assert cli_main(["simulate", *argv, "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())["results"]


def test_simulate_refuses_speculative_decoding_in_words_and_runs_without(tmp_path, capsys):
    results = _simulate(
        tmp_path,
        "serving:\n  speculative_decoding: {draft_model: 'self:int4', verify_interval: 4}\n"
        "  scheduler: {max_num_seqs: 8}\n",
    )
    assert "serving.speculative_decoding is not simulated" in capsys.readouterr().err
    assert results[0]["summary"]["completed"] == 2


def test_simulate_names_the_yaml_keys_it_ignores_and_takes_its_policy(tmp_path, capsys):
    config = (
        "serving:\n  engine: {block_size: 32, dtype: float32, swap_space: 1GiB}\n"
        "  scheduler: {policy: multilevel, max_num_seqs: 8}\n"
    )
    results = _simulate(tmp_path, config)
    err = capsys.readouterr().err
    assert "block_size, dtype, swap_space: not simulated" in err and "max_num_seqs" not in err
    assert [r["policy"] for r in results] == ["multilevel"]
    results = _simulate(tmp_path, config, "--policy", "fcfs,multilevel")
    assert [r["policy"] for r in results] == ["fcfs", "multilevel"]
