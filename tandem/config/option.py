"""How a config field is declared: its default, help text and unit in one place. The CLI flags,
the `LLM(**kwargs)` keys and the YAML keys are derived from these declarations (config/args.py,
config/engine.py, config/serving_yaml.py), so a default is written once."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import field
from enum import Enum
from typing import Any, TypeVar

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def option(
    default: Any,
    help: str,
    *,
    unit: str | None = None,
    none: str | None = None,
    yaml: str | None = None,
    flag: str | bool = True,
    bare_unit: str = "B",
    choices: tuple[str, ...] | None = None,
    from_yaml: Callable[[Any], Any] | None = None,
) -> Any:
    """A config field. `unit`: what a number counts ("bytes": a size, "4GiB" or a bare number
    in `bare_unit`); `none`: what the default None means, in words; `yaml`: its key under
    `serving:` where that is not `engine.<name>` alone (dotted, e.g. "cache.enabled"); `flag`:
    False for no CLI flag, or the flag's name where it is not the field's; `choices`: the
    strings a str field takes; `from_yaml`: reads the value under the `yaml` key where that key
    takes another shape than the option."""
    if not help.strip():
        raise ValueError("an option says what it does: its help is the flag's and the docs' text")
    meta = {
        "help": help,
        "unit": unit,
        "none": none,
        "yaml": yaml,
        "flag": flag,
        "bare_unit": bare_unit,
        "choices": choices,
        "from_yaml": from_yaml,
    }
    return field(default=default, metadata=meta)


C = TypeVar("C", bound="Choice")


class Choice(str, Enum):
    """A mode chosen by name (a policy, a backend): parsed from its string once, where a config
    is built, then compared as a member."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls: type[C], value: str, what: str) -> C:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"{what} must be one of {names}, got {value!r}") from None


def parse_size(text: str | float, bare_unit: str = "B") -> int:
    """Bytes from '4GiB', '512MiB', '2.5G' or a bare number (counted in `bare_unit`)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = (m.group(2).lower() or bare_unit.lower()) if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"not a size: {text!r} (e.g. 4GiB, 512MiB, 2G, or a number of {bare_unit})"
        )
    return int(float(m.group(1)) * _UNITS[unit])
