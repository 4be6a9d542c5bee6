"""`tandem diagnose` on records built to show each verdict (a scheduling problem, a step-time
jump, a transfer-bound run, fragmentation with free memory), on a real run's step trace, and
on bad files: empty, truncated, or of another kind, each refused naming the file and line."""

from __future__ import annotations

import json
import random

import pytest

from tandem import LLM, SamplingParams
from tandem.cli import main as cli_main


def step(i: int, seconds: float = 0.03, **kw) -> dict:
    s = {
        "start": i * 0.1,
        "seconds": seconds,
        "tokens": 8,
        "seqs": 8,
        "prefill_tokens": 0,
        "decodes": 8,
        "throttled_prefill_tokens": 0,
        "throttle": 2048,
        "swap_out_blocks": 0,
        "swap_in_blocks": 0,
        "waiting": 0,
        "running": 8,
        "waiting_by_level": {"L1": 0, "L2": 0, "L3": 0},
        "kv_free_blocks": 100,
        "kv_total_blocks": 1000,
        "host_free_blocks": 50,
        "host_total_blocks": 50,
        "swapped": 0,
        "preemptions": 0,
        "max_num_seqs": 256,
        "token_budget": 2048,
    }
    return {**s, **kw}


def write_lines(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def request_log(path, queue_share: float, n: int = 50) -> str:
    rng = random.Random(0)
    recs = []
    for i in range(n):
        e2e = rng.uniform(1, 3)
        recs.append(
            {
                "request_id": str(i),
                "arrival_time": 1e9 + i,
                "prompt_tokens": 100,
                "output_tokens": 20,
                "queue_time": e2e * queue_share,
                "ttft": e2e * queue_share + 0.05,
                "e2e_latency": e2e,
            }
        )
    return write_lines(path, recs)


def run(argv: list[str], tmp_path) -> dict:
    out = tmp_path / "diag.json"
    assert cli_main(["diagnose", *argv, "--json", str(out)]) == 0
    return {x["name"]: x for x in json.loads(out.read_text())["layers"]}


def test_queueing_over_40_percent_is_a_scheduling_problem(tmp_path):
    bad = run(["--requests", request_log(tmp_path / "a.jsonl", 0.6)], tmp_path)["queueing"]
    assert (
        bad["flagged"]
        and "scheduling problem" in bad["verdict"]
        and abs(bad["figures"]["queue_share"] - 0.6) < 1e-9
    )
    ok = run(["--requests", request_log(tmp_path / "b.jsonl", 0.1)], tmp_path)["queueing"]
    assert not ok["flagged"] and "not a scheduling problem" in ok["verdict"]


def test_a_step_time_jump_is_found_and_explained_by_long_prefill_chunks(tmp_path, capsys):
    steps = [step(i, 0.03 + 0.002 * (i % 3)) for i in range(190)]
    steps += [step(190 + i, 0.1, prefill_tokens=2048, tokens=2056) for i in range(10)]
    random.Random(1).shuffle(steps)
    layers = run(
        ["--steps", write_lines(tmp_path / "s.jsonl", steps), "--plot", str(tmp_path / "plots")],
        tmp_path,
    )
    jump = layers["step time"]
    assert (
        jump["flagged"]
        and "long prefill chunks" in jump["verdict"]
        and "swaps" not in jump["verdict"]
    )
    assert [c["steps"] for c in jump["figures"]["clusters"]] == [190, 10]
    assert 2.8 < jump["figures"]["jump_ratio"] < 3.5
    assert not layers["transfers"]["flagged"] and not layers["fragmentation"]["flagged"]
    assert {"step_times.png", "kv_free_waiting.png"} <= {
        p.name for p in (tmp_path / "plots").iterdir()
    }
    assert "1. step time: step-time jump" in capsys.readouterr().out
    flat = run(
        [
            "--steps",
            write_lines(
                tmp_path / "f.jsonl", [step(i, 0.03 + 0.001 * (i % 5)) for i in range(100)]
            ),
        ],
        tmp_path,
    )["step time"]
    assert not flat["flagged"] and flat["verdict"].startswith("no jump")


def test_swaps_make_a_jump_and_a_transfer_bound_run(tmp_path):
    steps = [step(i) for i in range(70)] + [
        step(70 + i, 0.2, swap_out_blocks=40) for i in range(30)
    ]
    layers = run(["--steps", write_lines(tmp_path / "s.jsonl", steps)], tmp_path)
    assert layers["step time"]["flagged"] and "swaps" in layers["step time"]["verdict"]
    assert layers["transfers"]["flagged"] and "steps that swap KV" in layers["transfers"]["verdict"]


def test_pd_handoffs_over_a_fifth_of_latency_are_transfer_bound(tmp_path):
    reqs = [
        {"index": i, "success": True, "e2e": 1.0, "metrics": {"queue_time": 0.05}}
        for i in range(20)
    ]
    counters = {"kv_transfers": 20.0, "kv_transfer_seconds": 8.0, "kv_transfer_bytes": 2e9}
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"results": {"requests": reqs, "server_counters": counters}}))
    t = run(["--bench", str(bench)], tmp_path)["transfers"]
    assert (
        t["flagged"]
        and "P/D KV handoffs take 40%" in t["verdict"]
        and "400 ms each" in t["verdict"]
    )
    bench.write_text(
        json.dumps(
            {
                "results": {
                    "requests": reqs,
                    "server_counters": {**counters, "kv_transfer_seconds": 1.0},
                }
            }
        )
    )
    assert not run(["--bench", str(bench)], tmp_path)["transfers"]["flagged"]


@pytest.mark.parametrize(
    "limit, expect",
    [
        ({"running": 256}, "the sequence cap (max_num_seqs 256)"),
        ({"tokens": 2048}, "the token budget"),
        ({"throttled_prefill_tokens": 400, "throttle": 409}, "a level's share"),
        ({"swapped": 3, "host_free_blocks": 0}, "the host tier full"),
    ],
)
def test_fragmentation_with_free_memory_names_what_held_the_requests(tmp_path, limit, expect):
    steps = [step(i) for i in range(50)] + [
        step(50 + i, waiting=12, kv_free_blocks=600, **limit) for i in range(50)
    ]
    f = run(["--steps", write_lines(tmp_path / "s.jsonl", steps)], tmp_path)["fragmentation"]
    assert (
        f["flagged"]
        and "free memory, yet concurrency cannot rise" in f["verdict"]
        and expect in f["verdict"]
    )
    assert f["figures"]["stuck_share"] == 0.5 and f["figures"]["free_kv_share_p50"] == 0.6
    # requests waiting with the pool full is not fragmentation
    full = [step(i, waiting=12, kv_free_blocks=10, **limit) for i in range(50)]
    assert not run(["--steps", write_lines(tmp_path / "g.jsonl", full)], tmp_path)["fragmentation"][
        "flagged"
    ]


def test_a_real_runs_step_trace_shows_the_sequence_cap(tmp_path, tiny_model_dirs):
    path = tmp_path / "steps.jsonl"
    llm = LLM(
        tiny_model_dirs["llama"],
        dtype="float32",
        kv_cache_memory=1 << 22,
        step_trace=str(path),
        max_num_seqs=2,
    )
    llm.generate([[5 + i] * 20 for i in range(8)], SamplingParams(max_tokens=12, ignore_eos=True))
    f = run(["--steps", str(path)], tmp_path)["fragmentation"]
    assert f["flagged"] and "the sequence cap (max_num_seqs 2)" in f["verdict"]


@pytest.mark.parametrize(
    "flag, content, expect",
    [
        ("--requests", "", "r.txt: holds no requests (empty)"),
        (
            "--requests",
            '{"arrival_time": 1, "prompt_tokens": 3, "output_tokens": 2, "queue_time": 0.1, '
            '"e2e_latency": 1}\n'
            '{"arrival_time": 2, "prompt_t',
            "r.txt:2: JSONDecodeError",
        ),
        ("--requests", json.dumps(step(0)) + "\n", "r.txt:1: missing field(s) arrival_time"),
        ("--steps", "", "r.txt: holds no steps (empty)"),
        ("--steps", json.dumps(step(0)) + "\n" + json.dumps(step(1))[:40], "r.txt:2: not JSON"),
        (
            "--steps",
            '{"arrival_time": 1, "prompt_tokens": 3, "output_tokens": 2}\n',
            "r.txt:1: not a step trace line",
        ),
        ("--bench", '{"results": {"requests": [', "r.txt:1: not JSON"),
        ("--bench", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "r.txt:1: not JSON"),
        ("--bench", '{"layers": []}', "r.txt:1: not a `tandem bench serve --save-result` result"),
    ],
)
def test_bad_files_are_refused_naming_the_file_and_line(tmp_path, capsys, flag, content, expect):
    (tmp_path / "r.txt").write_text(content)
    assert cli_main(["diagnose", flag, str(tmp_path / "r.txt")]) == 2
    assert expect in capsys.readouterr().err
    assert cli_main(["diagnose"]) == 2 and "give at least one" in capsys.readouterr().err
