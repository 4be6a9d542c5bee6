"""docs/api_fields.md, written from the request models: every field of every endpoint, honoured,
a hint (accepted; it cannot change this server's output) or refused, and why. A test keeps the
file current; `python -m tandem.server.api_fields > docs/api_fields.md` rewrites it."""

from __future__ import annotations

from typing import Any, get_args, get_origin

from pydantic import BaseModel

from tandem.server import anthropic_protocol, protocol, responses_protocol
from tandem.server.protocol_parts import HINT

OPENAI: dict[str, type[BaseModel]] = {
    "/v1/completions": protocol.CompletionRequest,
    "/v1/chat/completions": protocol.ChatCompletionRequest,
}
ANTHROPIC: dict[str, type[BaseModel]] = {
    "/v1/messages": anthropic_protocol.MessagesRequest,
    "/v1/messages/count_tokens": anthropic_protocol.CountTokensRequest,
}
RESPONSES: dict[str, type[BaseModel]] = {"/v1/responses": responses_protocol.ResponsesRequest}
ENDPOINTS = {**OPENAI, **RESPONSES, **ANTHROPIC}
KEY_HINTS = {  # dict fields whose keys may have no effect: a hint row `name.*`
    "chat_template_kwargs": "a variable the chat template does not read: accepted, no effect"
}

HEADER = """# Request fields

Every field the API endpoints take, from the request models (`tandem/server/protocol.py`,
`responses_protocol.py`, `anthropic_protocol.py`), nested ones too (`parent.field`; in a list's
items `parent[].field`):
**honoured**, a **hint** (accepted; it cannot change this server's output) or **refused**
(a 400 naming the field and why). A field in no row is refused too. Written by
`python -m tandem.server.api_fields > docs/api_fields.md`; a test keeps it current.

| Field | Endpoints | Status | Notes |
|---|---|---|---|
"""


def _rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """(field, status, notes) of a model's fields, and of the request models inside them."""
    rows = []
    for name, info in model.model_fields.items():
        name = prefix + (info.alias or name)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        status = "hint" if extra.get("x-tandem") == HINT else "honoured"
        rows.append((name, status, info.description or ""))
        if name in KEY_HINTS:
            rows.append((f"{name}.*", "hint", KEY_HINTS[name]))
        for suffix, nested in _models(info.annotation):
            rows += _rows(nested, f"{name}{suffix}.")
    return list(dict.fromkeys(rows))  # item types of one list share fields (id, status, ...)


def _models(annotation: Any, suffix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """The request models a field's type holds, each with a "[]" per list it is inside."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(suffix, annotation)]
    suffix += "[]" if get_origin(annotation) is list else ""
    found = [m for a in get_args(annotation) for m in _models(a, suffix)]
    return list(dict.fromkeys(found))


def table() -> str:
    """The whole file's text."""
    endpoints: dict[tuple[str, str, str], list[str]] = {}
    for path, model in ENDPOINTS.items():
        for row in _rows(model):
            endpoints.setdefault(row, []).append(path)
    refused = {
        (name, "refused", why): [p for p, m in apis.items() if name not in m.model_fields]
        for apis, module in (
            (OPENAI, protocol),
            (RESPONSES, responses_protocol),
            (ANTHROPIC, anthropic_protocol),
        )
        for name, why in module.REFUSED.items()
    }
    lines = [
        f"| `{name}` | {', '.join(f'`{p}`' for p in paths)} | {status} | {notes} |"
        for (name, status, notes), paths in sorted({**endpoints, **refused}.items())
    ]
    return HEADER + "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
