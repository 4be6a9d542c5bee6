"""The two public traces ship inside the package (read compressed, with their licences), every
command takes their names, and a trace file given to `bench serve` is the workload or is refused."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tandem.bench import serve
from tandem.cli import main as cli_main
from tandem.sim.workload import from_trace
from tandem.workload.traces import (
    SHIPPED_DIR,
    SHIPPED_TRACES,
    read_trace,
    resolve_trace,
    trace_format,
)

PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "smollm2-135m-cpu.json"


def test_shipped_traces_read_compressed_with_their_licences():
    for name, rows_min in (("azure", 19000), ("mooncake", 12000)):
        path = resolve_trace(name)
        assert path.parent == SHIPPED_DIR and path.suffix == ".xz" and trace_format(path) == name
        rows, skipped = read_trace(path)
        assert len(rows) > rows_min and not skipped and rows[0].arrival == 0
    readme = (SHIPPED_DIR / "README.md").read_text()
    assert "CC-BY 4.0" in readme and "Splitwise" in readme and "Apache-2.0" in readme
    assert "Apache License" in (SHIPPED_DIR / "LICENSE-mooncake-Apache-2.0.txt").read_text()
    assert (
        "creativecommons.org/licenses/by/4.0"
        in (SHIPPED_DIR / "LICENSE-azure-CC-BY-4.0.txt").read_text()
    )


def test_a_name_that_is_not_shipped_is_a_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="azure, mooncake"):
        resolve_trace("azur")
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n")
    assert resolve_trace(str(path)) == path


def _dataset(*argv: str) -> str:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return serve.dataset_of(p.parse_args(list(argv)))


def test_bench_serve_trace_file_is_the_workload_or_refused(tmp_path, capsys):
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"timestamp": 0, "input_length": 4, "output_length": 2, "hash_ids": [0]}\n')
    assert _dataset() == "random"
    assert _dataset("--trace", str(jsonl)) == "mooncake"
    assert _dataset("--trace", "azure") == "azure"
    assert _dataset("--dataset-name", "mooncake") == "mooncake"
    for name in ("random", "mixed", "azure"):
        with pytest.raises(ValueError, match="drop --dataset-name or give --dataset-name mooncake"):
            _dataset("--dataset-name", name, "--trace", str(jsonl))
    log = tmp_path / "requests.jsonl"
    log.write_text('{"arrival_time": 1.0, "prompt_tokens": 3, "output_tokens": 2}\n')
    with pytest.raises(ValueError, match="replays azure and mooncake"):
        _dataset("--trace", str(log))


def test_simulate_and_analyze_take_the_shipped_names(tmp_path, capsys):
    reqs, desc = from_trace("mooncake", max_requests=30, length_scale=0.05)
    assert len(reqs) == 30 and desc["trace"].endswith(SHIPPED_TRACES["mooncake"])
    assert (
        cli_main(
            [
                "simulate",
                "--trace",
                "mooncake",
                "--max-requests",
                "40",
                "--length-scale",
                "0.05",
                "--profile",
                str(PROFILE),
            ]
        )
        == 0
    )
    assert "TTFT p50" in capsys.readouterr().out
    assert cli_main(["analyze", "azure", "--json", str(tmp_path / "a.json")]) == 0
    assert "recommendation:" in capsys.readouterr().out
