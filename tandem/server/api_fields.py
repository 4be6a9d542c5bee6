"""docs/api_fields.md, written from the request models: every field of every endpoint, honoured,
a hint (accepted; it cannot change this server's output) or refused, and why. A test keeps the
file current; `python -m tandem.server.api_fields > docs/api_fields.md` rewrites it."""

from __future__ import annotations

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
NESTED = ("stream_options",)  # fields whose own fields get rows (where hints hide)

HEADER = """# Request fields

Every field the API endpoints take, from the request models (`tandem/server/protocol.py`,
`responses_protocol.py`, `anthropic_protocol.py`):
**honoured**, a **hint** (accepted; it cannot change this server's output) or **refused**
(a 400 naming the field and why). A field in no row is refused too. Written by
`python -m tandem.server.api_fields > docs/api_fields.md`; a test keeps it current.

| Field | Endpoints | Status | Notes |
|---|---|---|---|
"""


def _rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """(field, status, notes) of a model's fields, nested ones expanded."""
    rows = []
    for name, info in model.model_fields.items():
        name = prefix + (info.alias or name)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        status = "hint" if extra.get("x-tandem") == HINT else "honoured"
        rows.append((name, status, info.description or ""))
        nested = [
            a
            for a in getattr(info.annotation, "__args__", ())
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if name in NESTED and nested:
            rows += _rows(nested[0], name + ".")
    return rows


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
