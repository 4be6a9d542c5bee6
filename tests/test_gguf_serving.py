"""A quantised GGUF served as it is stored: `quantization: auto` picks the file's precision, int4
layers hold the file's Q4_K and Q5_0 codes, fp32 serving equals transformers on the file's
dequantised weights, and a precision the file cannot give is refused in words. Tiny random Llama
files whose layers mix the types of a Q4_K_M file (Q4_K, Q6_K, Q5_0, Q8_0, F32 norms)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import hf_greedy, token_ids
from gguf import GGMLQuantizationType as Q

from tandem import LLM, SamplingParams
from tandem.executor.attention import TorchAttention
from tandem.models.config import ModelConfig
from tandem.models.gguf.weights import GGUFWeights
from tandem.models.loader.builder import build_model
from tandem.models.loader.model_files import load_config, resolve_model
from tandem.models.quantization import base, int4
from tandem.models.quantization.int4 import Int4Linear
from tandem.models.quantization.int8 import Int8Linear
from tandem.models.quantization.q6k import Q6KLinear
from tandem.models.quantization.row_parts import RowParts

HIDDEN, INTER, VOCAB, LAYERS, HEADS, KV_HEADS = 256, 512, 320, 2, 4, 2
Q4_K_M = {
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q4_K,
    "attn_v": Q.Q6_K,
    "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q5_0,
    "ffn_up": Q.Q4_K,
    "ffn_down": Q.Q6_K,
    "token_embd": Q.Q8_0,
}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# byte offset of each block's fp16 d (then dmin, where the format has one), and the size that
# keeps weights small: |w| <= d * (largest scale code) * (largest quant)
_SCALES = {
    Q.Q4_K: ((0, 2), 2e-4),
    Q.Q6_K: ((208,), 2e-5),
    Q.Q5_0: ((0,), 4e-3),
    Q.Q8_0: ((0,), 1e-3),
    Q.Q4_0: ((0,), 4e-3),
    Q.Q8_1: ((0,), 1e-3),
}


def _blocks(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `kind` with small positive fp16 scales: [rows, bytes per row]."""
    size, nbytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows * cols // size, nbytes), dtype=np.uint8)
    offsets, scale = _SCALES[kind]
    for at in offsets:
        d = (rng.uniform(0.5, 1.5, len(blocks)) * scale).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_quantised_gguf(
    path: Path, kinds: dict[str, Q], default: Q = Q.Q4_K, seed: int = 0
) -> Path:
    """A tiny tied-embedding Llama GGUF: each 2-D tensor random blocks of its kind (by llama.cpp
    name; F32 for plain float32), norms F32 around 1."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    head_dim = HIDDEN // HEADS
    shapes = {
        "token_embd": (VOCAB, HIDDEN),
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (INTER, HIDDEN),
        "ffn_up": (INTER, HIDDEN),
        "ffn_down": (HIDDEN, INTER),
    }
    names = [("token_embd", "token_embd.weight"), ("output_norm", "output_norm.weight")]
    for i in range(LAYERS):
        parts = [*(part for part in shapes if part != "token_embd"), "attn_norm", "ffn_norm"]
        names += [(part, f"blk.{i}.{part}.weight") for part in parts]
    for part, name in names:
        if part not in shapes:
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
            continue
        kind = kinds.get(part, default)
        rows, cols = shapes[part]
        if kind == Q.F32:
            writer.add_tensor(name, (0.05 * rng.standard_normal((rows, cols))).astype(np.float32))
        else:
            writer.add_tensor(name, _blocks(kind, rows, cols, rng), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> str:
    return str(write_quantised_gguf(tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M.gguf", Q4_K_M))


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, VOCAB, n).tolist() for n in (5, 17, 33)]


@pytest.mark.parametrize(
    "kinds, default, expected",
    [
        (
            {**Q4_K_M, "ffn_gate": Q.Q4_K},
            Q.Q4_K,
            "int4",
        ),  # mostly Q4_K by size, as a large model's Q4_K_M
        ({"token_embd": Q.Q8_0}, Q.Q8_0, "int8"),
        ({"token_embd": Q.Q8_0}, Q.Q5_0, "int4"),  # 5-bit blocks: int4 holds their 5-bit codes
        ({"token_embd": Q.Q8_0}, Q.Q6_K, "int8"),
        (
            {"token_embd": Q.F32},
            Q.F32,
            "fp32",
        ),  # float weights: the engine's float dtype (fp32 asked here)
    ],
)
def test_auto_serves_the_precision_the_file_stores(tmp_path, kinds, default, expected) -> None:
    path = write_quantised_gguf(tmp_path / "m.gguf", kinds, default)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22)
    assert llm.engine.core.executor.variants.default == expected
    assert llm.engine.core.config.quant_config.quantization == "auto"
    assert len(llm.generate(_prompts()[:1], GREEDY)[0].outputs[0].token_ids) == 8


def test_int4_layers_hold_the_files_q4_k_codes(q4_k_m, monkeypatch) -> None:
    """On the reference path (the codes kept as they are): a layer whose parts are all Q4_K
    dequantises to the file's weights within a few ulp (tests/test_gguf_quants.py says why
    not bit for bit), and so does a layer of Q5_0 and Q4_K parts, held as 5-bit codes; without
    the integer kernel (which alone reads Q6_K) a Q6_K tensor is int8, and a fused layer of Q4_K
    and Q6_K parts runs as its int4 and int8 parts."""
    monkeypatch.setattr(int4, "_pack_int4", lambda *args: None)
    monkeypatch.setattr(base, "int8_act_kernel", lambda *args: None)
    folder = resolve_model(q4_k_m)
    model = build_model(
        GGUFWeights(Path(q4_k_m)),
        ModelConfig.from_hf(load_config(folder)),
        "int4",
        torch.device("cpu"),
        torch.float32,
        TorchAttention,
    )
    weights = GGUFWeights(Path(q4_k_m))
    o_proj = model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, Int4Linear) and o_proj.bits == 4
    torch.testing.assert_close(
        o_proj.dequantize(),
        weights.get("model.layers.0.self_attn.o_proj.weight"),
        rtol=1e-6,
        atol=1e-7,
    )
    gate_up = model.layers[0].mlp.gate_up_proj
    file_gate_up = torch.cat(
        [weights.get(f"model.layers.0.mlp.{p}_proj.weight") for p in ("gate", "up")]
    )
    assert isinstance(gate_up, Int4Linear) and gate_up.bits == 5
    torch.testing.assert_close(gate_up.dequantize(), file_gate_up, rtol=1e-6, atol=1e-7)
    qkv = model.layers[1].self_attn.qkv_proj  # q, k Q4_K; v Q6_K
    assert isinstance(qkv, RowParts) and [type(p) for p in qkv.parts] == [Int4Linear, Int8Linear]
    file_qk = torch.cat(
        [weights.get(f"model.layers.1.self_attn.{p}_proj.weight") for p in ("q", "k")]
    )
    torch.testing.assert_close(qkv.parts[0].dequantize(), file_qk, rtol=1e-6, atol=1e-7)
    assert isinstance(model.layers[1].mlp.down_proj, Int8Linear)  # Q6_K
    x = torch.randn(3, HIDDEN)
    assert torch.equal(qkv(x), torch.cat([qkv.parts[0](x), qkv.parts[1](x)], -1))


def _integer_kernel() -> bool:
    return base.int8_act_kernel(torch.device("cpu"), torch.float32, VOCAB, HIDDEN) is not None


@pytest.mark.skipif(
    not _integer_kernel(), reason="no integer kernel here: Q6_K / Q8_0 are int8 per channel there"
)
@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("v_kind", [Q.Q6_K, Q.Q8_0])
def test_q6_k_and_q8_0_tensors_are_served_as_stored(tmp_path, weights, v_kind) -> None:
    """On the integer kernel Q6_K and Q8_0 tensors are served from their own blocks in int4 of a
    Q4_K_M file and in int8 alike: down_proj (Q6_K) whole, v_proj as the Q6_K or Q8_0 part of
    qkv beside the int4 (or int8) q and k, the Q8_0 vocabulary as the LM head and embedding;
    each dequantises to the file's weights bit for bit. Greedy tokens batched equal each prompt
    alone."""
    path = str(write_quantised_gguf(tmp_path / "m.gguf", {**Q4_K_M, "attn_v": v_kind}))
    folder = resolve_model(path)
    model = build_model(
        GGUFWeights(Path(path)),
        ModelConfig.from_hf(load_config(folder)),
        weights,
        torch.device("cpu"),
        torch.float32,
        TorchAttention,
    )
    stored = GGUFWeights(Path(path))
    v_layer = Q6KLinear if v_kind == Q.Q6_K else Int8Linear
    for i in range(LAYERS):
        down = model.layers[i].mlp.down_proj
        assert isinstance(down, Q6KLinear)
        assert torch.equal(down.dequantize(), stored.get(f"model.layers.{i}.mlp.down_proj.weight"))
        qkv = model.layers[i].self_attn.qkv_proj
        qk = Int4Linear if weights == "int4" else Int8Linear
        assert isinstance(qkv, RowParts) and [type(p) for p in qkv.parts] == [qk, v_layer]
        assert torch.equal(
            qkv.parts[1].dequantize(), stored.get(f"model.layers.{i}.self_attn.v_proj.weight")
        )
        x = torch.randn(
            9, HIDDEN
        )  # one call over the parts gives their outputs joined, at one and several reads
        for rows in (x[:1], x, x.bfloat16()):
            assert qkv.int8_act and torch.equal(
                qkv(rows), torch.cat([p(rows) for p in qkv.parts], -1)
            )
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.blocked
    assert torch.equal(model.lm_head.dequantize(), stored.get("model.embed_tokens.weight"))
    llm = LLM(path, dtype="float32", quantization=weights, kv_cache_memory=1 << 22)
    batched = token_ids(llm.generate(_prompts(), GREEDY))
    assert batched == [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in _prompts()]


@pytest.mark.skipif(
    not _integer_kernel(),
    reason="no integer kernel here: the vocabulary is int8 on the other paths",
)
@pytest.mark.parametrize("kind,bits", [(Q.Q4_K, 4), (Q.Q5_0, 5), (Q.Q6_K, 6)])
def test_a_vocabulary_stored_in_4_to_6_bits_keeps_its_codes(tmp_path, kind, bits) -> None:
    """A file whose (tied) vocabulary is in 4- or 5-bit blocks (int4) or Q6_K (int4 and int8)
    serves the LM head and the embedding from those blocks on the integer kernel, not from an
    int8 copy (more bytes, requantised): the head dequantises to the file's table, and embedding
    rows are the head's rows exactly."""
    path = write_quantised_gguf(tmp_path / "m.gguf", {**Q4_K_M, "token_embd": kind})
    folder = resolve_model(str(path))
    model = build_model(
        GGUFWeights(path),
        ModelConfig.from_hf(load_config(folder)),
        "int4",
        torch.device("cpu"),
        torch.float32,
        TorchAttention,
    )
    if bits == 6:
        assert isinstance(model.lm_head, Q6KLinear)
    else:
        assert isinstance(model.lm_head, Int4Linear) and model.lm_head.bits == bits
    table = model.lm_head.dequantize()
    # the int4 tiles hold d and m in fp16: a Q4_K block's d * scale and dmin * min round to it
    # (Q5_0's d is fp16 already; Q6_K keeps its own d and sc)
    stored = GGUFWeights(path).get("model.embed_tokens.weight")
    tol = 2**-11 * float(stored.abs().max()) if kind == Q.Q4_K else 0
    torch.testing.assert_close(table, stored, rtol=0, atol=tol)
    ids = torch.tensor([[0, 17, VOCAB - 1], [5, 5, 160]])
    torch.testing.assert_close(model.embed_tokens(ids), table[ids], rtol=0, atol=0)
    int8 = build_model(
        GGUFWeights(path),
        ModelConfig.from_hf(load_config(folder)),
        "int8",
        torch.device("cpu"),
        torch.float32,
        TorchAttention,
    )
    # the int8 variant: int8 but for Q6_K, which it serves as stored
    assert isinstance(int8.lm_head, Q6KLinear if bits == 6 else Int8Linear)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22)  # auto: int4, this head
    batched = token_ids(llm.generate(_prompts(), GREEDY))
    assert batched == [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in _prompts()]


def test_int4_of_a_file_stored_wider_is_4_bits_throughout(tmp_path) -> None:
    """`--quantization int4` of a Q8_0 file (mostly) asks for the smaller model: every layer
    requantised to 4 bits, the odd Q5_0 layer held as its 5-bit codes."""
    path = write_quantised_gguf(tmp_path / "q8.gguf", {"ffn_up": Q.Q5_0}, Q.Q8_0)
    folder = resolve_model(str(path))
    model = build_model(
        GGUFWeights(path),
        ModelConfig.from_hf(load_config(folder)),
        "int4",
        torch.device("cpu"),
        torch.float32,
        TorchAttention,
    )
    layers = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert all(isinstance(m, Int4Linear) for m in layers if m is not model.lm_head)
    assert {m.bits for m in layers if isinstance(m, Int4Linear)} == {4, 5}
    assert (
        model.layers[0].mlp.gate_up_proj.bits == 5 and model.layers[0].self_attn.qkv_proj.bits == 4
    )


def test_fp32_serving_equals_transformers_on_the_dequantised_file(q4_k_m) -> None:
    prompts = _prompts()
    llm = LLM(q4_k_m, dtype="float32", quantization="fp32", kv_cache_memory=1 << 22)
    outs = llm.generate(prompts, GREEDY)
    assert token_ids(outs) == hf_greedy(q4_k_m, prompts, 8)


def test_a_precision_the_file_cannot_give_is_refused_in_words(tmp_path) -> None:
    path = write_quantised_gguf(
        tmp_path / "odd.gguf", {"ffn_down": Q.Q8_1, "token_embd": Q.Q8_0}, Q.Q4_0
    )
    with pytest.raises(
        ValueError,
        match=r"precision int4 cannot be built here: .*odd.gguf: tensor "
        r"'blk.0.ffn_down.weight': GGUF type Q8_1 cannot be decoded",
    ):
        LLM(str(path), dtype="float32", quantization="int4", kv_cache_memory=1 << 22)


def test_rows_of_a_permuted_q_are_the_tensors_rows(q4_k_m) -> None:
    """A layer is requantised by row slices: a q/k slice is un-permuted in whole heads, any
    bounds."""
    weights = GGUFWeights(Path(q4_k_m))
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        whole = weights.get(name)
        for start, stop in ((0, 512), (10, 100), (64, 128), (100, 1000)):
            assert torch.equal(weights.rows(name, start, stop), whole[start:stop]), (
                name,
                start,
                stop,
            )
