"""vLLM's flag names and units, on every command."""

from __future__ import annotations

import argparse

import pytest

from tandem.bench import serve as bench_serve
from tandem.bench.report import parse_goodput
from tandem.cli import build_parser
from tandem.config.option import option, parse_size
from tandem.server.launch import build_configs, model_of
from tandem.tools.plan_cli import _slo_seconds

PARSER = build_parser()


def _vars(argv: list[str]) -> dict:
    return {k: v for k, v in vars(PARSER.parse_args(argv)).items() if k != "func"}


def test_speculative_config_is_json(capsys):
    args = PARSER.parse_args(
        [
            "serve",
            "--speculative-config",
            '{"method": "draft", "model": "self:int4", "num_speculative_tokens": 5}',
        ]
    )
    spec = build_configs(args)[0].speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft", "self:int4", 5)
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            PARSER.parse_args(["serve", "--speculative-config", bad])
        assert "--speculative-config" in capsys.readouterr().err


def test_sizes_take_units_and_swap_space_is_gib(capsys):
    assert _vars(["serve", "--kv-cache-memory", "4GiB"])["kv_cache_memory"] == 4 << 30
    assert _vars(["serve", "--kv-cache-memory", "67108864"])["kv_cache_memory"] == 64 << 20
    assert _vars(["serve", "--swap-space", "2"])["swap_space"] == 2 << 30
    assert _vars(["serve", "--swap-space", "512MiB"])["swap_space"] == 512 << 20
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
    assert parse_goodput(["ttft:500", "tpot:100", "e2el:10000"]) == {
        "ttft": 0.5,
        "tpot": 0.1,
        "e2e": 10.0,
    }
    for bad in (["ttft=500"], ["itl:5"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    plan = ["plan", "--rate", "1", "--prompt-mean", "10", "--output-mean", "10"]
    assert _slo_seconds(PARSER.parse_args(plan)) == (1.0, 0.05)
    assert _slo_seconds(PARSER.parse_args(plan + ["--goodput", "tpot:20"])) == (1.0, 0.02)
    with pytest.raises(ValueError, match="e2el"):
        _slo_seconds(PARSER.parse_args(plan + ["--goodput", "e2el:100"]))


def test_bench_serve_result_file(tmp_path):
    args = PARSER.parse_args(
        [
            "bench",
            "serve",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--max-concurrency",
            "4",
            "--dataset-name",
            "mixed",
        ]
    )
    path = bench_serve.result_path(args)
    assert path.parent == tmp_path and path.name.startswith("tandem-mixed-infqps-4conc-")
    args = PARSER.parse_args(["bench", "serve", "--save-result", "--result-filename", "r.json"])
    assert bench_serve.result_path(args).name == "r.json"
    assert bench_serve.result_path(PARSER.parse_args(["bench", "serve"])) is None
    with pytest.raises(ValueError, match="need --save-result"):
        bench_serve.result_path(PARSER.parse_args(["bench", "serve", "--result-dir", "d"]))
    for flags, match in (
        (["--percentile-metrics", "ttft,p99"], "--percentile-metrics"),
        (["--metric-percentiles", "50,101"], "--metric-percentiles"),
    ):
        with pytest.raises(ValueError, match=match):
            bench_serve._report_options(PARSER.parse_args(["bench", "serve", *flags]))
    assert bench_serve._report_options(
        PARSER.parse_args(
            [
                "bench",
                "serve",
                "--percentile-metrics",
                "ttft,e2el",
                "--metric-percentiles",
                "50,99.9",
            ]
        )
    ) == (("ttft", "e2el"), (50.0, 99.9))


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
    # A config field's flag always has its unit and default appended: the field needs words.
    for empty in ("", " "):
        with pytest.raises(ValueError, match="says what it does"):
            option(1, empty)


def test_bench_offline_takes_speculative_config():
    args = PARSER.parse_args(
        [
            "bench",
            "offline",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}',
        ]
    )
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert PARSER.parse_args(["bench", "offline"]).speculative_config is None
    assert _vars(["bench", "offline", "--kv-cache-memory", "64MiB"])["kv_cache_memory"] == 64 << 20


def test_bench_offline_takes_num_threads_in_both_runs():
    from tandem.bench.offline import _refuse_the_other_runs_options

    for extra in ([], ["--quantization", "int8"]):
        args = PARSER.parse_args(["bench", "offline", "--num-threads", "2", *extra])
        _refuse_the_other_runs_options(args)  # the request run and the table both read it
        assert args.num_threads == 2


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
    for bad in (
        dict(gpu_memory_utilization=0),
        dict(gpu_memory_utilization=1.5),
        dict(gpu_memory_utilization=-0.1),
        dict(gpu_memory_utilization=0.5, kv_cache_memory=1 << 20),
    ):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig.from_kwargs(**bad)
