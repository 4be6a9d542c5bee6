"""Mixture of experts in the simulator: the share of experts a batch touches, the roofline's
reads (active weights at batch 1, all of them for memory), and `tandem plan` on an MoE profile."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.cli import main as cli
from tandem.sim.cost_model import BatchShape, CostModel
from tandem.sim.hardware import ACCELERATORS, load_cost_model, roofline
from tandem.sim.moe import touched_experts, weight_bytes_read
from tandem.workload.model_shapes import get_shape, kv_bytes_per_token

QWEN = get_shape("qwen3-30b-a3b")
H100 = ACCELERATORS["h100"]
BW = H100.hbm_bandwidth * H100.bandwidth_efficiency


def test_qwen3_30b_a3b_counts_its_parameters():
    # 30.5B in all, 3.3B activated, as the model card says; each expert is 3 x 2048 x 768.
    assert QWEN.expert_params == 48 * 128 * 3 * 2048 * 768
    assert QWEN.num_params - QWEN.expert_params == QWEN.active_params - 48 * 8 * 3 * 2048 * 768
    assert 30.4e9 < QWEN.num_params < 30.6e9 and 3.3e9 < QWEN.active_params < 3.4e9
    dense = get_shape("llama-3-8b")
    assert dense.expert_params == 0 and dense.active_params == dense.num_params


@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_touched_experts_against_the_formula_and_a_draw(tokens):
    e, k = 128, 8
    expected = touched_experts(e, k, tokens)
    assert expected == pytest.approx(e * (1 - (1 - k / e) ** tokens), rel=1e-12)
    # Monte Carlo: every token picks k distinct experts uniformly; count the distinct ones.
    rng, trials = np.random.default_rng(tokens), 200
    picks = rng.random((trials, tokens, e)).argsort(axis=-1)[..., :k]
    chosen = np.zeros((trials, e), dtype=bool)
    np.put_along_axis(chosen, picks.reshape(trials, -1), True, axis=1)
    drawn = chosen.sum(axis=1)
    assert drawn.mean() == pytest.approx(expected, abs=4 * drawn.std() / np.sqrt(trials) + 0.01)
    assert touched_experts(e, k, 0) == 0.0 and touched_experts(0, 0, tokens) == 0.0


def test_decode_at_batch_1_reads_the_active_weights_only():
    cm, context = roofline("h100", "qwen3-30b-a3b"), 1024
    kv = kv_bytes_per_token(QWEN) * (context + 1)
    step = cm.step_time(BatchShape(num_decode_seqs=1, decode_context=context))
    assert weight_bytes_read(QWEN, 1) == pytest.approx(QWEN.active_params * 2, rel=1e-12)
    assert step == pytest.approx(H100.step_overhead + (QWEN.active_params * 2 + kv) / BW)
    assert step < H100.step_overhead + 0.15 * QWEN.num_params * 2 / BW
    # 256 tokens touch every expert: the step reads all the weights.
    big = cm.step_time(BatchShape(num_decode_seqs=256, decode_context=256 * 16))
    assert big > H100.step_overhead + 0.999 * QWEN.num_params * 2 / BW
    assert weight_bytes_read(QWEN, 256) == pytest.approx(QWEN.num_params * 2, rel=1e-6)


def test_memory_counts_every_expert_and_flops_the_active_ones():
    cm = roofline("h100", "qwen3-30b-a3b")
    weights, kv = QWEN.num_params * 2, kv_bytes_per_token(QWEN)
    assert cm.info["weight_bytes"] == weights
    assert cm.kv_capacity_tokens == int((80 * 2**30 * 0.9 - weights - 2 * 2**30) // kv)
    flops = H100.peak_flops * H100.flops_efficiency
    assert cm.terms["linear"]["compute"][1] == pytest.approx(2 * QWEN.active_params / flops)
    # A 2k-token prefill step computes with the active weights but reads every expert.
    prefill = cm.step_time(BatchShape(2048, 2048 * 2048))
    assert prefill > max(2 * QWEN.active_params * 2048 / flops, 0.999 * weights / BW)
    assert "experts" not in roofline("h100", "llama-3-8b").terms["linear"]


def test_experts_survive_json_and_calibration(tmp_path):
    cm = roofline("h200", "qwen3-30b-a3b", tp=2)
    cm.save(tmp_path / "moe.json")
    back = load_cost_model(str(tmp_path / "moe.json"))
    shape = BatchShape(64, 4096, 8, 800)
    assert back == cm and back.step_time(shape) == cm.step_time(shape)
    slow = cm.calibrated(factor=2.0)
    e, k, seconds = slow.terms["linear"]["experts"]
    assert (e, k) == (128, 8) and seconds == 2 * cm.terms["linear"]["experts"][2]
    decode = BatchShape(num_decode_seqs=16, decode_context=16 * 100)
    assert slow.step_time(decode) == pytest.approx(2 * cm.step_time(decode))
    bad = cm.to_json()
    bad["terms"]["linear"]["experts"] = [128, 8]
    with pytest.raises(ValueError, match="experts"):
        CostModel.from_json(bad)


def test_plan_on_the_mooncake_trace_with_the_moe_profile(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["plan", "--trace", "mooncake", "--profile", "h100:qwen3-30b-a3b", "--json", str(out)]
    assert cli(args) == 0
    text = capsys.readouterr().out
    for b in (1, 16, 256):
        assert f"batch {b:>3}: " in text
    assert "8.0 of 128 experts per layer" in text and "128.0 of 128 experts" in text
    p = json.loads(out.read_text())["plan"]
    assert p["num_prefill"] >= 1 and p["num_decode"] >= 1
    assert f"=> disaggregated P = {p['num_prefill']}, D = {p['num_decode']}" in text
