"""`tandem bench serve` against a tiny fake OpenAI-compatible streaming server (FastAPI on
127.0.0.1, in a background thread), plus prompt synthesis and trace parsing."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import socket
import threading
import time
from collections import Counter

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tandem.bench import serve
from tandem.bench.traces import trace_workload
from tandem.bench.workloads import PromptSynth, arrivals
from tandem.workload.traces import read_azure, read_mooncake, resolve_trace

# ---- fake server -------------------------------------------------------------------------------
DEFAULTS = dict(chunk_delay=0.002, tokens_per_chunk=1, fail_every=0, slow_every=0, slow_delay=0.25)
CFG: dict = {}
STATE: dict = {}
app = FastAPI()


def _reset() -> None:
    CFG.clear()
    CFG.update(DEFAULTS)
    STATE.update(n=0, inflight=0, max_inflight=0, bodies=[])


async def _handle(request: Request, chat: bool):
    body = await request.json()
    STATE["n"] += 1
    n = STATE["n"]
    STATE["bodies"].append(body)
    if CFG["fail_every"] and n % CFG["fail_every"] == 0:
        status = 500 if (n // CFG["fail_every"]) % 2 else 429
        return JSONResponse({"error": {"message": f"fake failure {status}"}}, status_code=status)
    prompt = body["messages"][0]["content"] if chat else body["prompt"]
    slow = bool(CFG["slow_every"]) and n % CFG["slow_every"] == 0

    async def events():
        STATE["inflight"] += 1
        STATE["max_inflight"] = max(STATE["max_inflight"], STATE["inflight"])
        try:
            queue = CFG["slow_delay"] if slow else 0.0
            await asyncio.sleep(queue)
            total, step = body["max_tokens"], CFG["tokens_per_chunk"]
            for i in range(0, total, step):
                await asyncio.sleep(CFG["chunk_delay"])
                text = " tok" * min(step, total - i)
                choice = (
                    {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                )
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            final = {
                "choices": [],
                "usage": {
                    "prompt_tokens": len(prompt.split()),
                    "completion_tokens": total,
                    "total_tokens": len(prompt.split()) + total,
                },
                "metrics": {
                    "queue_time": queue,
                    "prefill_time": CFG["chunk_delay"],
                    "decode_time": CFG["chunk_delay"] * (total - 1),
                },
            }
            yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            STATE["inflight"] -= 1

    return StreamingResponse(events(), media_type="text/event-stream")


@app.post("/v1/completions")
async def completions(request: Request):
    return await _handle(request, chat=False)


@app.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await _handle(request, chat=True)


@pytest.fixture(scope="module")
def server_url():
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture(autouse=True)
def fresh_server_state():
    _reset()


def bench_args(url: str, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(
        [
            "--base-url",
            url,
            "--quiet",
            "--num-prompts",
            "8",
            "--input-len",
            "16",
            "--output-len",
            "6",
            *extra,
        ]
    )


# ---- load tests against the fake server --------------------------------------------------------
def test_random_workload_at_fixed_concurrency(server_url):
    CFG["tokens_per_chunk"] = 2  # the ITL note must explain chunks carrying >1 token
    out = serve.main(
        bench_args(
            server_url,
            "--num-prompts",
            "12",
            "--max-concurrency",
            "4",
            "--range-ratio",
            "0.5",
            "--output-len",
            "8",
        )
    )
    s = out["results"]["summary"]
    assert (s["total"], s["completed"], s["failed"]) == (12, 12, 0)
    assert 1 <= STATE["max_inflight"] <= 4
    reqs = out["results"]["requests"]
    assert s["total_output_tokens"] == sum(r["requested_output"] for r in reqs)
    for r in reqs:
        assert (
            r["success"]
            and 0 < r["ttft"] <= r["e2e"]
            and r["output_tokens"] == r["requested_output"]
        )
    for body in STATE["bodies"]:
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
        assert body["stream_options"] == {"include_usage": True} and 4 <= body["max_tokens"] <= 12
    for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        v = s[k]
        assert v["p50"] <= v["p90"] <= v["p95"] <= v["p99"] and v["mean"] > 0, k
    assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"] and s["tpot_ms"]["p99"] <= s["e2e_ms"]["p99"]
    assert s["output_throughput"] > 0 and s["request_throughput"] > 0
    assert "tokens/chunk" in s["itl_note"]
    split = s["latency_split"]
    assert split["requests"] == 12 and split["queue_share"] == 0 and not split["scheduling_problem"]
    assert 0 < split["decode_share"] < 1
    assert out["workload"]["prompt_tokens"]["off"] == 0


def test_failures_counted_with_status(server_url):
    CFG["fail_every"] = 3
    out = serve.main(bench_args(server_url, "--num-prompts", "12", "--max-concurrency", "2"))
    s = out["results"]["summary"]
    assert (s["completed"], s["failed"]) == (8, 4)
    assert s["failures_by_status"] == {"500": 2, "429": 2}
    assert all(
        e["error"].startswith(f"HTTP {e['status']}") and "fake failure" in e["error"]
        for e in s["errors"]
    )


def test_request_timeout_is_a_failure(server_url):
    CFG.update(slow_every=1, slow_delay=3.0)
    t = time.monotonic()
    out = serve.main(bench_args(server_url, "--num-prompts", "2", "--request-timeout", "0.3"))
    assert time.monotonic() - t < 2.5
    assert out["results"]["summary"]["failures_by_status"] == {"timeout": 2}


def test_goodput_and_queueing_share(server_url):
    # every second request waits 600 ms "in the queue"; the others' TTFT has 400 ms of slack
    # under the SLO, for a loaded machine
    CFG.update(slow_every=2, slow_delay=0.6)
    out = serve.main(
        bench_args(server_url, "--max-concurrency", "4", "--goodput", "ttft:400", "e2el:5000")
    )
    s = out["results"]["summary"]
    g = s["goodput"]
    assert s["completed"] == 8 and g["requests"] == 4 and g["share"] == 0.5
    assert g["rate"] == pytest.approx(4 / s["duration_s"])
    assert s["latency_split"]["queue_share"] > 0.4 and s["latency_split"]["scheduling_problem"]
    assert s["latency_split"]["queue_ms"]["p99"] == pytest.approx(600, rel=0.01)


def test_json_and_plots(server_url, tmp_path):
    path, plots = tmp_path / "bench.json", tmp_path / "plots"
    serve.main(
        bench_args(
            server_url,
            "--request-rate",
            "200",
            "--burstiness",
            "0.5",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            path.name,
            "--plot",
            str(plots),
            "--metric-percentiles",
            "50,99.9",
            "--goodput",
            "ttft:1000",
        )
    )
    data = json.loads(path.read_text())
    assert {"config", "workload", "results", "plots"} <= data.keys()
    assert data["config"]["request_rate"] == 200
    assert {
        "base_url",
        "summary",
        "per_class",
        "requests",
        "server_counters",
        "prefix_ideal",
    } == data["results"].keys()
    # the fake server serves no tandem /metrics nor /tandem/state
    assert data["results"]["server_counters"] is None and data["results"]["prefix_ideal"] is None
    assert {
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "ttft_ms",
        "itl_ms",
        "tpot_ms",
        "e2e_ms",
        "goodput",
        "latency_split",
        "failures_by_status",
    } <= data["results"]["summary"].keys()
    assert set(data["results"]["summary"]["ttft_ms"]) == {
        "mean",
        "p50",
        "p90",
        "p95",
        "p99",
        "p99.9",
    }
    assert {"name", "description", "prompt_tokens", "tokenizer"} <= data["workload"].keys()
    for name in ("ttft_cdf.png", "itl_cdf.png", "throughput.png", "inflight.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_same_server_gives_ratios_near_one(server_url):
    out = serve.main(bench_args(server_url, "--compare", server_url, "--max-concurrency", "4"))
    r = out["ratios"]
    assert r["completed"] == 1 and r["total_output_tokens"] == 1 and r["total_input_tokens"] == 1
    # each ratio is run 2's figure over run 1's (timings themselves vary: no bound on them here)
    a, b = out["results"]["summary"], out["compare"]["summary"]
    assert r["output_throughput"] == pytest.approx(b["output_throughput"] / a["output_throughput"])
    assert r["e2e_ms.p50"] == pytest.approx(b["e2e_ms"]["p50"] / a["e2e_ms"]["p50"])
    prompts = [b["prompt"] for b in STATE["bodies"]]
    assert sorted(prompts[:8]) == sorted(prompts[8:])  # same requests replayed


def test_mixed_workload_per_class_with_priority_over_chat(server_url):
    out = serve.main(
        bench_args(
            server_url,
            "--dataset-name",
            "mixed",
            "--num-prompts",
            "20",
            "--long-fraction",
            "0.1",
            "--long-input-len",
            "300",
            "--long-output-len",
            "12",
            "--short-input-len",
            "10",
            "--short-output-len",
            "3",
            "--priority-by-class",
            "--endpoint",
            "chat",
        )
    )
    per = out["results"]["per_class"]
    assert (per["long"]["completed"], per["short"]["completed"]) == (2, 18)
    assert per["long"]["total_output_tokens"] == 24 and per["short"]["ttft_ms"]["p99"] is not None
    prio = Counter(b["priority"] for b in STATE["bodies"])
    assert prio == {"standard": 2, "interactive": 18}
    assert all(b["messages"][0]["role"] == "user" for b in STATE["bodies"])


def test_documents_of_several_lengths_compared_class_by_class(server_url, capsys):
    """The long requests take the --long-input-len lengths in turn; --compare gives each class's
    figures side by side (the short requests' TTFT p99 under two schedulers, say)."""
    out = serve.main(
        bench_args(
            server_url,
            *("--dataset-name", "mixed", "--num-prompts", "12", "--long-fraction", "0.25"),
            *("--long-input-len", "40,80", "--long-output-len", "2"),
            *("--short-input-len", "5", "--short-output-len", "2", "--compare", server_url),
        )
    )
    requests = sorted(out["results"]["requests"], key=lambda r: r["index"])
    assert [r["input_len"] for r in requests if r["cls"] == "long"] == [40, 80, 40]
    assert "mixed: 3 long (40/80->2 tokens) + 9 short" in out["workload"]["description"]
    assert out["ratios"]["short.completed"] == 1 and out["ratios"]["long.completed"] == 1
    comparison = capsys.readouterr().out.split("==== comparison")[1]
    assert "short.ttft_ms.p99" in comparison and "long.ttft_ms.p99" in comparison


# ---- prompt synthesis --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def synth():
    _, tok = serve._tokenizer("smollm2-135m", "smollm2-135m")
    return PromptSynth(tok)


def test_prompts_have_exact_token_counts(synth):
    rng = random.Random(1)
    for n in (1, 2, 7, 30, 128, 513, 2000):
        text, got = synth.prompt(n, rng)
        assert got == n and len(synth.encode(text)) == n
    assert synth.report()["off"] == 0


def test_arrivals_schedule():
    assert arrivals(4, float("inf"), 1.0, 0) == [0.0] * 4
    t = arrivals(2000, 50.0, 1.0, 0)
    assert t[0] == 0 and all(b >= a for a, b in itertools.pairwise(t))
    assert t[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)


# ---- traces ------------------------------------------------------------------------------------
def trace_args(kind: str, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--dataset-name", kind, *extra])
    args.dataset_name = serve.dataset_of(args)
    return args


def test_azure_window_and_scaling(synth):
    rows, skipped = read_azure(resolve_trace("azure"))
    assert len(rows) > 19000 and not skipped and rows[0].arrival == 0
    args = trace_args(
        "azure",
        "--window-start",
        "60",
        "--window-seconds",
        "30",
        "--time-scale",
        "0.1",
        "--length-scale",
        "0.05",
        "--max-requests",
        "20",
        "--max-output-len",
        "4",
    )
    reqs, desc = trace_workload(args, synth)
    raw = [r for r in rows if 60 <= r.arrival < 90][:20]
    assert len(reqs) == len(raw) > 0 and reqs[0].arrival == 0
    for q, r in zip(reqs, raw):
        assert q.arrival == pytest.approx((r.arrival - raw[0].arrival) * 0.1)
        assert q.input_len == max(1, round(r.input_len * 0.05)) == len(synth.encode(q.prompt))
        assert q.output_len == min(4, max(1, round(r.output_len * 0.05)))
    sc = desc["scaling"]
    assert (sc["time_scale"], sc["length_scale"], sc["max_output_len"]) == (0.1, 0.05, 4)
    assert "time x0.1" in desc["description"] and "lengths x0.05" in desc["description"]


def test_mooncake_prompts_share_real_prefixes(synth):
    args = trace_args(
        "mooncake", "--max-requests", "40", "--length-scale", "0.03125", "--time-scale", "0.5"
    )
    rows, _ = read_mooncake(resolve_trace("mooncake"))
    reqs, desc = trace_workload(args, synth)
    block = desc["scaling"]["block_tokens"]
    assert block == 16 and len(reqs) == 40
    assert reqs[-1].arrival == pytest.approx(rows[39].arrival * 0.5)
    enc = [synth.encode(q.prompt) for q in reqs]
    assert all(
        len(e) == q.input_len == max(1, round(r.input_len / 32)) for e, q, r in zip(enc, reqs, rows)
    )
    shared = 0
    for i, j in itertools.combinations(range(40), 2):
        a, b = rows[i].hash_ids, rows[j].hash_ids
        k = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        n = min(k * block, len(enc[i]), len(enc[j]))
        assert enc[i][:n] == enc[j][:n]
        if (
            k < min(len(a), len(b))
            and len(enc[i]) >= (k + 1) * block
            and len(enc[j]) >= (k + 1) * block
        ):
            assert enc[i][: (k + 1) * block] != enc[j][: (k + 1) * block]
        shared += n > 0
    assert shared > 0
    for q, r, e in zip(reqs, rows, enc):  # the blocks a prompt holds, for the simulator
        assert q.block_tokens == block and list(q.hash_ids) == r.hash_ids[: len(q.hash_ids)]
        assert (len(q.hash_ids) - 1) * block < len(e) or not q.hash_ids


def test_simulator_replays_a_runs_prefix_blocks_at_its_scale(tmp_path):
    from tandem.sim.workload import from_bench_run

    def row(i, hash_ids):
        return {
            "index": i,
            "start": 0.1 * i,
            "prompt_tokens": 40,
            "input_len": 40,
            "requested_output": 4,
            "hash_ids": hash_ids,
            "block_tokens": 16,
        }

    run = {"config": {}, "results": {"requests": [row(0, [7, 8]), row(1, [7, 9]), row(2, [])]}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    a, b, c = from_bench_run(str(path))[0]
    ids = [r.prompt_token_ids() for r in (a, b, c)]
    assert ids[0][:16] == ids[1][:16] and ids[0][16:32] != ids[1][16:32]
    assert ids[2][:16] != ids[0][:16]
    assert len(a.prefix_hashes(16, 1 << 20)) == 2 and not c.prefix_hashes(16, 1 << 20)


def test_malformed_trace_lines(tmp_path, synth):
    good = {"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [0]}
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({**good, "timestamp": 500}),
        json.dumps({"timestamp": 1, "input_length": 5}),
        '{"timestamp": 900, "input_len',
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows, skipped = read_mooncake(path)
    assert [r.line for r in rows] == [1, 3] and [s["line"] for s in skipped] == [2, 4, 5]
    assert "output_length" in skipped[1]["error"] and "hash_ids" in skipped[1]["error"]
    reqs, desc = trace_workload(trace_args("mooncake", "--trace", str(path)), synth)
    assert len(reqs) == 2 and desc["skipped_lines"] == 3 and "3 malformed" in desc["description"]
    with pytest.raises(ValueError, match=r"trace\.jsonl:2: "):
        trace_workload(trace_args("mooncake", "--trace", str(path), "--strict"), synth)

    csv_path = tmp_path / "azure.csv"
    csv_path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:47.0,abc,3\n2023-11-16 18:15:48.5,10,5\n2023-11-16 18:1"
    )
    rows, skipped = read_azure(csv_path)
    assert [r.arrival for r in rows] == pytest.approx([0, 1.81941]) and [
        s["line"] for s in skipped
    ] == [3, 5]
    with pytest.raises(ValueError, match=r"azure\.csv:3: "):
        read_azure(csv_path, strict=True)
