"""`tandem bench llamacpp` at long prompts and with a KV axis: the flags, llama.cpp's cache types,
the sides and ratios of a run, one table over the prompt lengths, and a context the model's
config does not allow refused before any run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tandem.bench import llamacpp, llamacpp_decode


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    llamacpp.add_arguments(p)
    return p.parse_args(list(argv))


def test_prompt_lengths_and_kv_dtypes_are_parsed_and_checked(capsys):
    args = _parse("--prompt-len", "16000,32000", "--kv-cache-dtypes", "bfloat16,int8")
    assert args.prompt_lens == [16000, 32000]
    assert llamacpp_decode.kv_dtypes(args) == ["bfloat16", "int8"]
    assert _parse().prompt_lens == [128] and llamacpp_decode.kv_dtypes(_parse()) is None
    for bad in ("0", "16k", ""):
        with pytest.raises(SystemExit):
            _parse("--prompt-len", bad)
    assert "give positive token counts" in capsys.readouterr().err
    for bad in ("bf16,int8", "int8,int8"):
        with pytest.raises(ValueError, match="give distinct ones of auto, bfloat16"):
            llamacpp_decode.kv_dtypes(_parse("--kv-cache-dtypes", bad))


def test_a_cache_type_runs_both_caches_with_flash_attention():
    args = argparse.Namespace(
        batch_sizes="1,4", prompt_len=16000, output_len=64, num_threads=2, shared_prompt=False
    )
    cmd = llamacpp_decode.batched_bench_command(Path("/b"), Path("m.gguf"), args, "q8_0")
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags["-ctk"] == flags["-ctv"] == "q8_0" and flags["-fa"] == "on"
    assert flags["-c"] == str(4 * 16064) and flags["-npp"] == "16000" and flags["-ntg"] == "63"
    assert "-pps" not in cmd
    args.shared_prompt = True
    assert llamacpp_decode.batched_bench_command(Path("/b"), Path("m.gguf"), args)[-1] == "-pps"


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(
        **{
            "model": "m",
            "quantization": "auto",
            "kv_cache_dtypes": "bfloat16,float16,int8",
            "kv_cache_dtype": "auto",
            "dtype": "auto",
            "batch_sizes": "1,4",
            "prompt_len": 16000,
            "output_len": 64,
            "kv_cache_memory": None,
            "num_threads": 2,
            "seed": 0,
            "repeats": 1,
            "llama_cache_types": None,
            "shared_prompt": False,
            **kw,
        }
    )


def test_each_kv_dtype_against_the_llama_cache_of_its_width(monkeypatch, tmp_path, capsys):
    """bfloat16 and float16 share llama.cpp's f16 run; int8 is against q8_0 and against the
    first KV dtype; Tandem's sides prefill each prompt alone first."""
    tok_s = {"bfloat16": 10.0, "float16": 12.0, "int8": 15.0, "f16": 8.0, "q8_0": 6.0}
    runs = []

    def fake_tandem(fn, args, requests):
        runs.append((fn.precision, args.kv_cache_dtype, fn.prefill))
        return {
            "decode_tok_s": {1: tok_s[args.kv_cache_dtype], 4: 2 * tok_s[args.kv_cache_dtype]},
            "peak_rss_mb": 100.0,
            "precision": "int4",
            "kv_cache_dtype": args.kv_cache_dtype,
        }

    def fake_llama(command, batches):
        runs.append(command[command.index("-ctk") + 1])
        return {1: tok_s[runs[-1]], 4: 2 * tok_s[runs[-1]]}

    monkeypatch.setattr("tandem.bench.measure.in_subprocess", fake_tandem)
    monkeypatch.setattr(llamacpp_decode, "run_llama", fake_llama)
    reports = [
        llamacpp_decode.compare(_args(prompt_len=n), tmp_path / "m.gguf", Path("/b"))
        for n in (16000, 32000)
    ]
    assert runs[:5] == [
        ("auto", "bfloat16", "alone"),
        ("auto", "float16", "alone"),
        ("auto", "int8", "alone"),
        "f16",
        "q8_0",
    ]
    report = reports[0]
    assert list(report["decode_tok_s"]) == [
        "auto (int4) kv bfloat16",
        "auto (int4) kv float16",
        "auto (int4) kv int8",
        "llama.cpp f16",
        "llama.cpp q8_0",
    ]
    assert report["ratio"]["auto (int4) kv int8"] == {1: 2.5, 4: 2.5}
    assert report["ratio"]["auto (int4) kv bfloat16"] == {1: 1.25, 4: 1.25}
    assert report["kv_ratio"] == {
        "auto (int4) kv float16 / bfloat16": {1: 1.2, 4: 1.2},
        "auto (int4) kv int8 / bfloat16": {1: 1.5, 4: 1.5},
    }
    capsys.readouterr()
    llamacpp_decode.print_table(*reports)
    out = capsys.readouterr().out
    assert "-ctk q8_0 -ctv q8_0 -fa on`" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("prompt"))
    assert "auto (int4) kv int8 / llama.cpp q8_0" in header and "kv int8 / bfloat16" in header
    rows = [line.split() for line in lines if line.lstrip()[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [
        ("16000", "1"),
        ("16000", "4"),
        ("32000", "1"),
        ("32000", "4"),
    ]
    assert rows[3][2:] == ["20.0", "24.0", "30.0", "16.0", "12.0"] + ["1.25x", "1.50x", "2.50x"] + [
        "1.20x",
        "1.50x",
    ]
    assert "(llama.cpp's: f16, q8_0)" in out


def test_llama_cache_types_chosen_and_prompts_shared(monkeypatch, tmp_path, capsys):
    """--llama-cache-types q8_0 skips llama.cpp's f16 run (bfloat16 then has no llama.cpp
    ratio, only int8's), none every llama.cpp run; --shared-prompt reaches Tandem's sides."""
    runs = []

    def fake_tandem(fn, args, requests):
        runs.append(fn.prefill)
        tok_s = 10.0 if args.kv_cache_dtype == "bfloat16" else 15.0
        return {
            "decode_tok_s": {1: tok_s},
            "peak_rss_mb": 100.0,
            "precision": "int4",
            "kv_cache_dtype": args.kv_cache_dtype,
        }

    def fake_llama(command, batches):
        runs.append(command[command.index("-ctk") + 1])
        return {1: 5.0}

    monkeypatch.setattr("tandem.bench.measure.in_subprocess", fake_tandem)
    monkeypatch.setattr(llamacpp_decode, "run_llama", fake_llama)
    args = _args(
        kv_cache_dtypes="bfloat16,int8",
        llama_cache_types="q8_0",
        shared_prompt=True,
        batch_sizes="1",
    )
    report = llamacpp_decode.compare(args, tmp_path / "m.gguf", Path("/b"))
    assert runs == ["shared", "shared", "q8_0"]
    assert report["ratio"] == {"auto (int4) kv int8": {1: 3.0}}
    assert report["kv_ratio"] == {"auto (int4) kv int8 / bfloat16": {1: 1.5}}
    llamacpp_decode.print_table(report)
    assert "share one prompt" in capsys.readouterr().out

    runs.clear()  # none: Tandem's KV dtypes alone, no llama.cpp binary needed
    args.llama_cache_types = "none"
    report = llamacpp_decode.compare(args, tmp_path / "m.gguf", None)
    assert runs == ["shared", "shared"]
    assert report["ratio"] == {} and report["llama_commands"] == []
    assert report["kv_ratio"] == {"auto (int4) kv int8 / bfloat16": {1: 1.5}}
    llamacpp_decode.print_table(report)
    out = capsys.readouterr().out
    assert "int8 / bfloat16" in out and "llama.cpp's" not in out


def test_a_context_past_the_models_config_is_refused_before_any_run(monkeypatch):
    """SmolLM2's config allows 8,192 positions: a 16,000-token prompt is refused in words
    (llama.cpp would run past them), before either side runs."""
    monkeypatch.setattr(llamacpp, "llama_cpp_tool", lambda name, path: Path("/b"))

    def no_run(*a, **kw):
        raise AssertionError("a side ran")

    monkeypatch.setattr(llamacpp_decode, "compare", no_run)
    args = _parse("--model", "smollm2-135m", "--prompt-len", "8000,16000", "--output-len", "64")
    with pytest.raises(ValueError, match="exceeds the 8192 positions .* give at most 8128"):
        llamacpp.main(args)
    llamacpp_decode.check_context("smollm2-135m", 8128, 64)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_prompts_prefilled_alone_decode_from_one_step(tiny_model_dirs, monkeypatch, kind):
    """Three 800-token prompts take two steps of 2,048 tokens together; prefilled alone first
    (or one shared prompt), the timed batch finds them in the prefix cache (a sliding window's
    too) and all three have their first token after the same step."""
    from tandem.bench import quantization

    steps = []

    def counting(engine, request_ids):
        waiting, n = set(request_ids), 0
        while waiting:
            waiting -= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
            n += 1
        steps.append(n)

    monkeypatch.setattr(quantization, "until_first_tokens", counting)
    args = argparse.Namespace(
        model=tiny_model_dirs[kind],
        dtype="float32",
        kv_cache_dtype="auto",
        device="cpu",
        batch_sizes="3",
        prompt_len=800,
        output_len=3,
        kv_cache_memory=None,
        num_threads=1,
        seed=0,
    )
    for prefill in ("together", "alone", "shared"):
        run = quantization.run_precision(args, "fp32", False, prefill)
        assert set(run["decode_tok_s"]) == {3}
    together, alone, shared = steps
    assert alone == shared < together
