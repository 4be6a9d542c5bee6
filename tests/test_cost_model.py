"""Cost model: the fit recovers known coefficients, the roofline is physically sane, profiles
round-trip through JSON, and `tandem profile` measures a real (tiny) executor."""

from __future__ import annotations

import itertools
import json

import pytest

from tandem.cli import main as cli
from tandem.sim.cost_model import BatchShape, CostModel, fit_linear, measured
from tandem.sim.hardware import ACCELERATORS, load_cost_model, roofline
from tandem.workload.model_shapes import get_shape

TRUE = (2e-3, 5e-5, 1e-9, 1e-4, 2e-7)  # const, prefill tokens, pairs, decode seqs, decode context


def _samples(coef=TRUE) -> list[list[float]]:
    rows = []
    for t, ctx in itertools.product((16, 256, 2048), (0, 512)):
        rows.append([t, t * (ctx + t), 0, 0])
    for b, c in itertools.product((1, 8, 64), (64, 1024)):
        rows.append([0, 0, b, b * c])
    rows.append([128, 128 * 128, 16, 16 * 300])
    return [r + [coef[0] + sum(k * v for k, v in zip(coef[1:], r))] for r in rows]


def test_fit_recovers_exact_coefficients():
    coef, err = fit_linear(_samples())
    assert coef == pytest.approx(TRUE, rel=1e-6)
    assert err["max_rel_error"] < 1e-9


def test_fit_is_non_negative():
    # Times that fall with the decode context would ask for a negative coefficient.
    rows = [r[:4] + [r[4] - 1e-7 * r[3]] for r in _samples((2e-3, 5e-5, 1e-9, 1e-4, 0.0))]
    coef, _ = fit_linear(rows)
    assert min(coef) >= 0 and coef[4] == 0


def test_fit_rejects_bad_samples():
    with pytest.raises(ValueError):
        fit_linear([[1, 1, 1, 1, 0.1]])
    with pytest.raises(ValueError):
        fit_linear([[1, 1, 1, 1, 0.1], [2, 2, 2, 2, -1.0]])


def test_measured_model_step_time_matches_the_linear_form():
    cm = measured(_samples(), kv_bytes_per_token=1000, kv_capacity_tokens=10_000)
    b = BatchShape(100, 100 * 100, 10, 10 * 200)
    assert cm.step_time(b) == pytest.approx(
        TRUE[0] + 100 * TRUE[1] + 1e4 * TRUE[2] + 10 * TRUE[3] + 2000 * TRUE[4]
    )
    assert cm.decode_throughput(10, 200) == pytest.approx(
        10 / cm.step_time(BatchShape(0, 0, 10, 2000))
    )
    swap, recompute = cm.preemption_costs()
    assert swap == pytest.approx(2 * 1000 / cm.host_bandwidth)
    assert recompute == pytest.approx(1 / cm.prefill_throughput())


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound():
    cm, h100, shape = roofline("h100", "llama-3-8b"), ACCELERATORS["h100"], get_shape("llama-3-8b")
    weights_time = shape.num_params * 2 / (h100.hbm_bandwidth * h100.bandwidth_efficiency)
    decode1 = cm.step_time(BatchShape(num_decode_seqs=1, decode_context=1024))
    assert 5e-3 < decode1 < 8e-3
    assert decode1 == pytest.approx(weights_time + h100.step_overhead, rel=0.02)
    prefill = BatchShape(2048, 2048 * 2048)
    lin = cm.terms["linear"]
    assert (
        lin["compute"][1] * 2048 > lin["memory"][0]
    )  # GEMMs over 2k tokens outlast the weight read
    flops = 2 * shape.num_params * 2048 / (h100.peak_flops * h100.flops_efficiency)
    assert cm.step_time(prefill) > flops
    assert cm.prefill_throughput() > 20 * cm.decode_throughput(1, 1024)
    assert cm.step_time(BatchShape(0, 0, 64, 64 * 1024)) > decode1  # KV reads grow with the batch
    kv = 2 * 32 * 8 * 128 * 2
    assert cm.kv_bytes_per_token == kv
    assert cm.kv_capacity_tokens == int((80 * 2**30 * 0.9 - shape.num_params * 2 - 2 * 2**30) // kv)
    assert cm.kv_transfer_time(1000) == pytest.approx(1e-5 + 1000 * kv / 450e9)


def test_roofline_memory_and_parallelism():
    with pytest.raises(ValueError, match="raise --tp"):
        roofline("h100", "llama-3-70b")
    tp4 = roofline("h100", "llama-3-70b", tp=4)
    assert tp4.kv_capacity_tokens > 0
    assert roofline("h200", "llama-3-8b").step_time(BatchShape(0, 0, 1, 1)) < roofline(
        "h100", "llama-3-8b"
    ).step_time(BatchShape(0, 0, 1, 1))
    with pytest.raises(ValueError, match="known"):
        roofline("tpu9", "llama-3-8b")
    with pytest.raises(ValueError, match="interconnect"):
        roofline("h100", "llama-3-8b", interconnect="carrier-pigeon")
    assert roofline("h100", "llama-3-8b", interconnect="rdma").link_bandwidth == 50e9


def test_json_round_trip(tmp_path):
    for cm in (roofline("a100-80gb", "llama-3-8b"), measured(_samples(), kv_bytes_per_token=10)):
        path = tmp_path / f"{cm.kind}.json"
        cm.save(path)
        back = load_cost_model(str(path))
        assert back == cm and back.step_time(BatchShape(64, 4096, 8, 800)) == cm.step_time(
            BatchShape(64, 4096, 8, 800)
        )
    assert load_cost_model("h100:llama-3-8b") == roofline("h100", "llama-3-8b")
    (tmp_path / "bad.json").write_text(
        json.dumps({"kind": "measured", "overhead": 0, "terms": {"x": {"compute": [1]}}})
    )
    for bad in (str(tmp_path / "bad.json"), str(tmp_path / "missing.json"), "h100", "h100:gpt-9"):
        with pytest.raises(ValueError):
            load_cost_model(bad)
    with pytest.raises(ValueError, match="unknown cost model field"):
        CostModel.from_json({**roofline("h100", "llama-3-8b").to_json(), "colour": "red"})


def test_profile_quick_on_a_tiny_model(tiny_model_dirs, tmp_path, capsys):
    out = tmp_path / "tiny.json"
    rc = cli(
        [
            "profile",
            "--model",
            tiny_model_dirs["llama"],
            "--quick",
            "--repeats",
            "1",
            "--dtype",
            "float32",
            "--num-threads",
            "1",
            "--kv-cache-memory",
            "2000000",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    cm = load_cost_model(str(out))
    assert cm.kind == "measured" and cm.kv_capacity_tokens > 0 and cm.info["device"] == "cpu"
    assert cm.info["temperature"] == 0.0  # greedy, as the benches' requests
    assert len(cm.info["samples"]) == 8 and cm.info["fit"]["median_rel_error"] >= 0
    assert (
        cm.step_time(BatchShape(0, 0, 4, 128)) > 0
        and cm.info["prefill_table"]
        and cm.info["decode_table"]
    )
    out_text = capsys.readouterr().out
    assert "fit over 8 steps" in out_text and "measured on: " in out_text
    m = cm.info["machine"]
    assert (
        m["cores_used"] == 1
        and m["dtype"] == "float32"
        and m["torch"]
        and m["gpu"] is None
        and m["cpu_model"]
    )
    assert (
        cli(
            [
                "plan",
                "--profile",
                str(out),
                "--rate",
                "1",
                "--prompt-mean",
                "100",
                "--output-mean",
                "10",
            ]
        )
        == 0
    )
    plan_out = capsys.readouterr().out
    assert (
        f"measured on: {m['cpu_model']}" in plan_out and "warning" not in plan_out
    )  # made here: no warning


def test_profile_roofline_and_bad_flags(tmp_path, capsys):
    out = tmp_path / "h100.json"
    assert (
        cli(["profile", "--roofline", "h100", "--model-shape", "llama-3-8b", "--out", str(out)])
        == 0
    )
    assert load_cost_model(str(out)).kind == "roofline"
    for argv in (
        ["--roofline", "h100"],
        ["--roofline", "mi300", "--model-shape", "llama-3-8b"],
        ["--tp", "2"],
        ["--roofline", "h100", "--model-shape", "llama-3-8b", "--repeats", "0"],
        ["--roofline", "h100", "--model-shape", "llama-3-8b", "--temperature", "-1"],
    ):
        capsys.readouterr()
        assert cli(["profile", "--out", str(tmp_path / "x.json"), *argv]) == 2
        assert "error:" in capsys.readouterr().err
