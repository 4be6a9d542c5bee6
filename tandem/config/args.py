"""Command-line flags derived from config fields: name (`--kebab-case`), type, unit, default and
help come from the field's declaration (config/option.py), so no command restates them. A flag
left out stores nothing (its field's default applies, or the YAML's value under `--config`),
unless the command asks for the defaults stored; `given(args)` collects the options there."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

from tandem.config.engine import OPTIONS, SECTIONS, Option
from tandem.config.option import parse_size

TITLES = {
    "model_config": "model",
    "cache_config": "cache (KV pool, prefix cache)",
    "scheduler_config": "scheduler",
    "quant_config": "quantization",
    "device_config": "device",
    "observability_config": "observability",
    "lora_config": "LoRA adapters",
    "": "speculative decoding",
}


def add_engine_arguments(
    p: argparse.ArgumentParser,
    names: Iterable[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    store_defaults: bool = False,
) -> None:
    """Flags for the engine options `names` (all when None), in a group per section. `defaults`:
    a command's own default for an option, where it must differ from the engine's (its help
    says so); `store_defaults`: a flag left out stores its default (for commands that read the
    values), else nothing, and the command applies its defaults under any YAML's values."""
    wanted = OPTIONS.keys() if names is None else list(names)
    unknown = set(wanted) - OPTIONS.keys() | set(defaults or {}) - set(wanted)
    if unknown:
        raise ValueError(f"not engine options of this command: {', '.join(sorted(unknown))}")
    for section in [*SECTIONS, ""]:
        chosen = {n: OPTIONS[n] for n in wanted if OPTIONS[n].section == section}
        if chosen:
            add_arguments(p.add_argument_group(TITLES[section]), chosen, defaults, store_defaults)


def dataclass_options(cls: type) -> dict[str, Option]:
    """A config dataclass's fields declared with option() (ServerConfig's, for `tandem serve`)."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if "help" in f.metadata]
    return {f.name: Option("", f, hints[f.name]) for f in fields}


def add_arguments(
    g,
    options: Mapping[str, Option],
    defaults: Mapping[str, Any] | None = None,
    store_defaults: bool = False,
) -> None:
    """A flag per option (but those declared with flag=False)."""
    for name, opt in options.items():
        meta = opt.field.metadata
        flag = flag_name(name, meta)
        if flag is None:
            continue
        kwargs = _kind(_value_type(opt.type), meta)
        default = (defaults or {}).get(name, opt.field.default)
        unit = f"{unit_text(meta)}; " if meta.get("unit") else ""
        yaml = f"; YAML: serving.{meta['yaml']}" if meta.get("yaml") else ""
        text = f"{meta['help']} ({unit}default: {default_text(default, meta)}{yaml})"
        kwargs["help"] = text.replace("%", "%%")
        stored = default if store_defaults else argparse.SUPPRESS
        g.add_argument(flag, dest=name, default=stored, **kwargs)


def given(args: argparse.Namespace, names: Iterable[str] = OPTIONS) -> dict[str, Any]:
    """The options of `names` the command line gave (or a command's own default set)."""
    return {n: getattr(args, n) for n in names if hasattr(args, n)}


def _value_type(hint: Any) -> Any:
    """`int | None` -> int; a type without None as is."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


def _kind(t: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
    """argparse's type / action / choices for a field's type."""
    if t is bool:
        return {"action": _Switch}
    if isinstance(t, type) and issubclass(t, Enum):
        return {"choices": [m.value for m in t]}
    if meta.get("unit") == "bytes":
        return {"type": _size(meta["bare_unit"]), "metavar": "SIZE"}
    if t is dict or typing.get_origin(t) is dict or dataclasses.is_dataclass(t):
        return {"type": _json_object, "metavar": "JSON"}
    if typing.get_origin(t) is list:
        return {"type": lambda s: [x.strip() for x in s.split(",") if x.strip()], "metavar": "A,B"}
    return {"type": t, "choices": meta.get("choices")}


class _Switch(argparse.BooleanOptionalAction):
    """--x / --no-x with the help as written (Python < 3.14 appends its own default to it)."""

    def __init__(self, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = help


def flag_name(name: str, meta: Mapping[str, Any]) -> str | None:
    """An option's flag: the one it declares, else `--kebab-case` of its name; None where it
    declares flag=False (YAML or `LLM` only)."""
    flag = meta.get("flag", True)
    if flag is False:
        return None
    return flag if isinstance(flag, str) else "--" + name.replace("_", "-")


def unit_text(meta: Mapping[str, Any]) -> str:
    """What an option's number counts, in words ("" where the field declares no unit)."""
    if meta.get("unit") == "bytes":
        bare = "bytes" if meta["bare_unit"] == "B" else meta["bare_unit"]
        return f"a size, e.g. 4GiB or 512MiB, a bare number is {bare}"
    return meta.get("unit") or ""


def default_text(value: Any, meta: Mapping[str, Any]) -> str:
    if value is None:
        return meta.get("none") or "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if meta.get("unit") == "bytes":
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"{value // size}{unit}"
    return str(value)


def _size(bare_unit: str):
    def parse(text: str) -> int:
        try:
            return parse_size(text, bare_unit)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    return parse


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        example = '{"method": "ngram"}'
        raise argparse.ArgumentTypeError(f"not JSON ({e}); e.g. '{example}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('must be a JSON object, e.g. \'{"method": "ngram"}\'')
    return value
