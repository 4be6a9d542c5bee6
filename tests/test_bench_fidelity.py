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
