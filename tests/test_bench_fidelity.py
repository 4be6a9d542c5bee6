"""`tandem bench fidelity`'s figures: the simulation's error against the replays' mean, judged
against 5% or the replays' own spread, and the front end measured from the server's timings."""

import pytest

from tandem.tools.fidelity_cli import compare, format_table, frontend_seconds, step_figures


def _summary(scale: float) -> dict:
    pcts = {"p50": 100 * scale, "p90": 200 * scale, "p99": 400 * scale}
    return {m: dict(pcts) for m in ("ttft_ms", "itl_ms", "e2e_ms")}


def test_compare_judges_error_against_five_percent_or_the_spread():
    real = [_summary(0.9), _summary(1.1)]  # spread 10% around the mean
    rows = compare(real, _summary(1.08))
    assert len(rows) == 9
    r = rows[0]
    assert r["real_mean"] == pytest.approx(100) and r["real_spread"] == pytest.approx(0.1)
    assert r["error"] == pytest.approx(0.08) and r["within"] and r["bound"] == "spread"
    tight = compare([_summary(1.0), _summary(1.0)], _summary(1.08))[0]
    assert not tight["within"] and tight["bound"] == "5%"
    assert "outside 5%" in format_table([tight])


def test_frontend_is_client_e2e_less_the_engine_time():
    def run(gaps):
        reqs = [
            {
                "success": True,
                "e2e": 1.0 + g,
                "metrics": {"queue_time": 0.2, "prefill_time": 0.3, "decode_time": 0.5},
            }
            for g in gaps
        ]
        reqs.append({"success": True, "e2e": 9.0, "metrics": None})  # no timings: not counted
        counters = {"steps": 10, "step_seconds": 0.5}
        return {"results": {"requests": reqs, "server_counters": counters}}

    runs = [run([0.01, 0.02]), run([0.03])]
    assert frontend_seconds(runs) == pytest.approx(0.02)
    sim = {"steps": 20, "busy_share": 0.5, "summary": {"duration_s": 2.0}}
    assert step_figures(runs, sim) == pytest.approx(
        {"real_steps": 10, "real_step_ms": 50.0, "sim_steps": 20, "sim_step_ms": 50.0}
    )


def test_step_trace_records_the_cost_models_batch_shape():
    from tandem.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from tandem.core.sampling_params import SamplingParams
    from tandem.engine.step_trace import batch_context

    new = NewRequestData("p", [1] * 40, [], SamplingParams(), [], 8)  # a chunk after 8 tokens
    so = SchedulerOutput(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=[CachedRequestData("d1", [], 99), CachedRequestData("d2", [], 9)],
        num_scheduled_tokens={"p": 16, "d1": 1, "d2": 1},
    )
    assert batch_context(so) == (16 * (8 + 16), 100 + 10)


def test_real_steps_are_compared_with_the_cost_model_by_kind(tmp_path):
    import json

    from tandem.sim.cost_model import CostModel
    from tandem.tools.fidelity_steps import compare_steps, format_steps

    term = {"compute": (0, 1e-3, 0, 2e-3, 0), "memory": (0,) * 5}
    cost = CostModel("measured", 0.01, {"fit": term})

    def step(start, seconds, prefill, decodes, running=1):
        return {
            "start": start,
            "seconds": seconds,
            "tokens": prefill + decodes,
            "prefill_tokens": prefill,
            "throttled_prefill_tokens": 0,
            "prefill_attention": prefill * prefill,
            "decodes": decodes,
            "decode_context": 50 * decodes,
            "running": running,
            "waiting": 0,
        }

    steps = [
        step(0.0, 0.012, 0, 1),  # model: 12 ms
        step(0.013, 0.022, 0, 6),  # model 22 ms
        step(0.036, 0.055, 40, 1),  # mixed: model 52 ms
        step(0.092, 0.050, 40, 0, running=0),  # prefill: model 50 ms; idle after it
        step(1.000, 0.011, 0, 1),
    ]
    path = tmp_path / "steps-1.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    report = compare_steps([path], cost)
    assert report["kinds"]["decode"]["steps"] == 3
    assert report["kinds"]["decode"]["median_error"] == pytest.approx(0.0, abs=1e-9)
    assert report["kinds"]["mixed"]["median_error"] == pytest.approx(52 / 55 - 1)
    assert report["kinds"]["prefill"]["median_abs_error"] == pytest.approx(0.0, abs=1e-9)
    assert report["gap_ms"] == pytest.approx(1.0)  # the 900 ms idle wait is not counted
    assert "mixed" in format_steps(report)


def test_decode_excess_is_a_line_through_the_median_excess_per_batch_size(tmp_path):
    import json

    from tandem.sim.cost_model import BatchShape, CostModel
    from tandem.tools.fidelity_steps import decode_excess

    term = {"compute": (0, 1e-3, 0, 2e-3, 1e-6), "memory": (0,) * 5}
    cost = CostModel("measured", 0.005, {"fit": term})
    steps = []
    for n in (1, 4, 16):
        for i in range(5):
            shape = BatchShape(0, 0, n, n * (100 + i))
            late = 0.5 if i == 0 else 0.0  # one step the OS delayed: the median ignores it
            seconds = cost.step_time(shape) + 0.0015 + 0.0003 * n + late
            steps.append(
                {
                    "start": float(len(steps)),
                    "seconds": seconds,
                    "tokens": n,
                    "prefill_tokens": 0,
                    "throttled_prefill_tokens": 0,
                    "prefill_attention": 0,
                    "decodes": n,
                    "decode_context": n * (100 + i),
                    "running": n,
                    "waiting": 0,
                }
            )
    path = tmp_path / "steps-calibration.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    per_step, per_seq = decode_excess([path], cost)
    assert per_step == pytest.approx(0.0015) and per_seq == pytest.approx(0.0003)
    calibrated = cost.calibrated(1.0, per_step, per_seq)
    shape = BatchShape(0, 0, 8, 800)
    assert calibrated.step_time(shape) == pytest.approx(cost.step_time(shape) + 0.0015 + 0.0024)
    prefill = BatchShape(512, 512 * 512)  # a step decoding nothing pays the step's share only
    assert calibrated.step_time(prefill) == pytest.approx(cost.step_time(prefill) + 0.0015)
