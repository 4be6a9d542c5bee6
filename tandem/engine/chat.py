"""The one chat prompt: a conversation (and the tools it may call) rendered by the model's chat
template. The server's chat route and /tokenize, the router's prefix hashing and `LLM.chat` all
call `apply_chat_template`, so the router hashes exactly the tokens the instance will cache and
/tokenize counts exactly what a chat request would send."""

from __future__ import annotations

import functools
import inspect
from typing import Any

NO_TEMPLATE = (
    "this model has no chat template: send a plain prompt (text or token ids), not messages"
)


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """The prompt text. `messages` as chat templates read them (role, content, and tool fields
    where given); `tools` in OpenAI's form, rendered by templates that know tools; extra template
    variables in `chat_template_kwargs` (one the template does not read has no effect);
    `continue_final_message`: the text ends inside the last message, for the output to go on
    with it. ValueError for a bad conversation."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not isinstance(template, str) or not template:
        raise ValueError(NO_TEMPLATE)
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(extra.keys() & _own_parameters(tokenizer))
    if reserved:
        raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set there")
    if tools:
        extra["tools"] = tools
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **extra,
        )
    except Exception as e:  # the template's own checks (roles, alternation, ...) raise anything
        raise ValueError(f"messages: {e}") from None


def template_variables(tokenizer: Any) -> frozenset[str]:
    """The variables the tokenizer's chat template reads (none without a template)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return _template_variables(template) if isinstance(template, str) else frozenset()


def _own_parameters(tokenizer: Any) -> set[str]:
    """apply_chat_template's own arguments (tokenize, tools, ...): not template variables."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD} | {
        "messages",
        "conversation",
    }


@functools.lru_cache(maxsize=16)
def _template_variables(template: str) -> frozenset[str]:
    """The variables a Jinja template reads (none known if plain Jinja cannot parse it: a
    template tag of transformers' own, such as `generation`)."""
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        ast = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError:
        return frozenset()
    return frozenset(meta.find_undeclared_variables(ast))
