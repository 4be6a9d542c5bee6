"""The mended tools: `--num-prompts` in bench offline and its refusal of the other run's options,
the machine a profile records and the warning on another machine, the server's prefix-cache
counters over a bench serve run, and the simulator's hit ratio against the ideal on the same
prompts."""

from __future__ import annotations

import argparse
import json
import re

import httpx
import pytest
from server_fixture import running_server

from tandem.bench import offline
from tandem.bench.scrape import (
    format_counters,
    format_ideal,
    kv_layout,
    run_counters,
    scrape,
    warm_mismatch,
)
from tandem.cli import main as cli_main
from tandem.config import EngineConfig
from tandem.server.api_server import ServerConfig
from tandem.sim.cost_model import CostModel
from tandem.tools import machine
from tandem.workload.prefix_ideal import ideal_prefix_hits


def _offline_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    offline.add_arguments(p)
    return p.parse_args(argv)


def test_bench_offline_takes_num_prompts():
    assert _offline_args(["--num-prompts", "7"]).num_prompts == 7
    assert _offline_args([]).num_prompts == 64


@pytest.mark.parametrize(
    "argv,named",
    [
        (
            ["--quantization", "int4", "--compare-async", "--num-prompts", "3"],
            "--num-prompts, --compare-async: read by the request run only",
        ),
        (
            ["--quantization", "int4", "--speculative-config", '{"method": "ngram"}'],
            "--speculative-config: read by the request run only",
        ),
        (
            ["--batch-sizes", "1,2", "--repeats", "2"],
            "--batch-sizes, --repeats: read by --quantization's precision table only",
        ),
    ],
)
def test_bench_offline_refuses_the_other_runs_options_in_words(argv, named):
    """--quantization runs a precision table, not the request run: an option only the other one
    reads is refused, naming it, before any model loads (it was silently ignored)."""
    with pytest.raises(SystemExit, match=re.escape(named)):
        offline.main(_offline_args(argv))


def test_profile_warning_names_what_differs():
    here = machine.machine_info(threads=1, dtype="float32")
    assert here["cpu_model"] and here["cores_available"] >= 1 and here["torch"]
    assert machine.profile_warning({"device": "cpu", "machine": here}, "measured") is None
    other = {**here, "cpu_model": "Intel Xeon Platinum 8480+", "cpu_flags": ["avx512f", "amx_bf16"]}
    warning = machine.profile_warning({"device": "cpu", "machine": other}, "measured")
    assert "Intel Xeon Platinum 8480+" in warning and "amx_bf16" in warning
    assert "does not record" in machine.profile_warning({"device": "cpu"}, "measured")
    assert (
        machine.profile_warning({"device": "cuda:0"}, "measured") is None
    )  # a GPU profile: no CPU check
    assert machine.profile_warning({"accelerator": {"name": "H100"}}, "roofline") is None
    lines = machine.provenance_lines({"device": "cpu", "machine": other}, "measured")
    assert (
        "measured on: GPU" not in lines[0]
        and "Intel Xeon" in lines[0]
        and lines[1].strip().startswith("warning")
    )


def test_ideal_prefix_hits_counts_leading_blocks_seen_before():
    a, b = list(range(40)), list(range(32)) + [99] * 8  # b shares a's first two 16-token blocks
    r = ideal_prefix_hits([a, b, a], 16)
    assert (
        r["hit_tokens"] == 0 + 32 + 32 and r["prompt_tokens"] == 120
    )  # a again: 2 blocks (the 3rd is partial)
    # a cache of 2 blocks: b's blocks push a's out after b
    assert ideal_prefix_hits([a, b, a], 16, capacity_blocks=2)["hit_tokens"] == 32 + 32


def test_bench_serve_reports_the_servers_prefix_cache_hits(tiny_model_dirs):
    engine = EngineConfig.from_kwargs(
        model=tiny_model_dirs["llama"], kv_cache_memory=8 << 20, max_model_len=512
    )
    with running_server(engine, ServerConfig(model_name="tiny")) as (url, _):
        before = scrape(url)
        prompt = list(range(3, 200))
        for _ in range(2):
            r = httpx.post(
                url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
        counters = run_counters(before, scrape(url))
        layout = kv_layout(url)
    assert counters["prefix_cache_queries"] == 2 * len(prompt)
    # the second request hits the first one's full blocks (all but the last prompt token)
    assert 0.4 < counters["prefix_cache_hit_ratio"] < 0.5
    assert "prefix cache hit" in format_counters(counters)
    assert scrape("http://127.0.0.1:9") is None and "no tandem /metrics" in format_counters(None)
    block_size, blocks = layout
    ideal = {"unbounded": ideal_prefix_hits([prompt, prompt], block_size)}
    ideal["cache_size"] = ideal_prefix_hits([prompt, prompt], block_size, blocks)
    assert (
        ideal["unbounded"]["hit_tokens"] == counters["prefix_cache_hits"]
    )  # the cache did what the ideal does
    assert "= 100% of the ideal the cache size allows" in format_ideal(counters, ideal)
    assert "WARNING" not in format_ideal(counters, ideal)
    # The same prompts once more on this now warm server: it hits more than they share.
    warm = {**counters, "prefix_cache_hit_ratio": 0.99}
    assert "had them cached from an earlier run" in format_ideal(warm, ideal)
    assert warm_mismatch([counters, counters]) is None
    assert "not like for like" in warm_mismatch([counters, warm])
    assert warm_mismatch([counters, None]) is None
    assert kv_layout("http://127.0.0.1:9") is None


def test_simulate_prints_hit_ratio_beside_the_ideal(tmp_path, capsys):
    trace = tmp_path / "m.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": i * 100,
                    "input_length": 1200,
                    "output_length": 50,
                    "hash_ids": [1, 2, 10 + i],
                }
            )
            + "\n"
            for i in range(12)
        )
    )
    profile = tmp_path / "p.json"
    CostModel.from_json(
        {
            "kind": "measured",
            "overhead": 0.004,
            "kv_capacity_tokens": 60000,
            "terms": {"s": {"compute": [0.0, 2e-5, 1e-9, 1e-4, 2e-8], "memory": [0.0] * 5}},
        }
    ).save(profile)
    results = {}
    for flag in ([], ["--prefix-weight", "0"]):
        out = tmp_path / f"o{len(flag)}.json"
        assert (
            cli_main(
                [
                    "simulate",
                    "--trace",
                    str(trace),
                    "--profile",
                    str(profile),
                    "--instances",
                    "4",
                    "--json",
                    str(out),
                    *flag,
                ]
            )
            == 0
        )
        results[bool(flag)] = json.loads(out.read_text())["results"][0]["prefix_cache"]
    assert "ideal @size" in capsys.readouterr().out
    on, off = results[False], results[True]
    # each request after the first shares 1024 of 1200 tokens; the ideal counts exactly that
    assert abs(on["ideal"] - 11 * 1024 / (12 * 1200)) < 1e-9
    assert (
        on["share_of_ideal"] > 0.99
    )  # with affinity every repeat lands where the prefix is cached
    assert off["hit_ratio"] < on["hit_ratio"]  # by load alone, the first repeats land elsewhere
