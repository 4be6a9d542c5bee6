"""Command-line helpers every command shares: sizes with units, the KV cache dtype flag, and the
old spellings a release shipped, which still parse but say the new name."""
from __future__ import annotations

import argparse
import re
import sys
from typing import Callable

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


FLOAT_DTYPES = ("auto", "float32", "bfloat16", "float16")  # `dtype` and `kv_cache_dtype` values


def kv_cache_dtype_argument(p, default: str | None = "auto") -> None:
    """--kv-cache-dtype, as every command that builds an engine takes it."""
    p.add_argument("--kv-cache-dtype", default=default, choices=FLOAT_DTYPES,
                   help="the KV cache's element type (default auto: the activations' dtype, but bfloat16 on a CPU "
                        "where --dtype auto computes in float32); narrower than the activations on CPU only")


def parse_size(text: str | int | float, bare_unit: str = "b") -> int:
    """Bytes from '4GiB', '512MiB', '2.5G' or a bare number (counted in `bare_unit`)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = (m.group(2).lower() or bare_unit.lower()) if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 2G, or a number of {bare_unit})")
    return int(float(m.group(1)) * _UNITS[unit])


def size_type(bare_unit: str) -> Callable[[str], int]:
    """An argparse type: bytes, with a bare number counted in `bare_unit` ('GiB' as vLLM's --swap-space)."""
    def parse(text: str) -> int:
        try:
            return parse_size(text, bare_unit)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    return parse


def warn_renamed(old: str, new: str) -> None:
    print(f"warning: {old} is deprecated and will be removed; use {new}", file=sys.stderr)


class Renamed(argparse.Action):
    """An old spelling: stores into the new flag's dest (through `convert`) and warns, naming the new one."""

    def __init__(self, option_strings, dest, new: str, convert: Callable | None = None, **kwargs):
        self.new, self.convert = new, convert
        kwargs.setdefault("help", f"deprecated: use {new}")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        warn_renamed(option_string, self.new)
        value = self.const if self.nargs == 0 else values
        setattr(namespace, self.dest, self.convert(value) if self.convert else value)


def renamed(p, old: str, new: str, dest: str, convert: Callable | None = None, flag: object = None) -> None:
    """Keep `old` as a deprecated spelling of `new` (`flag`: a switch storing that value)."""
    if flag is None:
        p.add_argument(old, dest=dest, action=Renamed, new=new, convert=convert, default=argparse.SUPPRESS)
    else:
        p.add_argument(old, dest=dest, action=Renamed, new=new, nargs=0, const=flag, default=argparse.SUPPRESS)
