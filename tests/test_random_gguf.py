"""`tandem random-gguf`: the tiny shape writes a Llama GGUF with the default model's vocabulary
that Tandem loads and generates from; the named shapes have the sizes they claim; a missing
llama-quantize is refused in words before anything is written."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from gguf import GGUFReader

from tandem import LLM, SamplingParams
from tandem.models.loader.model_files import gguf_source
from tandem.tools import random_gguf
from tandem.tools.random_gguf import SHAPES, active_parameters, tensor_shapes, write_random_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("random-gguf") / "random-llama-tiny.F16.gguf"
    write_random_gguf(path, "tiny", gguf_source("smollm2-135m"), "F16", seed=0)
    return path


@pytest.mark.slow  # the default model's GGUF read, and a file written from it
def test_tiny_file_has_the_shape_and_the_default_models_vocab(tiny_gguf):
    reader = GGUFReader(tiny_gguf)
    source = GGUFReader(gguf_source("smollm2-135m"))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert (
        reader.fields["tokenizer.ggml.tokens"].contents()
        == source.fields["tokenizer.ggml.tokens"].contents()
    )
    tensors = {t.name: t for t in reader.tensors}
    assert [(name, dims) for name, dims in tensor_shapes(SHAPES["tiny"], 49152)] == [
        (t.name, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors
    ]
    q = np.asarray(tensors["blk.0.attn_q.weight"].data, np.float32)
    assert q.dtype == np.float32 and 0.015 < q.std() < 0.025
    assert np.all(np.asarray(tensors["blk.1.ffn_norm.weight"].data) == 1)


@pytest.mark.slow
def test_tandem_loads_and_generates_from_it(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    llm = LLM(str(tiny_gguf), dtype="float32", kv_cache_memory=1 << 22)
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[
        0
    ].outputs[0]
    assert len(out.token_ids) == 6 and all(0 <= t < 49152 for t in out.token_ids)
    assert isinstance(out.text, str)


@pytest.mark.parametrize("shape, low, high", [("1b", 1.0e9, 1.15e9), ("3b", 2.9e9, 3.1e9)])
def test_named_shapes_have_their_parameter_counts(shape, low, high):
    params = sum(int(np.prod(dims)) for _, dims in tensor_shapes(SHAPES[shape], 49152))
    assert low < params < high


def test_the_moe_shape_has_15b_parameters_of_which_a_token_reads_1_5b():
    shape = SHAPES["moe-15b-a1.5b"]
    assert 14.9e9 < sum(int(np.prod(dims)) for _, dims in tensor_shapes(shape, 49152)) < 15.2e9
    assert 1.4e9 < active_parameters(shape, 49152) < 1.55e9


@pytest.mark.slow  # the default model's GGUF read, and a file written from it
def test_the_tiny_moe_file_is_a_qwen3_moe_tandem_serves(tmp_path, monkeypatch):
    """The MoE layout at tiny widths: 3-D expert tensors, an F32 router; Tandem reads it as a
    Qwen3-MoE and generates."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = tmp_path / "random-qwen3moe-tiny-moe.F16.gguf"
    write_random_gguf(path, "tiny-moe", gguf_source("smollm2-135m"), "F16", seed=0)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    assert tuple(int(d) for d in reversed(tensors["blk.1.ffn_down_exps.weight"].shape)) == (
        8,
        64,
        32,
    )
    assert tensors["blk.0.ffn_gate_inp.weight"].data.dtype == np.float32
    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22)
    model = next(iter(llm.engine.core.executor.variants.models.values()))
    assert model.cfg.moe.num_experts == 8
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


def test_quantize_without_llama_quantize_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    out = tmp_path / "x.gguf"
    args = argparse.Namespace(
        shape="tiny",
        out=out,
        dtype="F16",
        seed=0,
        tokenizer_from="smollm2-135m",
        quantize="Q4_K_M",
        llama_quantize=None,
    )
    with pytest.raises(FileNotFoundError, match="llama-quantize is not on PATH"):
        random_gguf.main(args)
    args.llama_quantize = str(tmp_path / "nowhere" / "llama-quantize")
    with pytest.raises(FileNotFoundError, match="not an executable file"):
        random_gguf.main(args)
    assert not out.exists()
