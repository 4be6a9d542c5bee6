"""GET /v1/models: the served model, and one `name:precision` entry per variant."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tandem.server.precision import model_cards
from tandem.server.state import serving_state

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request):
    state = serving_state(request)
    return {
        "object": "list",
        "data": model_cards(
            state.config.served_model_names, state.facts.precisions, state.facts.max_model_len
        ),
    }
