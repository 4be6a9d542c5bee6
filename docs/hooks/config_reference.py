"""mkdocs hook: the configuration page's reference tables, generated from the config's fields
at build time, in place of the page's marker."""

from __future__ import annotations

MARKER = "<!-- generated: config reference -->"


def reference() -> str:
    """Every engine option by section, then `tandem serve`'s server options."""
    from tandem.config.reference import engine_reference, row, table
    from tandem.server.launch import SERVED_NAMES_HELP, SERVER_OPTIONS

    keys = {name: [f"serving.server.{name}"] for name in SERVER_OPTIONS}
    served = ["serving.server.served_model_name"]
    names = row(
        "served_model_name",
        "--served-model-name",
        served,
        "-",
        "the --model value",
        SERVED_NAMES_HELP,
    )
    text = engine_reference() + "\n" + table("server (tandem serve)", SERVER_OPTIONS, keys) + names
    return text + "\n" + command_line_only(text)


def command_line_only(listed: str) -> str:
    """`tandem serve`'s flags that no config field declares (the address, the process), from
    its argument parser."""
    from tandem.cli import build_parser

    serve = build_parser(["serve"])._subparsers._group_actions[0].choices["serve"]
    rows = ["### Command line only (tandem serve)", "", "| flag | what it does |", "|---|---|"]
    for action in serve._actions:
        flags = [f for f in action.option_strings if f.startswith("--") and f != "--help"]
        if flags and f"`{flags[0]}`" not in listed:
            text = (action.help or "").replace("%%", "%").replace("|", "\\|")
            rows.append(f"| {', '.join(f'`{f}`' for f in flags)} | {text} |")
    return "\n".join(rows) + "\n"


def on_page_markdown(markdown: str, **kwargs) -> str:
    return markdown.replace(MARKER, reference()) if MARKER in markdown else markdown
