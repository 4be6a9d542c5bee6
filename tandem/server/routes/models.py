"""GET /v1/models: the served model, one `name:precision` entry per variant, and the LoRA
adapters with their base (`parent`, vLLM's shape)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tandem.server.precision import model_cards
from tandem.server.routes.lora import lora_cards
from tandem.server.state import serving_state

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request):
    state = serving_state(request)
    return {
        "object": "list",
        "data": model_cards(
            state.config.served_model_names, state.facts.precisions, state.facts.max_model_len
        )
        + lora_cards(state),
    }
