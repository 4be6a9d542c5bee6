"""GGUF LoRA files as llama.cpp's convert_lora_to_gguf.py writes them (lora_fixture.py): over a
tiny Llama GGUF base (its q/k rows permuted, the adapter's q/k B rows too), fp32 greedy tokens
equal transformers + peft's on the same weights, alone and mixed with a PEFT folder adapter and
the base; F16 / BF16 / Q8_0 files read to the adapter's weights within their precision; another
architecture's file, a model file and expert tensors are refused in words."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import TINY
from gguf_fixture import write_gguf
from lora_fixture import ATTENTION, make_adapter, peft_greedy, write_gguf_lora

from tandem import LLM, LoRARequest, SamplingParams
from tandem.models.config import ModelConfig
from tandem.models.loader.model_files import load_config
from tandem.models.lora.loader import load_adapter

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [300, 12, 99, 7, 250, 1, 3], [77] * 20, [2, 3]]
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A tiny Llama as a Hugging Face folder and as a GGUF file, two PEFT adapters of it, the
    first also as an F32 GGUF LoRA, and the references; the GGUF's cache folder kept apart."""
    import transformers as tf

    root = tmp_path_factory.mktemp("lora-gguf")
    torch.manual_seed(0)
    config = tf.LlamaConfig(**TINY, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "hf")
    write_gguf(model, root / "base.gguf", "llama")
    hf = str(root / "hf")
    peft_all = make_adapter(hf, root / "all", 1, r=8)
    peft_attn = make_adapter(hf, root / "attn", 2, r=16, targets=ATTENTION)
    heads = (config.num_attention_heads, config.num_key_value_heads)
    lora = write_gguf_lora(peft_all, root / "all.gguf", "llama", heads)
    refs = [peft_greedy(hf, a, PROMPTS, MAX_NEW) for a in (peft_all, peft_attn, None)]
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TANDEM_CACHE_DIR", str(root / "cache"))
        yield root, heads, [lora, peft_attn, None], refs


def test_gguf_lora_over_a_gguf_base_matches_peft(case):
    root, _, adapters, refs = case
    llm = LLM(str(root / "base.gguf"), dtype="float32", kv_cache_memory=1 << 22, enable_lora=True)
    loras = [None if a is None else LoRARequest(f"l{i}", i + 1, a) for i, a in enumerate(adapters)]
    outs = llm.generate(PROMPTS, GREEDY, lora_request=loras[0])
    assert [o.outputs[0].token_ids for o in outs] == refs[0]
    assert refs[0] != refs[2]  # the adapter changes the output
    pick = [i % 3 for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, GREEDY, lora_request=[loras[k] for k in pick])
    assert [o.outputs[0].token_ids for o in outs] == [refs[k][i] for i, k in enumerate(pick)]


@pytest.mark.parametrize("qtype, tol", [(Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 1e-2)])
def test_gguf_lora_types_read_within_precision(case, qtype, tol):
    root, heads, adapters, _ = case
    cfg = ModelConfig.from_hf(load_config(str(root / "hf")))
    folder = load_adapter(root / "all", cfg, max_rank=8)
    assert load_adapter(adapters[0], cfg, max_rank=8).modules.keys() == folder.modules.keys()
    for name, w in load_adapter(adapters[0], cfg, max_rank=8).modules.items():  # F32: exact
        assert torch.equal(w.a, folder.modules[name].a) and w.rows == folder.modules[name].rows
        assert all(torch.equal(b, f) for b, f in zip(w.b, folder.modules[name].b))
    out = root / f"all-{qtype.name}.gguf"
    path = write_gguf_lora(str(root / "all"), out, "llama", heads, qtype)
    for name, w in load_adapter(path, cfg, max_rank=8).modules.items():
        want = folder.modules[name]
        for got, ref in zip(w.tensors(), want.tensors()):
            torch.testing.assert_close(got, ref, rtol=0, atol=tol * ref.abs().max().item())


def test_gguf_lora_refusals_in_words(case, tmp_path):
    root, heads, adapters, _ = case
    cfg = ModelConfig.from_hf(load_config(str(root / "hf")))
    with pytest.raises(ValueError, match="rank 8, over max_lora_rank 4"):
        load_adapter(adapters[0], cfg, max_rank=4)
    qwen = write_gguf_lora(str(root / "all"), tmp_path / "qwen.gguf", "qwen2")
    with pytest.raises(ValueError, match="is for a qwen2 model, not llama"):
        load_adapter(qwen, cfg, max_rank=8)
    with pytest.raises(ValueError, match="is not a GGUF LoRA adapter"):
        load_adapter(root / "base.gguf", cfg, max_rank=8)
    with pytest.raises(ValueError, match="is not a file"):
        load_adapter(tmp_path / "missing.gguf", cfg, max_rank=8)
    writer = gguf.GGUFWriter(str(tmp_path / "experts.gguf"), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_tensor("blk.0.ffn_gate_exps.weight.lora_a", np.zeros((4, 8, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="mixture-of-experts block"):
        load_adapter(tmp_path / "experts.gguf", cfg, max_rank=8)
