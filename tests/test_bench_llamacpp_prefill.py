"""`tandem bench llamacpp --prefill-lens`: llama-bench's JSON parsed from a captured run, its
command one repetition of prompt-only tests, and the sides alternating round by round."""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.bench import llamacpp, llamacpp_prefill

# Captured from `llama-bench -p 16 -n 0 -t 2 -r 1 -o json` (most fields left out), after a log
# line of the kind it may print first.
SAMPLE = """\
load_backend: loaded CPU backend
[
  {
    "build_commit": "0c1e570",
    "model_type": "llama 256M Q4_1",
    "n_threads": 2,
    "n_prompt": 16,
    "n_gen": 0,
    "n_depth": 0,
    "avg_ns": 3464982612,
    "avg_ts": 4.617628,
    "samples_ts": [ 4.61763 ]
  },
  {
    "n_prompt": 0,
    "n_gen": 32,
    "avg_ts": 50.0
  }
]
"""


def test_parses_the_prompt_only_tests():
    assert llamacpp_prefill.parse_llama_bench(SAMPLE) == {16: 4.617628}


def test_command_runs_each_length_once_without_generation():
    cmd = llamacpp_prefill.llama_bench_command(
        Path("/x/llama-bench"), Path("m.gguf"), [512, 8000], 2
    )
    assert cmd == [
        "/x/llama-bench",
        "-m",
        "m.gguf",
        "-p",
        "512,8000",
        "-n",
        "0",
        "-t",
        "2",
        "-r",
        "1",
        "-o",
        "json",
    ]


def test_prefill_alternates_the_sides_and_keeps_the_best(monkeypatch, tmp_path, capsys):
    order = []
    tandem = iter([{512: 100.0, 8000: 50.0}, {512: 90.0, 8000: 60.0}])

    def fake_tandem(fn, args, requests):
        order.append("tandem")
        return {"prefill_tok_s": next(tandem), "kv_cache_dtype": "float32"}

    def fake_llama(command):
        order.append("llama")
        return {512: 50.0, 8000: 20.0}

    monkeypatch.setattr("tandem.bench.measure.in_subprocess", fake_tandem)
    monkeypatch.setattr(llamacpp_prefill, "run_llama_bench", fake_llama)
    monkeypatch.setattr(llamacpp, "llama_cpp_tool", lambda name, path: Path("/bin/true"))
    monkeypatch.setattr(
        "tandem.models.loader.model_files.gguf_source", lambda model: tmp_path / "m.gguf"
    )
    args = argparse.Namespace(
        prefill_lens="512,8000",
        quantization="auto",
        repeats=2,
        model="m",
        llama_bench=None,
        num_threads=2,
        json_path=None,
    )
    report = llamacpp.main(args)
    assert order == ["tandem", "llama", "llama", "tandem"]
    assert report["prefill_tok_s"]["tandem"] == {512: 100.0, 8000: 60.0}
    assert report["ratio"] == {512: 2.0, 8000: 3.0}
    assert "   8000       60.0       20.0             3.00x" in capsys.readouterr().out
