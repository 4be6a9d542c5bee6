"""Weight-only int8 / int4 layers against their dequantise-then-F.linear reference, GGUF Q4 codes
against the gguf package's dequantisation, and quantised engines against transformers running
the same dequantised weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy, random_prompts, token_ids
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.models.gguf.quants import int4_rows
from tandem.models.quantization import base
from tandem.models.quantization.embedding import QuantEmbedding
from tandem.models.quantization.int4 import Int4Linear, int4_dequantize, quantize_int4
from tandem.models.quantization.int8 import Int8Linear, quantize_int8

# (N, K) of every GEMM weight: SmolLM2-135M (qkv, o, gate_up, down, LM head), then the tiny
# test models (llama / qwen2 / mistral: head_dim 16; qwen3: head_dim 32).
SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
TINY_SHAPES = [(128, 64), (64, 64), (256, 64), (64, 128), (512, 64), (256, 64), (64, 128)]
# Both paths compute in fp32 and the kernel rounds its output to bf16 once: 2^-8 of the
# largest output, with room for the kernels' own accumulation order.
TOL = 8e-3


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture
def torch_kernels(monkeypatch):
    """The weight-only torch-kernel path, as on a CPU without AVX2 or AVX512-VNNI (the integer
    kernel: test_quant_kernel.py)."""
    monkeypatch.setattr(base, "int8_act_kernel", lambda *args: None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", sorted(set(SMOLLM2_SHAPES + TINY_SHAPES)))
def test_quantized_linear_equals_reference(shape, dtype, torch_kernels):
    """On CPU the kernels take bf16 activations whatever the model's dtype (fp32 in, fp32 out)."""
    n, k = shape
    torch.manual_seed(n + k)
    w, bias = torch.randn(n, k), torch.randn(n)
    x = torch.randn(5, k, dtype=torch.bfloat16).to(dtype)
    q8, s8 = quantize_int8(w)
    int8 = Int8Linear(q8, s8, bias, dtype)
    ref8 = F.linear(x.float(), q8.float() * s8.bfloat16().float()[:, None], bias.to(dtype).float())
    assert int8.use_kernel and int8(x).dtype == dtype and _rel_err(int8(x), ref8) < TOL
    codes, scales, zeros = quantize_int4(w, 32)
    int4 = Int4Linear(codes, scales, zeros, bias, dtype)
    ref4 = F.linear(
        x.float(),
        int4_dequantize(codes, scales.bfloat16(), zeros.bfloat16()),
        bias.to(dtype).float(),
    )
    assert int4.packed is not None and int4(x).dtype == dtype and _rel_err(int4(x), ref4) < TOL


def test_quantization_error_is_bounded():
    """Round to nearest: int8 is within half a step of max|w| / 127 per row, int4 within half a
    step of its group's range / 15."""
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    q8, s8 = quantize_int8(w)
    assert ((q8.float() * s8[:, None] - w).abs() <= s8[:, None] / 2 + 1e-6).all()
    codes, scales, zeros = quantize_int4(w, 32)
    err = (int4_dequantize(codes, scales, zeros) - w).abs()
    assert (err <= scales.repeat_interleave(32, 1) / 2 + 1e-5).all()
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int4(torch.randn(8, 48), 32)


def test_rejected_kernel_falls_back_to_reference(monkeypatch, torch_kernels):
    """Where an op rejects a shape (or this torch lacks it) the layer runs
    dequantise-then-F.linear."""

    def reject(*args):
        raise RuntimeError("shape rejected")

    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", reject)
    monkeypatch.setattr(torch, "_weight_int8pack_mm", reject)
    torch.manual_seed(1)
    w, x = torch.randn(96, 64), torch.randn(3, 64, dtype=torch.bfloat16)
    int4, int8 = (
        Int4Linear.from_float(w, None, torch.bfloat16),
        Int8Linear.from_float(w, None, torch.bfloat16),
    )
    assert int4.packed is None and not int8.use_kernel
    codes, scales, zeros = quantize_int4(w, 32)
    assert torch.equal(
        int4(x), F.linear(x, int4_dequantize(codes, scales.bfloat16(), zeros.bfloat16()).bfloat16())
    )
    assert torch.equal(int8(x), F.linear(x, int8.dequantize(torch.bfloat16)))


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_gguf_q4_blocks_decode_to_gguf_dequantisation(kind):
    """The codes and block scales we load are the file's: dequantised, they equal gguf's own
    dequantisation exactly (fp32)."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 96)) * rng.uniform(0.01, 3, (24, 1))).astype(np.float32)
    raw = quantize(w, kind)
    codes, scales, zeros = int4_rows(raw, kind)
    ours = int4_dequantize(
        torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(zeros)
    )
    assert codes.max() <= 15
    np.testing.assert_array_equal(ours.numpy(), dequantize(raw, kind).reshape(w.shape))


def _dequantised_copy(src: str, dst: Path, precision: str) -> str:
    """The checkpoint with every GEMM weight replaced by what the variant computes with: the
    reference transformers runs."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    weights = load_file(dst / "model.safetensors")
    if config.get("tie_word_embeddings"):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
        config["tie_word_embeddings"] = False
    for name, w in weights.items():
        if w.dim() != 2:
            continue
        # the embedding is read from an int8 table (the tied LM head's, or its own)
        if precision == "int8" or name == "lm_head.weight" or "embed_tokens" in name:
            q, s = quantize_int8(w)
            weights[name] = q.float() * s[:, None]
        else:
            weights[name] = int4_dequantize(*quantize_int4(w, 32))
    save_file(weights, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_quantized_engine_matches_hf_on_dequantised_weights(
    tiny_model_dirs, tmp_path, kind, precision, monkeypatch
):
    """fp32 activations: the quantised engine, batched, gives transformers' greedy tokens for
    the dequantised checkpoint (run one prompt at a time). The layers run their dequantise-then-
    F.linear path: the kernels round activations to bf16 (held to that path above)."""

    def reject(*args):
        raise RuntimeError("the reference path")

    monkeypatch.setattr(base, "int8_act_kernel", lambda *args: None)
    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", reject)
    monkeypatch.setattr(torch, "_weight_int8pack_mm", reject)
    prompts = random_prompts(4, 4, 3, 40)
    reference = hf_greedy(
        _dequantised_copy(tiny_model_dirs[kind], tmp_path / kind, precision), prompts, 10
    )
    llm = LLM(
        tiny_model_dirs[kind], dtype="float32", kv_cache_memory=1 << 22, quantization=precision
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert token_ids(outs) == reference


@pytest.mark.slow
def test_smollm2_int4_holds_the_gguf_q4_1_weights():
    """Every Q4_1 tensor of the default model (q/k un-permuted on the codes) dequantises exactly
    to the gguf package's dequantisation, which the float variants load."""
    from tandem.models.gguf.weights import GGUFWeights
    from tandem.models.loader.model_files import gguf_source

    weights = GGUFWeights(gguf_source("smollm2-135m"))
    codes = {name: weights.int4(name) for name in weights.names()}
    codes = {name: c for name, c in codes.items() if c is not None}
    assert len(codes) == 210
    for name, (c, s, z) in codes.items():
        assert torch.equal(int4_dequantize(c, s, z), weights.get(name)), name


@pytest.mark.parametrize("int8_act", [False, True])
def test_int8_embedding_rows_are_the_tables_dequantised_rows(int8_act):
    """An int8 variant's embedding reads rows of its LM head's table: the rows `dequantize`
    gives, on the plain layout and on the integer kernel's tiles ([N/16, K/4, 16, 4] bytes of
    q + 128, laid out here by hand: this CPU may not have the kernel)."""
    layer = Int8Linear.from_float(torch.randn(48, 64), None, torch.float32)
    if int8_act:
        q = layer.qweight.to(torch.int16) + 128
        layer.qweight = (
            q.to(torch.uint8).reshape(3, 16, 16, 4).permute(0, 2, 1, 3).contiguous().reshape(48, -1)
        )
        layer.scales, layer.int8_act = layer.scales.float(), True
    ids = torch.tensor([[0, 17, 47], [5, 5, 31]])
    rows = QuantEmbedding(layer, torch.float32)(ids)
    assert rows.shape == (2, 3, 64)
    torch.testing.assert_close(rows, layer.dequantize()[ids], rtol=0, atol=0)
