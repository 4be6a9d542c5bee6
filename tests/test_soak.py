"""A short `tandem bench soak` on a tiny model it serves itself, with a KV pool of 32 blocks so
requests are preempted: clients that leave, malformed bodies and prefix churn, then none lost,
none hung, every request accounted for, the KV pool whole once idle (the 20-minute soak is the
benchmark: docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from structured_fixture import with_tokenizer

from tandem.bench.soak import FAULT_WINDOW_S, Outcomes, count, report, run_soak
from tandem.cli import build_parser

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.mark.slow  # a served process and 10 s of traffic
def test_short_soak_loses_nothing_and_gives_the_kv_back(tiny_model_dirs, tmp_path):
    model = with_tokenizer(tiny_model_dirs["llama"], tmp_path / "m")
    args = build_parser().parse_args(
        [
            "bench",
            "soak",
            "--model",
            model,
            "--duration",
            "10",
            "--kv-cache-memory",
            str(1 << 18),
            "--concurrency",
            "8",
            "--serve-arg=--dtype",
            "--serve-arg=float32",
            "--serve-arg=--num-threads",
            "--serve-arg=1",
        ]
    )
    report = run_soak(args)
    checks = report["checks"]
    assert checks["none_lost"] and checks["none_hung"] and checks["all_accounted"], report
    assert checks["errors_only_at_fault"] and report["errors"] == 0, report  # no fault here: no 5xx
    assert checks["kv_free_at_idle"] and report["kv_total_blocks"] == 32, report
    assert report["answered"] > 0 and report["refused"] > 0 and report["left_on_purpose"] > 0
    assert report["preemptions"] > 0  # the pool was small enough
    assert report["prefix_cache_hit_share"] > 0
    assert (
        report["resources_warm"]
        and report["resources_end"]
        and report["itl_p99_last_s"] is not None
    )


def test_an_error_the_client_sees_is_answered_not_lost_and_must_come_from_the_fault():
    """A 5xx or an error event reaches the client (not lost), but passes only in the window
    just after the fault; a 503 is a refusal; the report accounts for every request."""
    tally = Outcomes(sent=4)
    count(tally, 503, "no room", 10.0)
    count(tally, 502, "decode side failed", 101.0)
    count(tally, 200, "", 102.0)
    tally.lost.append("stream ended without [DONE]")
    out = report(tally, {}, None, None, 200.0)
    assert (out["refused"], out["errors"], out["answered"], out["lost"]) == (1, 1, 1, 1)
    assert out["checks"]["all_accounted"] and not out["checks"]["none_lost"]
    assert not out["checks"]["errors_only_at_fault"]  # no fault at all
    tally.fault_at = 100.0
    assert report(tally, {}, None, None, 200.0)["checks"]["errors_only_at_fault"]
    tally.fault_at = 101.0 - FAULT_WINDOW_S - 1
    assert not report(tally, {}, None, None, 200.0)["checks"]["errors_only_at_fault"]
