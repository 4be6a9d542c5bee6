"""`tandem bench spec` on the real default model, SmolLM2-135M in bf16 with --deterministic (a
file of its own, so under `make test`'s xdist workers it runs beside tests/test_spec_smollm2.py,
not after it)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_bench_spec_alternates_the_configurations_case_by_case(tmp_path):
    """`tandem bench spec`: every case runs in each configuration's process before the next case
    starts, the order rotating from case to case, for each round; a row gives every round's
    ratio, and with --deterministic bf16 outputs with speculation equal speculation off."""
    import argparse

    from tandem.bench import spec

    p = argparse.ArgumentParser()
    spec.add_arguments(p)
    trace = tmp_path / "trace.jsonl"
    args = p.parse_args(
        [
            "--dtype",
            "bfloat16",
            "--deterministic",
            "--batch-sizes",
            "1,2",
            "--num-prompts",
            "1",
            "--max-tokens",
            "6",
            "--rounds",
            "2",
            "--method",
            "ngram",
            "--trace-adaptive",
            str(trace),
            "--json",
            str(tmp_path / "spec.json"),
        ]
    )
    report = spec.main(args)
    rows = report["rows"]
    assert [(r["set"], r["batch"]) for r in rows] == [("grounded", 1), ("chat", 1), ("chat", 2)]
    assert all(len(r["ratios"]) == 2 and r["equal_outputs"] == r["num_outputs"] for r in rows)
    assert {line["round"] for line in map(json.loads, trace.read_text().splitlines())} == {0, 1}
    runs = sorted(
        (run["started_at"], name, run["set"], run["batch"], run["round"])
        for name, per_case in report["runs"].items()
        for run in per_case
    )
    # in time order: (off, ngram), (ngram, off), (off, ngram), ... one case at a time
    assert [name for _, name, *_ in runs] == ["off", "ngram", "ngram", "off"] * 3
    assert all(runs[i][2:] == runs[i + 1][2:] for i in range(0, len(runs), 2))
