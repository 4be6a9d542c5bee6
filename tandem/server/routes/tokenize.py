"""POST /tokenize and /detokenize (vLLM's): a prompt, or messages rendered exactly as a chat
request renders them (render_prompt: its add_generation_prompt, tools and chat_template_kwargs,
the served tool-call format and reasoning budget), to token ids and the context they must fit;
token ids back to text."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tandem.server.errors import APIError
from tandem.server.protocol import DetokenizeRequest, TokenizeRequest
from tandem.server.routes.chat import render_prompt
from tandem.server.state import serving_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    state = serving_state(request)
    facts = state.facts
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give `prompt` or `messages`, not both or neither")
    text = req.prompt if req.prompt is not None else render_prompt(state, req.chat_request())
    try:
        if req.add_special_tokens:
            ids = facts.tokenize(text)  # as a request's prompt is tokenised
        elif facts.tokenizer is None:
            raise ValueError("this model has no tokenizer")
        else:
            ids = facts.tokenizer.encode(text, add_special_tokens=False)
    except ValueError as e:
        raise APIError(
            400, str(e), param="prompt" if req.prompt is not None else "messages"
        ) from None
    return {"tokens": ids, "count": len(ids), "max_model_len": facts.max_model_len}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    facts = serving_state(request).facts
    if facts.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    try:
        facts.tokenize(req.tokens)  # the engine's rule for token ids (within the vocabulary)
    except ValueError as e:
        raise APIError(400, str(e), param="tokens") from None
    return {"prompt": facts.tokenizer.decode(req.tokens)}
