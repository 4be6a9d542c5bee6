"""`tandem bench quality`'s check on MoE GGUF files: a quantised file served from its own blocks
(int4, experts on the integer kernel with int8 activations) has a perplexity within 1% of its
dequantised fp32 run, for each type of expert tensor served."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_moe_gguf import VOCAB, write_quantised_moe_gguf

from tandem import LLM
from tandem.bench.perplexity import perplexity
from tandem.models.quantization import base


def _integer_kernel() -> bool:
    return base.int8_act_kernel(torch.device("cpu"), torch.float32, 256, 256) is not None


@pytest.mark.skipif(not _integer_kernel(), reason="the file's blocks are served on the kernel")
@pytest.mark.parametrize(
    "gate_up, down", [(Q.Q4_K, Q.Q6_K), (Q.Q5_0, Q.Q8_0), (Q.Q4_0, Q.Q6_K), (Q.Q8_0, Q.Q4_K)]
)
def test_served_file_is_within_1_percent_of_its_dequantised_floats(tmp_path, gate_up, down):
    path = write_quantised_moe_gguf(tmp_path / "moe.gguf", gate_up, down)
    llm = LLM(
        str(path),
        dtype="float32",
        quantization="fp32",
        precision_classes={"interactive": "int4"},
        kv_cache_memory=1 << 22,
        enable_prefix_caching=False,
    )
    runner = llm.engine.core.executor
    tokens = [(37 * i + 11) % (VOCAB - 3) + 3 for i in range(200)]
    fp32, int4 = (perplexity(runner, p, tokens, window=64) for p in ("fp32", "int4"))
    assert abs(int4 / fp32 - 1) < 0.01, (fp32, int4)
