"""The integer kernel's `experts` call (every routed expert of an MoE block in one native call)
equals the per-expert loop bit for bit, fp32 and bf16, from 1 row to past a tile's rows, for the
expert types a Q4_K_M file and others hold."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_moe_gguf import HIDDEN, write_quantised_moe_gguf

from tandem.executor.attention import TorchAttention
from tandem.models.config import ModelConfig
from tandem.models.gguf.weights import GGUFWeights
from tandem.models.layers.fused_moe import select_experts
from tandem.models.loader.builder import build_model
from tandem.models.loader.model_files import load_config, resolve_model
from tandem.models.quantization import base


def _integer_kernel() -> bool:
    return base.int8_act_kernel(torch.device("cpu"), torch.float32, HIDDEN, HIDDEN) is not None


@pytest.mark.skipif(not _integer_kernel(), reason="the experts call is the integer kernel's")
@pytest.mark.parametrize("gate_up, down", [(Q.Q4_K, Q.Q6_K), (Q.Q5_0, Q.Q8_0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_experts_equal_the_loop(tmp_path, gate_up, down, dtype) -> None:
    path = write_quantised_moe_gguf(tmp_path / "moe.gguf", gate_up, down)
    cfg = ModelConfig.from_hf(load_config(resolve_model(str(path))))
    model = build_model(GGUFWeights(path), cfg, "int4", torch.device("cpu"), dtype, TorchAttention)
    torch.manual_seed(0)
    for layer in model.layers:
        block = layer.mlp
        assert block.native_experts()
        for rows in (1, 3, 16, 37):
            x = torch.randn(rows, HIDDEN).to(dtype)
            weights, ids = select_experts(block.gate(x), block.top_k, block.renormalize)
            weights = weights.to(dtype)
            with torch.inference_mode():
                native = block.run_experts(x, weights, ids)
                loop = block.loop_experts(x, weights, ids)
            assert torch.equal(native, loop)
