"""PEFT LoRA adapters read and checked against the base: the fused q/k/v and gate/up layout, the
scaling (rsLoRA too), and each refusal in words with nothing kept."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from lora_fixture import ATTENTION, make_adapter
from safetensors.torch import load_file

from tandem.config import EngineConfig, LoRAConfig
from tandem.core.sampling_params import LoRARequest
from tandem.models.config import ModelConfig
from tandem.models.loader.model_files import load_config
from tandem.models.lora.loader import load_adapter
from tandem.models.lora.manager import LoRAManager


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = tiny_model_dirs["qwen2"]
    return {
        "all": make_adapter(base, root / "all", 1),
        "attn16": make_adapter(base, root / "attn16", 2, r=16, targets=ATTENTION, rslora=True),
        "gemma": make_adapter(tiny_model_dirs["gemma3"], root / "gemma", 3),
    }


def _cfg(path: str) -> ModelConfig:
    return ModelConfig.from_hf(load_config(path))


def test_fused_layout_and_scaling(tiny_model_dirs, adapters):
    cfg = _cfg(tiny_model_dirs["qwen2"])
    raw = load_file(f"{adapters['attn16']}/adapter_model.safetensors")
    adapter = load_adapter(adapters["attn16"], cfg, max_rank=16)
    assert adapter.rank == 16
    assert set(adapter.modules) == {
        f"layers.{i}.self_attn.{m}" for i in range(cfg.num_layers) for m in ("qkv_proj", "o_proj")
    }
    qkv = adapter.modules["layers.1.self_attn.qkv_proj"]
    prefix = "base_model.model.model.layers.1.self_attn"
    scale = 32 / math.sqrt(16)  # rsLoRA: alpha / sqrt(r)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert qkv.rows == (0, q, q + kv)  # each part's B on its own output slice, no zeros stored
    for part, name in enumerate("qkv"):
        a, b = (
            raw[f"{prefix}.{name}_proj.lora_A.weight"],
            raw[f"{prefix}.{name}_proj.lora_B.weight"],
        )
        assert torch.equal(qkv.a[16 * part : 16 * part + 16], a)
        assert torch.allclose(qkv.b[part], b * scale)
    h = cfg.hidden_size
    per_layer = sum(16 * (f * len(w) + sum(w)) for f, w in [(h, [q, kv, kv]), (q, [h])])
    assert adapter.nbytes == 4 * per_layer * cfg.num_layers


def test_refusals_in_words(tiny_model_dirs, adapters, tmp_path):
    qwen, gemma = _cfg(tiny_model_dirs["qwen2"]), _cfg(tiny_model_dirs["gemma3"])
    with pytest.raises(ValueError, match="rank 16, over max_lora_rank 8"):
        load_adapter(adapters["attn16"], qwen, max_rank=8)
    with pytest.raises(ValueError, match="another base model"):
        load_adapter(adapters["gemma"], qwen, max_rank=16)
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        load_adapter(tmp_path, qwen, max_rank=16)
    broken = tmp_path / "broken"
    shutil.copytree(adapters["all"], broken)
    (broken / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no adapter_model.safetensors"):
        load_adapter(broken, qwen, max_rank=16)
    head = tmp_path / "head"
    shutil.copytree(adapters["all"], head)
    config = json.loads((head / "adapter_config.json").read_text())
    (head / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["lm_head"]}))
    with pytest.raises(ValueError, match="targets lm_head"):
        load_adapter(head, qwen, max_rank=16)
    assert load_adapter(adapters["gemma"], gemma, max_rank=16).rank == 8


def _model(path: str, dtype: torch.dtype = torch.float32):
    from tandem.executor.attention import TorchAttention
    from tandem.models.loader.builder import build_model
    from tandem.models.loader.model_files import weight_source

    return build_model(
        weight_source(path, None), _cfg(path), "float", torch.device("cpu"), dtype, TorchAttention
    )


def test_manager_keeps_nothing_of_a_refused_adapter(tiny_model_dirs, adapters):
    path = tiny_model_dirs["qwen2"]
    cfg = _cfg(path)
    model = _model(path)
    manager = LoRAManager(LoRAConfig(enable_lora=True, max_lora_rank=8), cfg, {"fp32": model})
    with pytest.raises(ValueError, match="over max_lora_rank"):
        manager.add(LoRARequest("big", 1, adapters["attn16"]))
    assert not manager.cpu and not manager.loads
    manager.add(LoRARequest("ok", 2, adapters["all"]))
    assert list(manager.cpu) == [2] and manager.loads["ok"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_resident_adapter_is_held_once_on_a_cpu(tiny_model_dirs, adapters, dtype):
    """The host copy is in the activation dtype and the slot views it: the bytes held are one
    copy's, B per output slice."""
    path = tiny_model_dirs["qwen2"]
    cfg = _cfg(path)
    manager = LoRAManager(LoRAConfig(enable_lora=True), cfg, {"float": _model(path, dtype)})
    lora = LoRARequest("all", 1, adapters["all"])
    assert manager.set_step("float", [lora, None], np.array([3, 2]))
    adapter = manager.cpu[1]
    q, kv, h, inter = 64, 32, cfg.hidden_size, cfg.intermediate_size  # 4 heads, 2 KV heads of 16
    per_rank = (h * 3 + q + 2 * kv) + (q + h) + (h * 2 + 2 * inter) + (inter + h)
    size = torch.finfo(dtype).bits // 8
    assert adapter.nbytes == per_rank * 8 * cfg.num_layers * size
    assert manager.held_bytes() == {"cpu": adapter.nbytes}


def test_config_options():
    config = EngineConfig.from_kwargs(
        enable_lora=True, max_loras=2, max_cpu_loras=3, lora_modules=["a=/x", "b=/y"]
    )
    assert config.lora_config.modules() == {"a": "/x", "b": "/y"}
    assert LoRAConfig(lora_modules=["a=/x"]).enabled and not LoRAConfig().enabled
    with pytest.raises(ValueError, match="name=path"):
        LoRAConfig(enable_lora=True, lora_modules=["nopath"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
