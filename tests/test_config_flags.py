"""One source for every option: the flags, the `LLM(**kwargs)` keys and the YAML keys are derived
from the config fields, so each default is its field's, and every option of `tandem serve`
reaches the engine's or the server's config (none accepted and dropped)."""

from __future__ import annotations

import argparse
import inspect
import json

import pytest
import yaml

from tandem.cli import build_parser
from tandem.config import EngineConfig, load_yaml
from tandem.config.engine import OPTIONS
from tandem.config.serving_yaml import YAML_KEYS
from tandem.server import launch
from tandem.server.state import ServerConfig

PARSER = build_parser()

# A valid value other than the default, for every engine option.
ENGINE_SAMPLES = {
    "model": "m",
    "tokenizer": "t",
    "chat_template": "c",
    "dtype": "float32",
    "max_model_len": 64,
    "seed": 7,
    "block_size": 32,
    "kv_cache_dtype": "bfloat16",
    "kv_cache_memory": 64 << 20,
    "gpu_memory_utilization": 0.5,
    "swap_space": 1 << 30,
    "enable_prefix_caching": False,
    "max_prefix_tokens": 100,
    "min_match_length": 8,
    "max_num_seqs": 7,
    "max_num_batched_tokens": 100,
    "scheduling_policy": "multilevel",
    "queue_order": "spf",
    "l2_min_share": 0.3,
    "max_preemptions": 2,
    "preemption_mode": "swap",
    "l1_max_prompt_tokens": 10,
    "l1_max_tokens": 11,
    "l1_hold_s": 1.5,
    "l1_step_time": 0.05,
    "async_scheduling": False,
    "quantization": "int8",
    "precision_fallback": "bf16",
    "precision_classes": {"background": "int4"},
    "device": "cpu",
    "num_threads": 3,
    "attention_backend": "torch",
    "enforce_eager": True,
    "deterministic": True,
    "step_trace": "steps.jsonl",
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
    "enable_lora": True,
    "max_loras": 2,
    "max_cpu_loras": 8,
    "max_lora_rank": 64,
    "lora_modules": ["a=/x"],
    "lora_dir": "adapters",
}
SERVER_SAMPLES = {
    "api_key": "k",
    "max_waiting": 3,
    "max_body_bytes": 1 << 20,
    "request_log": "r.jsonl",
    "request_log_text": True,
    "allowed_origins": ["http://a"],
    "role": "prefill",
    "elastic": True,
    "tool_call_parser": "hermes",
    "reasoning_parser": "qwen3",
    "reasoning_budget": 0,
    "responses_max_count": 5,
    "responses_max_bytes": 1 << 20,
    "responses_ttl_s": 60.0,
}
SERVER_YAML_ONLY = {"max_n": 4, "api_key_classes": {"k2": "background"}}  # no flag
SERVER_DEFAULTS = ServerConfig(model_name="m")
# Flags named as an engine option with another meaning in their command, not the engine's:
# seeds of random prompts or traffic, lists of precisions compared, a client's or a payload's
# settings, byte counts of a trace.
OWN_MEANING = {
    ("generate", "seed"),
    ("bench offline", "seed"),
    ("bench offline", "quantization"),
    ("bench kv", "seed"),
    ("bench lora", "seed"),
    ("bench quality", "quantization"),
    ("bench quality", "deterministic"),
    ("bench serve", "model"),
    ("bench serve", "tokenizer"),
    ("bench serve", "seed"),
    ("bench kv-transfer", "dtype"),
    ("bench kv-transfer", "block_size"),
    ("bench kv-transfer", "device"),
    ("bench soak", "seed"),
    ("bench llamacpp", "quantization"),
    ("bench llamacpp", "seed"),
    ("bench fuzz", "seed"),
    ("analyze", "kv_cache_dtype"),
    ("simulate", "seed"),
    ("random-gguf", "dtype"),
    ("random-gguf", "seed"),
}
# The engine defaults a command sets for itself, where the engine's do not suit its runs.
COMMAND_DEFAULTS = {
    ("bench kv", "model"): "gemma3-270m",
    ("bench gpu", "device"): "cuda",
    ("bench gpu", "dtype"): "bfloat16",
    ("bench gpu", "kv_cache_memory"): 16 << 30,
    ("bench structured", "kv_cache_memory"): 256 << 20,
    ("bench soak", "kv_cache_memory"): 24 << 20,
    ("bench soak", "max_model_len"): 512,
    ("bench llamacpp", "num_threads"): 2,
}
REQUIRED = {"bench gpu": ["--out", "o.json"], "profile": ["--out", "o.json"]}  # their own
# `tandem serve`'s own flags, read by launch.main (not config fields).
LAUNCH_ONLY = {
    "help",
    "config",
    "model_tag",
    "served_model_name",
    "host",
    "port",
    "log_level",
    "engine_niceness",
    "shutdown_timeout",
}


def _flag_argv(action: argparse.Action, value) -> list[str]:
    if isinstance(value, bool):
        return [action.option_strings[0] if value else action.option_strings[1]]
    if isinstance(value, dict):
        return [action.option_strings[0], json.dumps(value)]
    if isinstance(value, list):
        return [action.option_strings[0], ",".join(value)]
    unit = "B" if isinstance(value, int) and value >= 1 << 20 else ""  # a size, with its unit
    return [action.option_strings[0], f"{value}{unit}"]


def _field(config: EngineConfig, name: str):
    section = OPTIONS[name].section
    return getattr(getattr(config, section) if section else config, name)


def _actions(p: argparse.ArgumentParser, name: str = ""):
    """(command, action) of every flag that stores into an engine option's name."""
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub, sp in a.choices.items():
                yield from _actions(sp, f"{name} {sub}".strip())
        elif a.option_strings and a.dest in OPTIONS:
            yield name, a


def _derived(a: argparse.Action) -> bool:
    return (a.help or "").startswith(OPTIONS[a.dest].field.metadata["help"])


def test_the_samples_cover_every_option():
    assert ENGINE_SAMPLES.keys() == OPTIONS.keys()
    server = {n for n, o in launch.SERVER_OPTIONS.items() if o.field.metadata["flag"] is not False}
    assert SERVER_SAMPLES.keys() == server
    assert SERVER_SAMPLES.keys() | SERVER_YAML_ONLY.keys() == launch.SERVER_OPTIONS.keys()


def test_no_command_restates_an_engine_flag():
    restated = {(command, a.dest) for command, a in _actions(PARSER) if not _derived(a)}
    assert restated == OWN_MEANING


def test_a_flag_left_out_stores_its_fields_default_or_the_commands_own():
    """serve, generate and simulate store nothing (the field's default applies, or simulate's
    own under its YAML); the other commands store the field's default or their own."""
    stored = set()
    for command, a in _actions(PARSER):
        if not _derived(a):
            continue
        if command in ("serve", "generate", "simulate"):
            assert a.default is argparse.SUPPRESS, (command, a.dest)
            continue
        args = PARSER.parse_args([*command.split(), *REQUIRED.get(command, [])])
        want = COMMAND_DEFAULTS.get((command, a.dest), OPTIONS[a.dest].field.default)
        assert getattr(args, a.dest) == want, (command, a.dest)
        stored.add((command, a.dest))
    assert COMMAND_DEFAULTS.keys() <= stored


@pytest.mark.parametrize(
    "command, name, text",
    [
        ("serve", "max_num_seqs", "(requests; default: 128)"),
        ("serve", "swap_space", "a bare number is GiB; default: 512MiB)"),
        ("serve", "enable_prefix_caching", "(default: on; YAML: serving.cache.enabled)"),
        ("serve", "kv_cache_memory", "default: 90% of free GPU memory after the weights"),
        ("simulate", "max_num_seqs", "(requests; default: 256)"),
        ("bench llamacpp", "num_threads", "(threads; default: 2)"),
        ("bench gpu", "kv_cache_memory", "default: 16GiB)"),
    ],
)
def test_the_help_states_the_default(command, name, text):
    action = next(a for c, a in _actions(PARSER) if (c, a.dest) == (command, name))
    assert text in action.help % {}


def test_serve_without_flags_or_yaml_is_the_fields_defaults(tmp_path):
    engine, server = launch.build_configs(PARSER.parse_args(["serve"]))
    assert engine == EngineConfig()
    assert server == ServerConfig(model_name=EngineConfig().model_config.model)
    empty = tmp_path / "empty.yaml"
    empty.write_text("serving:\n  engine: {}\n  cache: {}\n  scheduler: {}\n  server: {}\n")
    assert EngineConfig.from_kwargs(**load_yaml(empty)) == EngineConfig()


@pytest.mark.parametrize("name", list(ENGINE_SAMPLES))
def test_each_engine_flag_reaches_the_engine_config(name):
    action = next(a for command, a in _actions(PARSER) if command == "serve" and a.dest == name)
    engine, _ = launch.build_configs(
        PARSER.parse_args(["serve", *_flag_argv(action, ENGINE_SAMPLES[name])])
    )
    want = EngineConfig.from_kwargs(**{name: ENGINE_SAMPLES[name]})
    assert _field(engine, name) == _field(want, name) != _field(EngineConfig(), name)
    assert engine == want  # nothing else moved


@pytest.mark.parametrize("name", list(SERVER_SAMPLES))
def test_each_server_flag_reaches_the_server_config(name):
    action = next(
        a for a in PARSER._subparsers._group_actions[0].choices["serve"]._actions if a.dest == name
    )
    _, server = launch.build_configs(
        PARSER.parse_args(["serve", *_flag_argv(action, SERVER_SAMPLES[name])])
    )
    assert getattr(server, name) == SERVER_SAMPLES[name] != getattr(SERVER_DEFAULTS, name)


@pytest.mark.parametrize("name", [*SERVER_SAMPLES, *SERVER_YAML_ONLY])
def test_each_serving_server_key_reaches_the_server_config(tmp_path, name):
    """As written in YAML, and a size also with its unit."""
    value = {**SERVER_SAMPLES, **SERVER_YAML_ONLY}[name]
    written = [value]
    if launch.SERVER_OPTIONS[name].field.metadata["unit"] == "bytes":
        written.append(f"{value >> 20}MiB")
    path = tmp_path / "serving.yaml"
    for w in written:
        path.write_text(yaml.safe_dump({"serving": {"server": {name: w}}}))
        _, server = launch.build_configs(PARSER.parse_args(["serve", "--config", str(path)]))
        assert getattr(server, name) == value != getattr(SERVER_DEFAULTS, name), w


def test_serve_takes_no_other_flag():
    """Every flag of `tandem serve` is a config field's, or one launch.main reads itself."""
    serve = PARSER._subparsers._group_actions[0].choices["serve"]
    dests = {a.dest for a in serve._actions}
    assert dests - OPTIONS.keys() - set(SERVER_SAMPLES) == LAUNCH_ONLY
    body = inspect.getsource(launch.main) + inspect.getsource(launch.build_configs)
    for dest in LAUNCH_ONLY - {"help", "model_tag", "served_model_name"}:
        assert f"args.{dest}" in body, dest
    assert launch.model_of(PARSER.parse_args(["serve", "m"])) == "m"
    assert launch.build_configs(PARSER.parse_args(["serve", "--served-model-name", "a", "b"]))[
        1
    ].model_aliases == ("b",)


@pytest.mark.parametrize("key", sorted(YAML_KEYS))
def test_each_yaml_key_reaches_the_engine_config(tmp_path, key):
    name = YAML_KEYS[key]
    value = (
        {"draft_model": "ngram", "verify_interval": 3}
        if key == "speculative_decoding"
        else ENGINE_SAMPLES[name]
    )
    section, _, leaf = key.rpartition(".")
    doc = {leaf: value} if not section else {section: {leaf: value}}
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump({"serving": doc}))
    got = EngineConfig.from_kwargs(**load_yaml(path))
    assert _field(got, name) == _field(
        EngineConfig.from_kwargs(**{name: ENGINE_SAMPLES[name]}), name
    )


@pytest.mark.parametrize("section", ["", "{}", "null"])
def test_an_empty_speculative_decoding_section_is_off(tmp_path, section):
    path = tmp_path / "serving.yaml"
    path.write_text(f"serving:\n  speculative_decoding: {section}\n")
    assert EngineConfig.from_kwargs(**load_yaml(path)).speculative_config is None


@pytest.mark.parametrize("name", list(ENGINE_SAMPLES))
def test_every_option_is_a_serving_engine_key(tmp_path, name):
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump({"serving": {"engine": {name: ENGINE_SAMPLES[name]}}}))
    assert _field(EngineConfig.from_kwargs(**load_yaml(path)), name) != _field(EngineConfig(), name)


def test_unknown_options_are_refused_in_words(tmp_path):
    with pytest.raises(ValueError, match="unknown engine option.*max_num_seq\\b"):
        EngineConfig.from_kwargs(max_num_seq=4)
    path = tmp_path / "serving.yaml"
    path.write_text("serving:\n  scheduler: {polcy: fcfs}\n")
    with pytest.raises(ValueError, match="unknown serving.scheduler key.*polcy"):
        load_yaml(path)
    path.write_text("serving:\n  scheduler: {policy: lifo}\n")
    with pytest.raises(
        ValueError, match="scheduling_policy must be one of fcfs, multilevel, got 'lifo'"
    ):
        EngineConfig.from_kwargs(**load_yaml(path))


@pytest.mark.parametrize("key", ["model_name", "model_aliases"])
def test_the_served_names_are_served_model_name_in_yaml(tmp_path, key):
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump({"serving": {"server": {key: "foo"}}}))
    with pytest.raises(ValueError, match=f"serving.server.{key}.*serving.server.served_model_name"):
        launch.build_configs(PARSER.parse_args(["serve", "--config", str(path)]))
    path.write_text(yaml.safe_dump({"serving": {"server": {"served_model_name": ["foo", "bar"]}}}))
    _, server = launch.build_configs(PARSER.parse_args(["serve", "--config", str(path)]))
    assert (server.model_name, server.model_aliases) == ("foo", ("bar",))


def test_sizes_with_a_unit_are_bytes_under_engine_and_server(tmp_path):
    path = tmp_path / "serving.yaml"
    server = {"max_body_bytes": "8MiB", "responses_max_bytes": "1GiB"}
    path.write_text(
        yaml.safe_dump({"serving": {"engine": {"swap_space": "1GiB"}, "server": server}})
    )
    engine, got = launch.build_configs(PARSER.parse_args(["serve", "--config", str(path)]))
    assert engine.cache_config.swap_space == 1 << 30
    assert (got.max_body_bytes, got.responses_max_bytes) == (8 << 20, 1 << 30)


def test_llm_without_a_model_serves_the_configs_default(monkeypatch):
    from tandem.engine import llm

    monkeypatch.setattr(llm, "LLMEngine", lambda config: config)
    assert llm.LLM().engine == EngineConfig()
    assert llm.LLM("m", seed=3).engine == EngineConfig.from_kwargs(model="m", seed=3)
