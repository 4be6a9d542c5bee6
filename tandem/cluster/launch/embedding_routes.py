"""The embedding instance's routes: module-level handlers reading `EmbeddingState` from
`app.state.embedding`, so each can be served and tested alone (with a fake embedder)."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict

api = APIRouter()


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field it cannot honour is refused, not ignored
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: str = "float"  # float | base64
    dimensions: int | None = None
    user: str | None = None  # accepted without effect


@dataclass
class EmbeddingState:
    """The embedder (`embed(inputs) -> (vectors, tokens)`, `dim`, `tokenizer`, `lock`), the
    served name, the metrics and the load /tandem/state reports."""

    embedder: Any
    model_name: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    load: dict[str, int] = field(default_factory=lambda: {"waiting": 0, "running": 0, "tokens": 0})

    def __post_init__(self) -> None:
        reg, labels = self.registry, ["model_name"]
        self.requests = Counter(
            "tandem:embedding_requests", "Embedding requests served.", labels, registry=reg
        )
        self.tokens = Counter("tandem:embedding_tokens", "Tokens embedded.", labels, registry=reg)
        self.latency = Histogram(
            "tandem:embedding_latency_seconds", "Embedding request latency.", labels, registry=reg
        )


def state_of(request: Request) -> EmbeddingState:
    return request.app.state.embedding


def inputs_of(req: EmbeddingRequest, embedder: Any) -> list[str] | list[list[int]]:
    """The inputs as a batch; HTTPException 400 for one the model cannot embed."""
    batch = (
        [req.input]
        if isinstance(req.input, str) or (req.input and isinstance(req.input[0], int))
        else req.input
    )
    if not batch or any(len(x) == 0 for x in batch):
        raise HTTPException(400, "input: must not be empty")
    if req.encoding_format not in ("float", "base64"):
        raise HTTPException(400, "encoding_format: float or base64")
    if req.dimensions is not None and req.dimensions != embedder.dim:
        raise HTTPException(400, f"dimensions: this model has {embedder.dim}")
    if not isinstance(batch[0], str) and any(
        t < 0 or t >= embedder.tokenizer.vocab_size for x in batch for t in x
    ):
        raise HTTPException(400, "input: token id outside the vocabulary")
    return batch


@api.post("/v1/embeddings")
async def create_embedding(req: EmbeddingRequest, request: Request):
    state = state_of(request)
    name = state.model_name
    if req.model is not None and req.model != name:
        raise HTTPException(
            404, f"The model `{req.model}` does not exist; this server serves `{name}`."
        )
    batch = inputs_of(req, state.embedder)
    cost = sum(len(x) for x in batch)
    state.load["waiting"] += 1
    state.load["tokens"] += cost
    try:
        with state.latency.labels(name).time():
            vectors, used = await asyncio.to_thread(_embed, state, batch)
    finally:
        state.load["tokens"] -= cost
    state.requests.labels(name).inc()
    state.tokens.labels(name).inc(used)
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
            if req.encoding_format == "base64"
            else v.tolist(),
        }
        for i, v in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": name,
        "usage": {"prompt_tokens": used, "total_tokens": used},
    }


def _embed(state: EmbeddingState, batch: list) -> tuple[np.ndarray, int]:
    load = state.load
    with state.embedder.lock:  # counted as running only once it holds the model
        load["waiting"] -= 1
        load["running"] += 1
        try:
            return state.embedder.embed(batch)
        finally:
            load["running"] -= 1


@api.get("/v1/models")
async def list_models(request: Request):
    return {
        "object": "list",
        "data": [
            {
                "id": state_of(request).model_name,
                "object": "model",
                "created": 0,
                "owned_by": "tandem",
            }
        ],
    }


@api.get("/health")
async def health():
    return {"status": "ok"}


@api.get("/tandem/state")
async def instance_state(request: Request):
    state = state_of(request)
    load = state.load
    return {
        "model": state.model_name,
        "role": "embedding",
        "elastic": False,
        "num_waiting": load["waiting"],
        "num_running": load["running"],
        "waiting_prefill_tokens": load["tokens"],
        "kv_usage": 0.0,
        "kv_free_tokens": 0,
        "block_size": 0,
        "cached_prefixes": [],
    }


@api.get("/metrics")
async def metrics(request: Request):
    return Response(generate_latest(state_of(request).registry), media_type=CONTENT_TYPE_LATEST)
