"""`tandem analyze`: trace readers, workload figures, recommendation rules, CLI output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.cli import main
from tandem.workload.analyze import (
    analyze,
    in_flight,
    length_stats,
    prefix_reuse,
    rate_curve,
    recommend,
)
from tandem.workload.model_shapes import get_shape, kv_bytes_per_token
from tandem.workload.traces import Row, read_trace, resolve_trace, trace_format

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def azure_csv(tmp_path, rows: list[tuple[float, int, int]], extra: str = ""):
    path = tmp_path / "azure.csv"
    path.write_text(
        HEADER + "".join(f"2023-11-16 18:00:{s:09.6f},{i},{o}\n" for s, i, o in rows) + extra
    )
    return path


def mooncake_jsonl(tmp_path, recs: list[tuple[int, list[int]]]):
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {"timestamp": 1000 * n, "input_length": i, "output_length": 10, "hash_ids": ids}
            )
            + "\n"
            for n, (i, ids) in enumerate(recs)
        )
    )
    return path


def log_line(arrival: float, prompt: int, output: int, e2e: float) -> str:
    """The fields server/metrics.py log_request writes."""
    return (
        json.dumps(
            {
                "request_id": "r",
                "arrival_time": arrival,
                "prompt_tokens": prompt,
                "output_tokens": output,
                "cached_prompt_tokens": 0,
                "priority": None,
                "queue_time": 0.0,
                "ttft": 0.1,
                "mean_itl": 0.01,
                "e2e_latency": e2e,
                "finish_reason": "length",
            }
        )
        + "\n"
    )


def test_length_stats():
    s = length_stats(np.arange(1, 101))
    assert (s["p50"], s["p95"], s["p99"], s["max"]) == pytest.approx((50.5, 95.05, 99.01, 100))
    s = length_stats(np.array([10] * 50 + [1000] * 45 + [5000] * 5))
    assert s["share_under_200"] == 0.5 and s["share_over_4000"] == 0.05


def test_rate_curve_peak_trough_and_partial_bin():
    arr = np.array([0, 1, 2, 15, 20, 21, 22, 23, 23.5, 30.5])
    r = rate_curve(arr, bin_seconds=10)
    assert r["curve_rps"] == pytest.approx([0.3, 0.1, 0.5])  # [30, 40) is partial: left out
    assert (r["peak_rps"], r["trough_rps"], r["peak_rps_1s"]) == (0.5, 0.1, 2)
    assert rate_curve(np.array([0.0, 0.0]), 60)["curve_rps"] == [2.0]


def test_in_flight_sweep():
    f = in_flight(np.array([0.0, 1.0, 2.0]), np.array([100, 50, 10]), np.array([2.0, 1.0, 1.0]))
    assert (f["peak_tokens"], f["peak_requests"]) == (
        150,
        2,
    )  # at t=2 two end before the third starts
    assert f["mean_tokens"] == pytest.approx((100 + 150 + 10) / 3)
    assert f["curve_tokens"] == [100, 150, 10, 0]  # the peak of each second


def test_prefix_reuse_counts_leading_blocks():
    rows = [
        Row(1, 0, 1536, 1, [1, 2, 3]),
        Row(2, 1, 1200, 1, [1, 2, 4]),
        Row(3, 2, 700, 1, [5, 2]),
        Row(4, 3, 100, 1, [1]),
    ]
    p = prefix_reuse(rows)
    assert p["block_ratio"] == pytest.approx(3 / 9)
    assert p["token_ratio"] == pytest.approx((1024 + 100) / (1536 + 1200 + 700 + 100))
    assert p["requests_with_hit"] == 0.5
    assert prefix_reuse([Row(1, 0, 5, 1)]) is None


def test_recommend_rules():
    short = recommend(np.array([100] * 99 + [5000]), np.array([50] * 100))
    assert short.mode == "colocated" and "1.0% of prompts over 4000" in short.reasons[0]
    chats = recommend(np.array([300] * 90 + [8000] * 10), np.array([100] * 100))
    assert (
        chats.mode == "disaggregated"
        and "few long documents" in chats.reasons[0]
        and "10.0%" in chats.reasons[0]
    )
    docs = recommend(np.array([9000] * 80 + [1000] * 20), np.array([300] * 100), prefix_ratio=0.5)
    assert docs.mode == "disaggregated" and "long prompts dominate" in docs.reasons[0]
    assert any("enable the prefix cache" in n for n in docs.notes)
    r = recommend(np.array([100, 200, 300, 400, 9000]), np.array([10, 20, 30, 40, 50]))
    assert (r.l1_max_prompt_tokens, r.l1_max_tokens, r.l1_share) == (250, 33, 0.4)


def test_model_shapes():
    assert kv_bytes_per_token(get_shape("llama-3-8b")) == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(get_shape("llama-3-70b"), dtype_bytes=1) == 2 * 80 * 8 * 128
    with pytest.raises(ValueError, match="known: .*smollm2-135m"):
        get_shape("gpt-5")


def test_request_log_rows_and_measured_hold(tmp_path):
    path = tmp_path / "requests.log"
    path.write_text(
        log_line(1000.5, 30, 5, 2.0)
        + log_line(1000.0, 40, 6, 1.0)
        + '{"arrival_time": 1001}\n'
        + log_line(1003.0, 50, 7, 0.5)[:40]
    )
    assert trace_format(path) == "request-log"
    rows, skipped = read_trace(path)
    assert [(r.line, r.arrival, r.input_len, r.e2e) for r in rows] == [
        (1, 0.5, 30, 2.0),
        (2, 0.0, 40, 1.0),
    ]
    assert [s["line"] for s in skipped] == [3, 4] and "prompt_tokens" in skipped[0]["error"]
    rep = analyze(rows, get_shape("smollm2-135m"))
    assert (
        rep["in_flight"]["peak_tokens"] == 35 + 46
        and "measured e2e_latency (2 rows)" in rep["in_flight"]["assumption"]
    )


def test_cli_json_plots_and_prefix(tmp_path, capsys):
    path = mooncake_jsonl(
        tmp_path, [(1536, [1, 2, 3]), (1200, [1, 2, 4]), (700, [5, 2]), (100, [1])]
    )
    out = tmp_path / "r.json"
    assert main(["analyze", str(path), "--json", str(out), "--plot", str(tmp_path / "img")]) == 0
    rep = json.loads(out.read_text())
    assert rep["format"] == "mooncake" and rep["requests"] == 4
    for key in ("prompt_tokens", "output_tokens"):
        assert {"p50", "p95", "p99", "share_under_200", "share_over_4000"} <= set(rep[key])
    assert rep["prefix_reuse"]["block_ratio"] == pytest.approx(1 / 3)
    assert rep["in_flight"]["peak_kv_bytes"] == rep["in_flight"]["peak_tokens"] * 131072
    assert rep["recommendation"]["mode"] in ("colocated", "disaggregated")
    for name in ("lengths", "rps", "in_flight"):
        assert (tmp_path / "img" / f"analyze_mooncake_{name}.png").stat().st_size > 1000
    text = capsys.readouterr().out
    assert "prefix reuse" in text and "recommendation:" in text and "assumption:" in text


def test_malformed_lines_skipped_or_rejected(tmp_path, capsys):
    path = azure_csv(
        tmp_path,
        [(0, 100, 10), (1.5, 300, 20)],
        extra="2023-11-16 18:00:02.0,abc,3\n2023-11-16 18:0",
    )
    assert main(["analyze", str(path)]) == 0
    cap = capsys.readouterr()
    assert "azure.csv:4: " in cap.err and "azure.csv:5: " in cap.err and "2 requests" in cap.out
    assert main(["analyze", str(path), "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "azure.csv:4: " in err and "Traceback" not in err


def test_bad_inputs_are_errors_not_tracebacks(tmp_path, capsys):
    unknown = tmp_path / "x.jsonl"
    unknown.write_text('{"foo": 1}\n')
    empty = azure_csv(tmp_path, [], extra="garbage\n")
    for argv in (
        [str(unknown)],
        [str(tmp_path / "missing.csv")],
        [str(empty)],
        [str(empty), "--model", "nope"],
        [str(unknown), "--format", "mooncake"],
    ):
        assert main(["analyze", *argv]) == 2
        assert capsys.readouterr().err.splitlines()[-1].startswith("error: ")


def test_real_azure_trace():
    rows, skipped = read_trace(resolve_trace("azure"))
    rep = analyze(rows, get_shape("llama-3-8b"))
    assert rep["requests"] > 19000 and not skipped and rep["prefix_reuse"] is None
    assert (
        500 < rep["prompt_tokens"]["p50"] < 2000
        and rep["rate"]["peak_rps"] > rep["rate"]["trough_rps"] > 0
    )
    assert rep["in_flight"]["peak_kv_bytes"] > 0
