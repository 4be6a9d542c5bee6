"""The YAML config (all under `serving:`), read into flat engine options. Its keys
are derived from the fields (config/option.py): `serving.engine` takes any engine option by
name (sizes as "4GiB"); `serving.<section>.<key>` takes the fields whose `yaml` names that key
(`cache.enabled`) and, for a section that declares `yaml_section`, every field by name;
`serving.<key>` alone (`deterministic`, `speculative_decoding`) is one option's whole value."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tandem.config.engine import OPTIONS, SECTIONS, Option
from tandem.config.option import parse_size

log = logging.getLogger(__name__)


def _yaml_keys() -> dict[str, str]:
    """`section.key` (or a top-level `key`) -> the flat option it sets."""
    keys = {}
    for name, opt in OPTIONS.items():
        section = getattr(SECTIONS.get(opt.section), "yaml_section", None)
        if section is not None:
            keys[f"{section}.{name}"] = name
        if opt.field.metadata.get("yaml"):
            keys[opt.field.metadata["yaml"]] = name
    return keys


YAML_KEYS = _yaml_keys()
SECTION_NAMES = ("engine", "server", *dict.fromkeys(k.partition(".")[0] for k in YAML_KEYS))


def load_yaml(path: str | Path, section: str = "engine") -> dict[str, Any]:
    """section "engine": the flat engine options of the file (EngineConfig.from_kwargs takes
    them); "server": serving.server as written (server options, e.g. api_key; parse_sizes
    reads their sizes)."""
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read config {path}: {e}") from e
    serving = doc.get("serving", doc)
    if not isinstance(serving, dict):
        raise ValueError(f"{path}: 'serving' must be a mapping")
    for name in serving:
        if name not in SECTION_NAMES:
            log.warning("%s: serving.%s is not supported yet and is ignored", path, name)
    if section != "engine":
        return dict(serving.get(section) or {})
    out = dict(serving.get("engine") or {})
    for key, value in serving.items():
        if key in YAML_KEYS:  # one option's whole value
            out[YAML_KEYS[key]] = _read(YAML_KEYS[key], value)
        elif key not in ("engine", "server") and key in SECTION_NAMES and value is not None:
            out.update(_section(path, key, value))
    return parse_sizes(out, OPTIONS)


def parse_sizes(values: Mapping[str, Any], options: Mapping[str, Option]) -> dict[str, Any]:
    """`values` with each size option written with its unit ("4GiB") in bytes, as its field's
    unit says (a bare number is bytes); the engine's options and serving.server's alike."""

    def is_size(name: str) -> bool:
        return name in options and options[name].field.metadata["unit"] == "bytes"

    return {n: parse_size(v) if is_size(n) and isinstance(v, str) else v for n, v in values.items()}


def _section(path, key: str, value: Any) -> dict[str, Any]:
    """serving.<key>: a mapping of its keys, or a scalar standing for its `default`."""
    if not isinstance(value, dict):
        if f"{key}.default" not in YAML_KEYS:
            raise ValueError(f"{path}: serving.{key} must be a mapping")
        value = {"default": value}
    known = {k.partition(".")[2]: name for k, name in YAML_KEYS.items() if k.startswith(key + ".")}
    unknown = set(value) - known.keys()
    if unknown:
        raise ValueError(
            f"{path}: unknown serving.{key} key(s): {', '.join(sorted(unknown))} (serving.{key} "
            f"takes {', '.join(sorted(known))}; the other engine options, e.g. the KV pool's "
            "kv_cache_dtype, go in serving.engine)"
        )
    return {known[k]: _read(known[k], v) for k, v in value.items()}


def _read(name: str, value: Any) -> Any:
    """A value under an option's `yaml` key, in the option's shape (its `from_yaml`, if any)."""
    read = OPTIONS[name].field.metadata["from_yaml"]
    return read(value) if read else value
