"""vLLM's flag names and units, and every old spelling a release shipped: it still parses into
the new option with a warning naming the new one, or it fails with a message naming it."""
from __future__ import annotations

import argparse

import pytest

from tandem.bench import serve as bench_serve
from tandem.bench.report import parse_goodput
from tandem.cli import build_parser
from tandem.flags import parse_size
from tandem.server.launch import model_of, with_speculation_flags
from tandem.tools.plan_cli import _slo_seconds

PARSER = build_parser()

# (old argv, the new spelling the warning names, the new argv it equals)
OLD_SPELLINGS = [
    (["serve", "--no-prefix-caching"], "--no-enable-prefix-caching", ["serve", "--no-enable-prefix-caching"]),
    (["serve", "--scheduler-policy", "multilevel"], "--scheduling-policy", ["serve", "--scheduling-policy", "multilevel"]),
    (["bench", "serve", "--workload", "mixed"], "--dataset-name", ["bench", "serve", "--dataset-name", "mixed"]),
    (["bench", "serve", "--slo", "ttft=0.5,e2e=10"], "--goodput", ["bench", "serve", "--goodput", "ttft:500", "e2el:10000"]),
    (["simulate", "--slo", "ttft=2,tpot=0.1"], "--goodput", ["simulate", "--goodput", "ttft:2000", "tpot:100"]),
    (["simulate", "--num-requests", "7"], "--num-prompts", ["simulate", "--num-prompts", "7"]),
    (["simulate", "--no-prefix-caching"], "--no-enable-prefix-caching", ["simulate", "--no-enable-prefix-caching"]),
    (["analyze", "azure", "--model", "llama-3-70b"], "--model-shape", ["analyze", "azure", "--model-shape", "llama-3-70b"]),
    (["profile", "--out", "p.json", "--threads", "2"], "--num-threads", ["profile", "--out", "p.json", "--num-threads", "2"]),
    (["bench", "structured", "--concurrency", "3"], "--max-concurrency", ["bench", "structured", "--max-concurrency", "3"]),
    (["bench", "structured", "--num-requests", "5"], "--num-prompts", ["bench", "structured", "--num-prompts", "5"]),
    (["bench", "offline", "--num-requests", "5"], "--num-prompts", ["bench", "offline", "--num-prompts", "5"]),
]


def _vars(argv: list[str]) -> dict:
    return {k: v for k, v in vars(PARSER.parse_args(argv)).items() if k != "func"}


@pytest.mark.parametrize("old,new,new_argv", OLD_SPELLINGS, ids=[" ".join(c[0]) for c in OLD_SPELLINGS])
def test_old_spelling_parses_as_the_new_one_with_a_warning(old, new, new_argv, capsys):
    got = _vars(old)
    flag = next(a for a in old if a.startswith("--") and a not in new_argv)
    assert f"warning: {flag} is deprecated and will be removed; use {new}" in capsys.readouterr().err
    assert got == _vars(new_argv)
    assert "deprecated" not in capsys.readouterr().err


def test_old_speculative_flags_and_speculative_config(capsys):
    old = PARSER.parse_args(["serve", "--speculative-method", "draft", "--speculative-model", "self:int4",
                             "--num-speculative-tokens", "5"])
    assert capsys.readouterr().err.count("use --speculative-config") == 3
    new = PARSER.parse_args(["serve", "--speculative-config",
                             '{"method": "draft", "model": "self:int4", "num_speculative_tokens": 5}'])
    want = {"speculative_config": {"method": "draft", "model": "self:int4", "num_speculative_tokens": 5}}
    assert with_speculation_flags({}, old) == with_speculation_flags({}, new) == want
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            PARSER.parse_args(["serve", "--speculative-config", bad])
        assert "--speculative-config" in capsys.readouterr().err


def test_sizes_take_units_and_swap_space_is_gib(capsys):
    assert _vars(["serve", "--kv-cache-memory", "4GiB"])["kv_cache_memory"] == 4 << 30
    assert _vars(["serve", "--kv-cache-memory", "67108864"])["kv_cache_memory"] == 64 << 20
    assert _vars(["serve", "--swap-space", "2"])["swap_space"] == 2 << 30
    assert _vars(["serve", "--swap-space", "512MiB"])["swap_space"] == 512 << 20
    with pytest.raises(SystemExit):  # the old unit: bytes
        PARSER.parse_args(["serve", "--swap-space", str(512 << 20)])
    assert "--swap-space is in GiB now" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        PARSER.parse_args(["serve", "--kv-cache-memory", "4 parsecs"])
    assert "not a size" in capsys.readouterr().err
    assert parse_size("1.5G") == 1_500_000_000 and parse_size("2", "MiB") == 2 << 20


def test_serve_takes_the_model_as_a_positional_and_a_seed():
    assert model_of(PARSER.parse_args(["serve", "tiny-llama"])) == "tiny-llama"
    assert model_of(PARSER.parse_args(["serve", "--model", "tiny-llama"])) == "tiny-llama"
    assert model_of(PARSER.parse_args(["serve", "a", "--model", "a"])) == "a"
    assert model_of(PARSER.parse_args(["serve"])) is None
    with pytest.raises(ValueError, match="two models"):
        model_of(PARSER.parse_args(["serve", "a", "--model", "b"]))
    assert PARSER.parse_args(["serve", "--seed", "7"]).seed == 7


def test_goodput_is_milliseconds_in_every_command():
    assert parse_goodput(["ttft:500", "tpot:100", "e2el:10000"]) == {"ttft": 0.5, "tpot": 0.1, "e2e": 10.0}
    for bad in (["ttft=500"], ["itl:5"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    plan = ["plan", "--rate", "1", "--prompt-mean", "10", "--output-mean", "10"]
    assert _slo_seconds(PARSER.parse_args(plan)) == (1.0, 0.05)
    assert _slo_seconds(PARSER.parse_args(plan + ["--goodput", "tpot:20"])) == (1.0, 0.02)
    assert _slo_seconds(PARSER.parse_args(plan + ["--ttft-slo", "0.3", "--itl-slo", "0.04"])) == (0.3, 0.04)
    with pytest.raises(ValueError, match="e2el"):
        _slo_seconds(PARSER.parse_args(plan + ["--goodput", "e2el:100"]))


def test_bench_serve_result_file(tmp_path):
    args = PARSER.parse_args(["bench", "serve", "--save-result", "--result-dir", str(tmp_path),
                              "--max-concurrency", "4", "--dataset-name", "mixed"])
    path = bench_serve.result_path(args)
    assert path.parent == tmp_path and path.name.startswith("tandem-mixed-infqps-4conc-")
    args = PARSER.parse_args(["bench", "serve", "--save-result", "--result-filename", "r.json"])
    assert bench_serve.result_path(args).name == "r.json"
    assert bench_serve.result_path(PARSER.parse_args(["bench", "serve", "--json", "x.json"])).name == "x.json"
    assert bench_serve.result_path(PARSER.parse_args(["bench", "serve"])) is None
    with pytest.raises(ValueError, match="need --save-result"):
        bench_serve.result_path(PARSER.parse_args(["bench", "serve", "--result-dir", "d"]))
    for flags, match in ((["--percentile-metrics", "ttft,p99"], "--percentile-metrics"),
                         (["--metric-percentiles", "50,101"], "--metric-percentiles")):
        with pytest.raises(ValueError, match=match):
            bench_serve._report_options(PARSER.parse_args(["bench", "serve", *flags]))
    assert bench_serve._report_options(PARSER.parse_args(
        ["bench", "serve", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9"])) == \
        (("ttft", "e2el"), (50.0, 99.9))


def test_every_flag_has_help():
    """Each option of every command says what it is (its unit and default in the text)."""

    def walk(p: argparse.ArgumentParser, name: str):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    yield from walk(sp, f"{name} {sub}")
            elif a.option_strings and a.dest != "help":
                yield name, a

    missing = [f"{name} {a.option_strings[0]}" for name, a in walk(PARSER, "tandem") if not a.help]
    assert not missing, f"no help for {missing}"


def test_bench_offline_takes_speculative_config(capsys):
    new = PARSER.parse_args(["bench", "offline", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    old = PARSER.parse_args(["bench", "offline", "--speculative-method", "ngram", "--num-speculative-tokens", "3"])
    assert capsys.readouterr().err.count("use --speculative-config") == 2
    want = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    assert with_speculation_flags({}, new) == with_speculation_flags({}, old) == want
    assert with_speculation_flags({}, PARSER.parse_args(["bench", "offline"])) == {}
    assert _vars(["bench", "offline", "--kv-cache-memory", "64MiB"])["kv_cache_memory"] == 64 << 20


def test_gpu_memory_utilization_sizes_the_kv_pool_from_a_share_of_memory():
    import psutil
    import torch

    from tandem.config import EngineConfig
    from tandem.executor.device import default_kv_cache_memory

    assert _vars(["serve", "--gpu-memory-utilization", "0.5"])["gpu_memory_utilization"] == 0.5
    cpu = torch.device("cpu")
    half = default_kv_cache_memory(cpu, 0.5)
    assert 0.4 < half / psutil.virtual_memory().available < 0.6  # what was available a moment ago
    assert default_kv_cache_memory(cpu) <= 2 << 30  # unset: a quarter, at most 2 GiB
    for bad in (dict(gpu_memory_utilization=0), dict(gpu_memory_utilization=1.5),
                dict(gpu_memory_utilization=-0.1), dict(gpu_memory_utilization=0.5, kv_cache_memory=1 << 20)):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(**bad)
