"""`tandem bench llamacpp`: llama-batched-bench's table parsed from a captured run, its command
built to match Tandem's decode steps, and a missing binary refused in words."""

from __future__ import annotations

import argparse
import operator
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tandem.bench import llamacpp, llamacpp_decode
from tandem.bench.llamacpp import llama_cpp_tool
from tandem.bench.llamacpp_decode import batched_bench_command, parse_batched_bench, run_llama
from tandem.bench.measure import in_subprocess

# Captured SAMPLE_PLACEHOLDER
SAMPLE = """\
main: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    127 |    1 |    255 |    0.123 |  1040.65 |    1.234 |   102.92 |    1.357 |   187.91 |
|   128 |    127 |   16 |   4080 |    1.987 |  1030.70 |    6.543 |   310.56 |    8.530 |   478.31 |

llama_perf_context_print:        load time =     123.45 ms
"""


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(
        **{
            "batch_sizes": "1,16",
            "prompt_len": 128,
            "output_len": 128,
            "num_threads": 2,
            "prefill_lens": None,
            "kv_cache_dtypes": None,
            "llama_cache_types": None,
            "shared_prompt": False,
            **kw,
        }
    )


def test_parses_the_table_by_its_header_names():
    rows = parse_batched_bench(SAMPLE)
    assert sorted(rows) == [1, 16]
    assert rows[1]["S_TG t/s"] == 102.92 and rows[16]["S_TG t/s"] == 310.56
    assert rows[16]["N_KV"] == 4080 and rows[16]["TG"] == 127


def test_no_table_is_an_error_in_words():
    with pytest.raises(ValueError, match="no llama-batched-bench table"):
        parse_batched_bench("main: error: unable to load model\n")


def test_command_decodes_the_same_steps_as_tandem():
    cmd = batched_bench_command(Path("/bin/llama-batched-bench"), Path("m.gguf"), _args())
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags == {
        "-m": "m.gguf",
        "-c": str(16 * 256),
        "-npp": "128",
        "-ntg": "127",
        "-npl": "1,16",
        "-t": "2",
    }


def test_run_llama_reads_s_tg_and_misses_no_batch(tmp_path):
    fake = tmp_path / "llama-batched-bench"
    (tmp_path / "out.txt").write_text(SAMPLE)
    fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'out.txt'}\n")
    fake.chmod(0o755)
    assert run_llama([str(fake)], [1, 16]) == {1: 102.92, 16: 310.56}
    with pytest.raises(ValueError, match=r"no row for batch size\(s\) \[32\]"):
        run_llama([str(fake)], [1, 32])
    fake.write_text("#!/bin/sh\necho 'error: unable to load model' >&2\nexit 1\n")
    with pytest.raises(ValueError, match="failed \\(exit 1\\):\nerror: unable to load model"):
        run_llama([str(fake)], [1])


def test_missing_binary_is_refused_in_words(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        FileNotFoundError, match="llama-batched-bench is not on PATH.*--llama-batched-bench PATH"
    ):
        llama_cpp_tool("llama-batched-bench", None)
    with pytest.raises(FileNotFoundError, match="not an executable file"):
        llama_cpp_tool("llama-batched-bench", str(tmp_path / "missing"))
    args = _args(
        model="smollm2-135m",
        quantization="int4",
        dtype="auto",
        repeats=1,
        kv_cache_memory=None,
        seed=0,
        llama_batched_bench=None,
        json_path=None,
    )
    with pytest.raises(FileNotFoundError, match="not on PATH"):
        llamacpp.main(args)


def _die(args, requests):
    os._exit(3)


def test_a_side_that_fails_or_dies_is_an_error_not_a_hang():
    """Each Tandem side runs in a spawned process: its exception, or its death before it answers
    (the kernel's OOM killer, say), comes back as an error."""
    with pytest.raises(RuntimeError, match="in the benchmark's process: ZeroDivisionError"):
        in_subprocess(operator.truediv, 1, 0)
    with pytest.raises(RuntimeError, match=r"died \(exit code 3\) before it answered"):
        in_subprocess(_die, None, None)
    assert in_subprocess(operator.add, 2, 3) == 5


def _sleep(seconds, requests):
    time.sleep(seconds)


def test_a_side_given_up_on_stops_its_process():
    """Ctrl-C (or any error) while waiting on a side leaves no benchmark process running on."""

    def spawned():
        return [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 3.0)
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            in_subprocess(_sleep, 60, None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 30  # not the child's 60 s
    assert spawned() == []


def test_auto_is_the_precision_the_file_stores(monkeypatch):
    """`--quantization auto` measures the precision `tandem serve` would pick, and names it."""
    from tandem.bench import quantization

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(model, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr("tandem.LLM", fake_llm)
    args = argparse.Namespace(
        model="smollm2-135m",
        dtype="auto",
        kv_cache_dtype="auto",
        device="cpu",
        batch_sizes="1",
        prompt_len=8,
        output_len=4,
        kv_cache_memory=None,
        num_threads=1,
        seed=0,
    )
    with pytest.raises(Stop):
        quantization.run_precision(args, "auto", False)
    assert seen["quantization"] == "int4"


def test_compare_alternates_the_sides_and_names_what_auto_ran(monkeypatch, tmp_path, capsys):
    """Each round rotates the order of the sides, each keeps its best figure, a side asked for as
    `auto` is labelled with the precision it resolved to, and the table gives each side's peak
    RSS."""
    order = []
    runs = iter([10.0, 30.0, 20.0, 5.0])

    def fake_tandem(fn, args, requests):
        order.append(fn.precision)
        return {
            "decode_tok_s": {1: next(runs)},
            "peak_rss_mb": 100.0,
            "precision": "int4",
            "kv_cache_dtype": "bfloat16",
        }

    def fake_llama(command, batches):
        order.append("llama")
        return {1: 20.0}

    monkeypatch.setattr("tandem.bench.measure.in_subprocess", fake_tandem)
    monkeypatch.setattr(llamacpp_decode, "run_llama", fake_llama)
    report = llamacpp_decode.compare(
        _args(
            quantization="auto,int4",
            repeats=2,
            batch_sizes="1",
            model="m",
            llama_batched_bench=None,
            dtype="auto",
            kv_cache_dtype="auto",
            kv_cache_memory=None,
            seed=0,
        ),
        tmp_path / "m.gguf",
        Path("/bin/true"),
    )
    assert order == ["auto", "int4", "llama", "int4", "llama", "auto"]
    assert report["decode_tok_s"]["auto (int4)"] == {1: 10.0} and report["decode_tok_s"][
        "int4"
    ] == {1: 30.0}
    assert report["ratio"]["int4"] == {1: 1.5}
    llamacpp_decode.print_table(report)
    out = capsys.readouterr().out
    assert "tandem peak RSS: auto (int4) 100 MiB, int4 100 MiB" in out
    assert "tandem KV cache: auto (int4) bfloat16, int4 bfloat16" in out
