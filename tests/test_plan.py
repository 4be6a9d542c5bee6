"""Planner arithmetic on a hand-computable cost model, the elastic schedule, and `tandem plan`."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from tandem.cli import main as cli
from tandem.sim.cost_model import CostModel
from tandem.sim.planner import SLO, Traffic, elastic, plan
from tandem.tools.plan_cli import bucket_traffic, explain, traffic_of
from tandem.workload.traces import Row

# step = 10 ms + 0.1 ms per prompt token + 1 ms per decode; no KV bytes (transfer = latency only)
LINEAR = CostModel(
    "measured",
    0.01,
    {"fit": {"compute": (0, 1e-4, 0, 1e-3, 0), "memory": (0,) * 5}},
    kv_bytes_per_token=0,
    kv_capacity_tokens=100_000,
)
SLOS = SLO(ttft=1.0, itl=0.0505, utilization=0.5)


def test_plan_by_hand():
    p = plan(LINEAR, Traffic(rate=10, prompt_mean=1000, output_mean=100), SLOS)
    assert p.prefill_demand == 10_000 and p.decode_demand == 1_000
    # Decode: 0.01 + 0.001 B <= 0.0505 -> B = 40 (KV 40 x 1050 fits 100k);
    # Y = 40 / 0.05 = 800 tok/s.
    assert (p.decode.size, p.decode.throughput, p.decode.limit) == (
        40,
        pytest.approx(800),
        "ITL SLO",
    )
    assert p.num_decode == 3  # ceil(1000 / (800 x 0.5)) = ceil(2.5)
    # Prefill: chunk 4096 is the fastest that meets TTFT (2 steps of 0.4196 s); 2048 is within 5%
    # of it (9,534 vs 9,762 tok/s) at half the latency.
    assert p.prefill.size == 2048 and p.prefill.throughput == pytest.approx(2048 / 0.2148)
    assert p.prefill.limit == "bigger steps add < 5%"
    assert p.num_prefill == 3  # ceil(10000 / (9534.6 x 0.5)) = ceil(2.098)
    # Co-located: T = 192 prompt tokens + B = 20 decodes = 0.0492 s <= ITL;
    # min(0.192, 0.2) / 0.0492 req/s.
    co = p.colocated
    assert (co.prefill_tokens, co.decode_batch) == (192, 20) and co.step == pytest.approx(0.0492)
    assert co.rate == pytest.approx(0.192 / 0.0492) and co.decode_only_step == pytest.approx(0.03)
    assert p.num_colocated == 6  # ceil(10 / (3.902 x 0.5)) = ceil(5.125)
    assert sum(p.colocated_busy) == pytest.approx(10 / co.rate)
    assert p.recommendation.startswith("co-locate")
    text = "\n".join(explain(p, LINEAR))
    assert (
        "P = ceil(10,000 / (9,534 x 0.5))" in text
        and "D = ceil(1,000 / (800 x 0.5)) = ceil(2.500) = 3" in text
    )


def test_plan_limits():
    kv_bound = CostModel("measured", 0.01, LINEAR.terms, kv_capacity_tokens=10_500)
    assert (
        plan(kv_bound, Traffic(1, 1000, 100), SLOS).decode.size == 10
    )  # 10 x 1050 tokens fill the pool
    with pytest.raises(ValueError, match="ITL SLO"):
        plan(LINEAR, Traffic(1, 1000, 100), SLO(1.0, 0.005))
    with pytest.raises(ValueError, match="TTFT"):
        plan(LINEAR, Traffic(1, 1000, 100), SLO(0.05, 0.05))
    with pytest.raises(ValueError):
        SLO(1.0, 0.05, utilization=1.5)
    # A TTFT too tight for any mixed step: co-location cannot meet both SLOs.
    p = plan(LINEAR, Traffic(1, 5000, 100), SLO(ttft=0.8, itl=0.02, utilization=0.5))
    assert (
        p.colocated is None
        and p.num_colocated is None
        and p.recommendation.startswith("disaggregate")
    )


def test_elastic_schedule():
    buckets = [
        (0.0, Traffic(10, 1000, 100)),
        (1800.0, Traffic(20, 1000, 100)),
        (3600.0, Traffic(10, 1000, 100)),
    ]
    el = elastic(LINEAR, buckets, SLOS, 1800)
    assert [(b["P"], b["D"]) for b in el.buckets] == [(3, 3), (5, 5), (3, 3)]
    assert (el.total, el.fixed_prefill, el.fixed_decode, el.elastic) == (10, 3, 3, 4)
    assert [(s["start"], s["P"]) for s in el.switches] == [(1800.0, (3, 5)), (3600.0, (5, 3))]
    # A bucket whose prompts cannot meet TTFT is reported, and the others are still planned.
    el = elastic(LINEAR, [(0.0, Traffic(10, 1000, 100)), (60.0, Traffic(1, 50_000, 100))], SLOS, 60)
    assert el.buckets[1]["P"] is None and "TTFT" in el.buckets[1]["error"] and el.total == 6
    with pytest.raises(ValueError, match="no time bucket"):
        elastic(LINEAR, [(0.0, Traffic(1, 50_000, 100))], SLOS, 60)


def test_traffic_from_rows():
    rows = [Row(i, i * 1.0, 100 + i, 10) for i in range(3600)] + [
        Row(i, 3600 + i * 0.5, 50, 20) for i in range(3600)
    ]
    t = traffic_of(rows, rate_scale=2)
    assert t.rate == pytest.approx(2 * 7200 / 5399.5)
    assert t.prompt_mean == pytest.approx((sum(range(100, 3700)) + 50 * 3600) / 7200)
    b = bucket_traffic(rows, 3600)
    assert [round(x.rate, 2) for _, x in b] == [1.0, 2.0] and b[1][1].output_mean == 20
    with pytest.raises(ValueError):
        traffic_of([Row(0, 5.0, 1, 1), Row(1, 5.0, 1, 1)])


def _azure(path, minutes: list[float]) -> None:
    """One row per arrival; the rate of each 30-minute half given in requests per minute."""
    t0, lines, t = datetime(2023, 11, 16, 18), ["TIMESTAMP,ContextTokens,GeneratedTokens"], 0.0
    for half, per_min in enumerate(minutes):
        while t < (half + 1) * 1800:
            lines.append(
                f"{t0 + timedelta(seconds=t)},{1000 + int(t) % 7 * 100},{100 + int(t) % 5 * 20}"
            )
            t += 60 / per_min
    path.write_text("\n".join(lines) + "\n")


def test_plan_cli_on_a_trace(tmp_path, capsys):
    trace, out = tmp_path / "azure.csv", tmp_path / "plan.json"
    _azure(trace, [30, 120])
    rc = cli(
        [
            "plan",
            "--trace",
            str(trace),
            "--roofline",
            "h100",
            "--model-shape",
            "llama-3-8b",
            "--rate-scale",
            "200",
            "--bucket-minutes",
            "30",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and "P = ceil(" in text and "D = ceil(" in text and "elastic schedule" in text
    report = json.loads(out.read_text())
    p, el = report["plan"], report["elastic"]
    assert p["num_prefill"] >= 1 and p["num_decode"] >= 1 and len(el["buckets"]) == 2
    assert el["buckets"][1]["P"] > el["buckets"][0]["P"] and len(el["switches"]) == 1
    assert f"=> disaggregated P = {p['num_prefill']}, D = {p['num_decode']}" in text


def test_plan_cli_with_a_profile_and_a_rate(tmp_path, capsys):
    LINEAR.save(tmp_path / "lin.json")
    assert (
        cli(
            [
                "plan",
                "--profile",
                str(tmp_path / "lin.json"),
                "--rate",
                "10",
                "--prompt-mean",
                "1000",
                "--output-mean",
                "100",
                "--goodput",
                "tpot:50.5",
                "--utilization",
                "0.5",
            ]
        )
        == 0
    )
    assert "=> disaggregated P = 3, D = 3; co-located 6" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no traffic
        ["--rate", "5"],  # no lengths
        ["--rate", "-1", "--prompt-mean", "10", "--output-mean", "10"],
        ["--trace", "/nonexistent.csv"],
        [
            "--rate",
            "5",
            "--prompt-mean",
            "10",
            "--output-mean",
            "10",
            "--profile",
            "/nonexistent.json",
        ],
        ["--rate", "5", "--prompt-mean", "10", "--output-mean", "10", "--roofline", "h100"],
        ["--rate", "5", "--prompt-mean", "10", "--output-mean", "10", "--goodput", "tpot:1"],
        ["--rate", "5", "--prompt-mean", "10", "--output-mean", "10", "--utilization", "1.5"],
    ],
)
def test_plan_cli_bad_input(argv, capsys):
    given = any(a in ("--profile", "--roofline") for a in argv)
    model = [] if given else ["--roofline", "h100", "--model-shape", "llama-3-8b"]
    assert cli(["plan", *model, *argv]) == 2
    assert "error:" in capsys.readouterr().err


def test_plan_cli_strict_trace(tmp_path, capsys):
    trace = tmp_path / "bad.csv"
    _azure(trace, [30])
    trace.write_text(trace.read_text() + "not,a,row\n")
    args = ["plan", "--trace", str(trace), "--roofline", "h100", "--model-shape", "llama-3-8b"]
    assert cli(args) == 0 and "1 malformed lines skipped" in capsys.readouterr().out
    assert cli([*args, "--strict"]) == 2 and "error:" in capsys.readouterr().err


def test_sim_modules_do_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, tandem.sim.cost_model, tandem.sim.hardware, tandem.sim.planner, "
        "tandem.tools.plan_cli; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
