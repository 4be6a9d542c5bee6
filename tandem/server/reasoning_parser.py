"""Reasoning parsers (vLLM's `--reasoning-parser`): a reasoning model's <think>...</think> as
`reasoning_content`, the rest as the answer. The block may open in the output, or in the
prompt (a template that ends its generation prompt with <think>, as DeepSeek-R1's): then the
output is reasoning up to </think>. Chosen by name or, without one, from a chat template that
writes <think>."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.sampling_params import ThinkingBudget
from tandem.server.tool_parsers.base import partial_marker

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # one format, both names as vLLM's


@dataclass(slots=True)
class ThinkParser:
    opened: bool  # the prompt ends inside a <think> block

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of the output so far. Not final: a marker that may be starting
        is held back; final: a block the output never closed is all reasoning."""
        body = text.lstrip()
        if not self.opened:
            if not body.startswith(START):
                if not final and START.startswith(body):  # nothing yet, or <think> coming
                    return "", ""
                return "", text
            body = body[len(START) :]
        body = body.lstrip()
        end = body.find(END)
        if end == -1:
            return body if final else body[: len(body) - partial_marker(body, (END,))], ""
        return body[:end], body[end + len(END) :].lstrip()


def reasoning_parser(name: str | None, tokenizer, prompt: str) -> ThinkParser | None:
    """The request's parser: the one named, or the template's if it writes <think>; None for a
    model that does not reason."""
    template = getattr(tokenizer, "chat_template", None)
    if name is None and not (isinstance(template, str) and START in template):
        return None
    return ThinkParser(opened=prompt.rstrip().endswith(START))


def thinking_budget(think: ThinkParser | None, tokens: int, tokenizer) -> ThinkingBudget | None:
    """The engine's budget of `tokens` inside the block (-1: none), counted from the output's
    <think> or, where the prompt opened the block, from the first token; None for a model that
    does not reason."""
    if think is None or tokens < 0:
        return None

    def ids(marker: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(marker, add_special_tokens=False))

    return ThinkingBudget(tokens, () if think.opened else ids(START), ids(END))
