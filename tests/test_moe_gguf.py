"""Mixture-of-experts GGUF files (qwen3moe, qwen2moe, and llama with experts: Mixtral): each
expert of a 3-D expert tensor reads as a 2-D tensor of its own, decoded bit for bit as the `gguf`
package decodes the whole tensor; a tiny Hugging Face MoE folder written to GGUF reads back as the
folder's weights and serves its tokens; quantised experts are served from the file's own blocks."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import MOE_KINDS, hf_greedy, token_ids
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from safetensors.torch import load_file
from test_gguf_serving import _blocks, _prompts

from tandem import LLM, SamplingParams
from tandem.executor.attention import TorchAttention
from tandem.models.config import ModelConfig
from tandem.models.gguf.weights import GGUFWeights
from tandem.models.layers.linear import Linear
from tandem.models.loader.builder import build_model
from tandem.models.loader.model_files import iter_weights, load_config, resolve_model
from tandem.models.quantization import base
from tandem.models.quantization.int4 import Int4Linear
from tandem.models.quantization.q6k import Q6KLinear

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight"
)
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_PROJ |= {"w1": "gate", "w3": "up", "w2": "down"}  # Mixtral's


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (rotate-half -> interleaved rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_moe_gguf(folder: str, path: Path) -> Path:
    """A tiny Hugging Face MoE folder as llama.cpp's converter writes it, in F32: each layer's
    experts stacked into 3-D tensors, q / k permuted under arch llama (Mixtral)."""
    hf = load_config(Path(folder))
    kind, arch = hf["model_type"], _ARCH[hf["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    if kind == "qwen3_moe":
        writer.add_key_length(hf["head_dim"])
        writer.add_value_length(hf["head_dim"])
    writer.add_rope_freq_base(hf["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_expert_count(hf.get("num_experts") or hf["num_local_experts"])
    writer.add_expert_used_count(hf["num_experts_per_tok"])
    if kind != "mixtral":
        writer.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    if kind == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    experts: dict[str, dict[int, np.ndarray]] = {}
    globals_ = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "lm_head": "output",
    }
    for name, tensor in sorted(load_file(Path(folder) / "model.safetensors").items()):
        w = tensor.numpy()
        if (m := _EXPERT.fullmatch(name)) is not None:
            experts.setdefault(f"blk.{m[1]}.ffn_{_PROJ[m[3]]}_exps.weight", {})[int(m[2])] = w
            continue
        module, leaf = name.rsplit(".", 1)
        if module in globals_:
            writer.add_tensor(f"{globals_[module]}.{leaf}", w)
            continue
        layer, part = module.removeprefix("model.layers.").split(".", 1)
        if kind == "mixtral" and part == "self_attn.q_proj":
            w = _permute(w, hf["num_attention_heads"])
        elif kind == "mixtral" and part == "self_attn.k_proj":
            w = _permute(w, hf["num_key_value_heads"])
        writer.add_tensor(f"blk.{layer}.{_TO_GGUF[part]}.{leaf}", np.ascontiguousarray(w))
    for name, by_expert in experts.items():
        writer.add_tensor(name, np.stack([by_expert[e] for e in sorted(by_expert)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def moe_ggufs(moe_dirs, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("moe-gguf")
    return {k: str(write_moe_gguf(d, out / f"tiny-{k}.gguf")) for k, d in moe_dirs.items()}


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_gguf_reads_back_the_folders_weights_and_tokens(kind, moe_dirs, moe_ggufs) -> None:
    folder, path = moe_dirs[kind], moe_ggufs[kind]
    assert ModelConfig.from_hf(load_config(resolve_model(path))) == ModelConfig.from_hf(
        load_config(Path(folder))
    )
    expected = load_file(Path(folder) / "model.safetensors")
    got = dict(iter_weights(Path(path)))
    assert set(got) == set(expected)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    prompts = _prompts()
    ref = hf_greedy(folder, prompts, 8)
    assert hf_greedy(path, prompts, 8) == ref  # transformers' model of the file: the folder's
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22)
    assert token_ids(llm.generate(prompts, GREEDY)) == ref


# byte offsets of a block's fp16 d (and dmin)
_SCALE_AT = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}


@pytest.mark.parametrize(
    "kind", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16]
)
def test_each_expert_decodes_as_the_gguf_package_decodes_the_3d_tensor(tmp_path, kind) -> None:
    experts, rows, cols = 3, 4, 256
    rng = np.random.default_rng(0)
    if kind == Q.F16:
        raw = rng.standard_normal((experts, rows, cols)).astype(np.float16)
    else:  # random blocks, their fp16 scales finite
        size, nbytes = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (experts * rows * cols // size, nbytes), dtype=np.uint8)
        for at in _SCALE_AT[kind]:
            d = rng.uniform(1e-4, 1e-2, len(raw)).astype(np.float16)
            raw[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
        raw = raw.reshape(experts, rows, -1)
    path = tmp_path / "experts.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_tensor("blk.0.ffn_up_exps.weight", raw, raw_dtype=None if kind == Q.F16 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    weights = GGUFWeights(path)
    reference = dequantize(raw.view(np.uint8) if kind != Q.F16 else raw, kind)
    for e in range(experts):
        name = f"model.layers.0.mlp.experts.{e}.up_proj.weight"
        assert weights.shape(name) == (rows, cols)
        got = weights.get(name).numpy()
        assert np.array_equal(got.view(np.uint32), reference[e].astype(np.float32).view(np.uint32))
        assert np.array_equal(weights.rows(name, 1, 3).numpy(), got[1:3])


HIDDEN, EXPERT, EXPERTS, VOCAB = 256, 256, 4, 320


def write_quantised_moe_gguf(path: Path, gate_up: Q, down: Q) -> Path:
    """A two-layer Qwen3-MoE file of random blocks as a Q4_K_M's: the experts' gate / up of type
    `gate_up` and their down of `down`, attention Q4_K (v Q6_K), a Q8_0 vocabulary, F32 router
    and norms."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    for add, value in (
        (writer.add_block_count, 2),
        (writer.add_context_length, 256),
        (writer.add_embedding_length, HIDDEN),
        (writer.add_feed_forward_length, 512),
        (writer.add_head_count, 4),
        (writer.add_head_count_kv, 2),
        (writer.add_key_length, 64),
        (writer.add_value_length, 64),
        (writer.add_rope_freq_base, 10000.0),
        (writer.add_layer_norm_rms_eps, 1e-6),
        (writer.add_expert_count, EXPERTS),
        (writer.add_expert_used_count, 2),
        (writer.add_expert_feed_forward_length, EXPERT),
    ):
        add(value)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    writer.add_tensor("token_embd.weight", _blocks(Q.Q8_0, VOCAB, HIDDEN, rng), raw_dtype=Q.Q8_0)
    writer.add_tensor("output_norm.weight", norm(HIDDEN))
    for i in range(2):
        blk = f"blk.{i}"
        for part, kind, (rows, cols) in (
            ("attn_q", Q.Q4_K, (256, HIDDEN)),
            ("attn_k", Q.Q4_K, (128, HIDDEN)),
            ("attn_v", Q.Q6_K, (128, HIDDEN)),
            ("attn_output", Q.Q4_K, (HIDDEN, 256)),
        ):
            writer.add_tensor(
                f"{blk}.{part}.weight", _blocks(kind, rows, cols, rng), raw_dtype=kind
            )
        for part, n in (("attn_norm", HIDDEN), ("ffn_norm", HIDDEN), ("attn_q_norm", 64)):
            writer.add_tensor(f"{blk}.{part}.weight", norm(n))
        writer.add_tensor(f"{blk}.attn_k_norm.weight", norm(64))
        router = (0.5 * rng.standard_normal((EXPERTS, HIDDEN))).astype(np.float32)
        writer.add_tensor(f"{blk}.ffn_gate_inp.weight", router)
        for part, kind, (rows, cols) in (
            ("ffn_gate_exps", gate_up, (EXPERT, HIDDEN)),
            ("ffn_up_exps", gate_up, (EXPERT, HIDDEN)),
            ("ffn_down_exps", down, (HIDDEN, EXPERT)),
        ):
            blocks = _blocks(kind, EXPERTS * rows, cols, rng).reshape(EXPERTS, rows, -1)
            writer.add_tensor(f"{blk}.{part}.weight", blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _integer_kernel() -> bool:
    return base.int8_act_kernel(torch.device("cpu"), torch.float32, HIDDEN, EXPERT) is not None


@pytest.mark.skipif(not _integer_kernel(), reason="Q6_K is served as stored on the integer kernel")
def test_quantised_experts_are_served_from_the_files_blocks(tmp_path) -> None:
    """int4 of a Q4_K_M-like file: every expert's gate / up holds the file's Q4_K codes, its
    down the file's Q6_K blocks (bit for bit), the router stays F32; fp32 serving equals
    transformers on the dequantised file, and int4 batched equals each prompt alone."""
    path = write_quantised_moe_gguf(tmp_path / "moe-Q4_K_M.gguf", Q.Q4_K, Q.Q6_K)
    folder = resolve_model(str(path))
    model = build_model(
        GGUFWeights(path),
        ModelConfig.from_hf(load_config(folder)),
        "int4",
        torch.device("cpu"),
        torch.float32,
        TorchAttention,
    )
    assert model.decode_plan is not None  # decode steps: native calls, the MoE blocks' forwards
    stored = GGUFWeights(path)
    for i in range(2):
        block = model.layers[i].mlp
        assert type(block.gate) is Linear  # the router as stored: F32
        assert torch.equal(block.gate.weight, stored.get(f"model.layers.{i}.mlp.gate.weight"))
        for e, expert in enumerate(block.experts):
            prefix = f"model.layers.{i}.mlp.experts.{e}"
            assert isinstance(expert.gate_up_proj, Int4Linear) and expert.gate_up_proj.bits == 4
            assert isinstance(expert.down_proj, Q6KLinear)
            assert torch.equal(
                expert.down_proj.dequantize(), stored.get(f"{prefix}.down_proj.weight")
            )
    prompts = _prompts()
    llm = LLM(str(path), dtype="float32", quantization="fp32", kv_cache_memory=1 << 22)
    assert token_ids(llm.generate(prompts, GREEDY)) == hf_greedy(str(path), prompts, 8)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22)  # auto: int4, as stored
    assert llm.engine.core.executor.variants.default == "int4"
    batched = token_ids(llm.generate(prompts, GREEDY))
    assert batched == [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]


@pytest.mark.parametrize("gate_up, down", [(Q.Q8_0, Q.Q8_0), (Q.Q5_0, Q.Q6_K)])
def test_int8_and_int4_of_other_expert_types_serve(tmp_path, gate_up, down) -> None:
    path = write_quantised_moe_gguf(tmp_path / "moe.gguf", gate_up, down)
    for quantization in ("int8", "int4"):
        llm = LLM(str(path), dtype="float32", quantization=quantization, kv_cache_memory=1 << 22)
        prompts = _prompts()
        batched = token_ids(llm.generate(prompts, GREEDY))
        assert batched == [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
