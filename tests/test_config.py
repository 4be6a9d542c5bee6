"""The YAML config with the mission's `serving:` shape maps onto engine and server options."""

from __future__ import annotations

import logging

import pytest

from tandem.config import EngineConfig, load_yaml

MISSION_YAML = """
serving:
  cache:
    enabled: true
    max_prefix_tokens: 4096
    min_match_length: 64
  scheduler:
    policy: multilevel
    l2_min_share: 0.25
    preemption_mode: swap
  engine:
    block_size: 32
  server:
    api_key: sesame
    max_waiting: 64
  quantization:
    default: int8
    fallback: fp16
"""


def test_mission_shape_maps_to_options(tmp_path, caplog):
    path = tmp_path / "serving.yaml"
    path.write_text(MISSION_YAML)
    with caplog.at_level(logging.WARNING):
        engine = EngineConfig.from_kwargs(**load_yaml(path))
    cache, sched, quant = engine.cache_config, engine.scheduler_config, engine.quant_config
    prefix = (cache.enable_prefix_caching, cache.max_prefix_tokens, cache.min_match_length)
    assert prefix == (True, 4096, 64)
    policy = (sched.scheduling_policy, sched.l2_min_share, sched.preemption_mode)
    assert policy == ("multilevel", 0.25, "swap")
    assert cache.block_size == 32
    assert load_yaml(path, section="server") == {"api_key": "sesame", "max_waiting": 64}
    assert (quant.quantization, quant.precision_fallback) == ("int8", "fp16")
    assert "not supported" not in caplog.text


def test_bad_config_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("serving:\n  engine:\n    block_sise: 16\n")
    with pytest.raises(ValueError, match="block_sise"):
        EngineConfig.from_kwargs(**load_yaml(bad))
    broken = tmp_path / "broken.yaml"
    broken.write_text("serving: [unclosed\n")
    with pytest.raises(ValueError, match="cannot read config"):
        load_yaml(broken)
    with pytest.raises(ValueError, match="cannot read config"):
        load_yaml(tmp_path / "missing.yaml")


def test_attention_backend_is_honoured_or_refused(monkeypatch):
    import torch

    from tandem.executor.attention import resolve_attention_backend

    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, triton"):
        EngineConfig.from_kwargs(attention_backend="flash")
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu) == "torch"  # the CPU keeps its native kernel
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        ValueError, match="triton"
    ):  # not installed, or on CPU outside the interpreter
        resolve_attention_backend("triton", cpu)


@pytest.mark.parametrize(
    "section, error",
    [
        ("quantization: {default: int3}", "unknown precision 'int3'"),
        (
            "quantization: {default: int8, classes: {interactive: fp8}}",
            "class 'interactive': unknown precision 'fp8'",
        ),
        (
            "quantization: {default: int8, classes: {urgent: bf16}}",
            "'urgent' is not a request class",
        ),
        ("quantization: {default: int8, fallbak: bf16}", "unknown serving.quantization key"),
    ],
)
def test_bad_quantization_config_is_a_clear_error(tmp_path, section, error):
    path = tmp_path / "q.yaml"
    path.write_text(f"serving:\n  {section}\n")
    with pytest.raises(ValueError, match=error):
        EngineConfig.from_kwargs(**load_yaml(path))


def test_quantization_classes_name_the_variants(tmp_path):
    path = tmp_path / "q.yaml"
    path.write_text(
        "serving:\n  quantization:\n    default: int8\n    fallback: bf16\n"
        "    classes: {interactive: bf16, standard: int8, background: int4}\n"
    )
    engine = EngineConfig.from_kwargs(**load_yaml(path))
    quant = engine.quant_config
    assert quant.precision_classes == {
        "interactive": "bf16",
        "standard": "int8",
        "background": "int4",
    }
    assert quant.precisions("bf16") == ["int8", "bf16", "int4"]


def test_the_shipped_example_is_a_valid_serving_config(caplog):
    """examples/serving.yaml, which the README points to, loads with every key read."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "serving.yaml"
    with caplog.at_level(logging.WARNING):
        engine = EngineConfig.from_kwargs(**load_yaml(path))
    assert "not supported" not in caplog.text
    cache = engine.cache_config
    assert (cache.kv_cache_memory, cache.swap_space) == (1 << 30, 512 << 20)
    assert (
        engine.quant_config.quantization,
        engine.quant_config.precision_fallback,
        engine.scheduler_config.scheduling_policy,
    ) == ("int8", "bf16", "multilevel")
    assert (
        engine.speculative_config.model == "self:int4"
        and engine.speculative_config.num_speculative_tokens == 4
    )
    assert load_yaml(path, section="server") == {"max_waiting": 256}


def test_an_unknown_cache_key_is_refused_and_the_kv_dtype_goes_in_engine(tmp_path):
    path = tmp_path / "serving.yaml"
    path.write_text("serving:\n  cache: {enabled: true, kv_cache_dtype: bfloat16}\n")
    with pytest.raises(
        ValueError, match="unknown serving.cache key.*kv_cache_dtype.*go in serving.engine"
    ):
        load_yaml(path)
    path.write_text("serving:\n  engine: {kv_cache_dtype: bfloat16}\n")
    assert EngineConfig.from_kwargs(**load_yaml(path)).cache_config.kv_cache_dtype == "bfloat16"
