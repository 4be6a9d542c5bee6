"""`tandem bench load` on a tiny quantised GGUF: the figures are there and plausible, the cache
holds no weights."""

from __future__ import annotations

import argparse

from gguf import GGMLQuantizationType as Q
from test_gguf_serving import Q4_K_M, write_quantised_gguf

from tandem.bench import load


def test_bench_load_reports_the_load_of_a_gguf(tmp_path, capsys):
    path = write_quantised_gguf(
        tmp_path / "tiny-Q4_K_M.gguf", {**Q4_K_M, "ffn_gate": Q.Q4_K}
    )  # mostly Q4_K: int4
    args = argparse.Namespace(
        model=str(path),
        quantization=None,
        dtype="float32",
        cache=None,
        json_path=str(tmp_path / "load.json"),
        phase=None,
    )
    report = load.main(args)
    assert report["precisions"] == ["int4"] and report["file_bytes"] == path.stat().st_size
    assert (
        0 < report["cache_bytes_written"] < 64 << 10
    )  # config.json and gguf.json: no weights, no tokenizer here
    assert report["load_peak_rss_above_baseline"] >= report["held_rss_above_baseline"] > 0
    assert report["weight_bytes"]["int4"] > 0 and report["load_s"] > 0
    assert "peak RSS" in capsys.readouterr().out and (tmp_path / "load.json").is_file()
