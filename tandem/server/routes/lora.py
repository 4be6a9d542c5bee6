"""vLLM's runtime LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind
the API key as every route; 404 unless the engine serves adapters and has an adapter folder,
paths confined to it). Requests name a loaded adapter by `model`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from tandem.engine.core_messages import AddLoRA, RemoveLoRA
from tandem.server.errors import APIError
from tandem.server.state import ServingState, serving_state

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


def lora_cards(state: ServingState) -> list[dict]:
    """An entry per adapter served, with its folder (`root`) and base model (`parent`)."""
    return [
        {
            "id": lora.lora_name,
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            "root": lora.lora_path,
            "parent": state.config.model_name,
            "max_model_len": state.facts.max_model_len,
        }
        for lora in state.loras.loras.values()
    ]


def _runtime(request: Request) -> ServingState:
    state = serving_state(request)
    if not state.loras.runtime_loading:
        raise APIError(
            404,
            "loading LoRA adapters at run time is off: start with --enable-lora --lora-dir DIR",
            "not_found_error",
        )
    return state


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRAAdapterRequest, request: Request):
    state = _runtime(request)
    try:
        lora = state.loras.new(req.lora_name, req.lora_path)
        await state.llm.call_utility(AddLoRA(lora))
    except ValueError as e:
        raise APIError(400, str(e), param="lora_path") from None
    state.loras.add(lora)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, request: Request):
    """The name stops serving new requests at once; those running with it finish with it."""
    state = _runtime(request)
    try:
        lora = state.loras.remove(req.lora_name)
    except KeyError:
        raise APIError(
            404, f"no LoRA adapter is named {req.lora_name!r}", "not_found_error", "lora_name"
        ) from None
    await state.llm.call_utility(RemoveLoRA(lora.lora_int_id))
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
