"""Tool-call parsers, one per model family's output format (vLLM's names), chosen by
`--tool-call-parser` or from the chat template (the markers it renders calls with); a template
with none gets the generic format (generic.py)."""

from __future__ import annotations

from tandem.engine.chat import template_variables
from tandem.server.tool_parsers.base import ToolParser
from tandem.server.tool_parsers.generic import GenericToolParser
from tandem.server.tool_parsers.hermes import HermesToolParser
from tandem.server.tool_parsers.llama3_json import Llama3JsonToolParser
from tandem.server.tool_parsers.mistral import MistralToolParser

FAMILIES = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}
TOOL_CALL_PARSERS = (*FAMILIES, "generic")


def tool_parser(name: str | None, tokenizer) -> ToolParser:
    """The parser `name`, or the one the tokenizer's chat template's markers name."""
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    if name is None:  # a family's first marker, in the template that renders its calls
        name = next((n for n, p in FAMILIES.items() if p.markers[0] in template), "generic")
    if name != "generic":
        return FAMILIES[name]()
    return GenericToolParser("tools" in template_variables(tokenizer), "tool_calls" in template)
