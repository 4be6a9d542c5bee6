"""The configuration reference: a Markdown table per section of every option, with its flag,
YAML key, unit and default, read off the fields' declarations (docs/configuration.md is built
from it, so the page cannot drift from the code)."""

from __future__ import annotations

from collections.abc import Mapping

from tandem.config.args import TITLES, default_text, flag_name, unit_text
from tandem.config.engine import OPTIONS, SECTIONS, Option
from tandem.config.serving_yaml import YAML_KEYS


def engine_reference() -> str:
    """Every engine option, a table per section."""
    yaml_keys: dict[str, list[str]] = {}
    for key, name in YAML_KEYS.items():
        yaml_keys.setdefault(name, []).append(f"serving.{key}")
    parts = []
    for section in [*SECTIONS, ""]:
        options = {n: o for n, o in OPTIONS.items() if o.section == section}
        keys = {n: [f"serving.engine.{n}", *yaml_keys.get(n, [])] for n in options}
        parts.append(table(TITLES[section], options, keys))
    return "\n".join(parts)


def table(title: str, options: Mapping[str, Option], yaml_keys: Mapping[str, list[str]]) -> str:
    """One section's table: option (the `LLM` keyword), flag, YAML keys, default and help."""
    rows = [
        f"### {title[0].upper()}{title[1:]}",
        "",
        "| option | flag | YAML | unit | default | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for name, opt in options.items():
        meta = opt.field.metadata
        keys, default = yaml_keys.get(name, []), default_text(opt.field.default, meta)
        unit = unit_text(meta) or "-"
        rows.append(row(name, flag_name(name, meta), keys, unit, default, meta["help"]))
    return "\n".join(rows) + "\n"


def row(
    name: str, flag: str | None, yaml_keys: list[str], unit: str, default: str, text: str
) -> str:
    """A table's row, for an option that no field declares too (`served_model_name`)."""
    keys = ", ".join(f"`{k}`" for k in yaml_keys) or "-"
    text = text.replace("|", "\\|")
    return f"| `{name}` | {f'`{flag}`' if flag else '-'} | {keys} | {unit} | {default} | {text} |"
