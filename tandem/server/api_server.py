"""`tandem serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn)."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.cluster.instance import InstanceSnapshot, add_instance_routes
from tandem.engine.async_llm import AsyncLLM
from tandem.server import responses as R
from tandem.server.dashboard import add_server_dashboard
from tandem.server.metrics import ServerMetrics
from tandem.server.pd_routes import add_pd_routes
from tandem.server.middleware import BodySizeLimit
from tandem.server.precision import check_key_classes, key_priority, model_cards, request_precision, split_model
from tandem.server.protocol import (NO_EFFECT_FIELDS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    TokenizeRequest)
from tandem.server.tool_calls import plan_tool_calls


@dataclass(slots=True)
class ServerConfig:
    model_name: str = "smollm2-135m"  # the name clients send as `model`
    api_key: str | None = None
    max_waiting: int = 512  # past this many waiting requests, answer 429
    max_n: int = 16
    max_body_bytes: int = 4 << 20
    request_log: str | None = None
    api_key_classes: dict[str, str] | None = None  # further API keys, each mapped to a request class
    role: str = "colocated"  # in a cluster: colocated | prefill | decode (tandem.cluster)
    elastic: bool = False  # may be switched between prefill and decode by the router


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, headers=None):
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(llm: AsyncLLM, config: ServerConfig) -> FastAPI:
    check_key_classes(config.api_key_classes)
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    metrics = ServerMetrics(llm.engine, config.model_name, config.request_log)
    snapshot = InstanceSnapshot(llm.engine, config.model_name, config.role, config.elastic)

    def on_step(engine, elapsed, outputs) -> None:
        metrics.on_step(engine, elapsed, outputs)
        snapshot.update(engine)
    llm.on_step = on_step
    add_instance_routes(app, snapshot)
    add_server_dashboard(app, metrics.registry, config.api_key, config.model_name)
    add_pd_routes(app, llm, config.model_name)
    tokenizer = llm.tokenizer
    max_model_len = llm.engine.max_model_len

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"unsupported field `{where}`: this server does not implement it (a field "
                                  f"it cannot honour is refused, not ignored; accepted without effect: "
                                  f"{', '.join(NO_EFFECT_FIELDS)})", param=where)
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        # API keys mapped to a class are keys too: with only those configured, the server is not open
        if (config.api_key or config.api_key_classes) and request.url.path.startswith("/v1/"):
            auth = request.headers.get("authorization")
            if (not config.api_key or auth != f"Bearer {config.api_key}") \
                    and key_priority(auth, config.api_key_classes) is None:
                return error_response(401, "invalid or missing API key", "authentication_error")
        return await call_next(request)

    def check_admission(model: str | None, n: int) -> None:
        model, _ = split_model(model, config.model_name)
        if model is not None and model != config.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{config.model_name}`.",
                           "not_found_error", "model")
        if n > config.max_n:
            raise APIError(400, f"n must be at most {config.max_n}, got {n}", param="n")
        if llm.num_waiting >= config.max_waiting:
            raise APIError(429, f"server overloaded: {llm.num_waiting} requests waiting", "rate_limit_error",
                           headers={"Retry-After": "1"})

    def encode(prompt) -> list[int]:
        try:
            return llm.engine.tokenize(prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None

    async def compiled(so, kind: str | None = None) -> None:
        """Compile the request's constraint (or find it cached) on a worker thread, so the engine
        thread never waits for it; a bad one is a 400."""
        if so is None:
            return
        try:
            await asyncio.to_thread(llm.engine.grammar_compiler.get, so)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        metrics.structured_requests.labels(config.model_name, kind or so.kind).inc()

    def constraint_of(req):
        try:
            return req.constraint()
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def params_for(req, prompt_len: int, max_tokens: int | None, logprobs: int | None, so=None):
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if prompt_len >= max_model_len:
            raise APIError(400, f"the prompt has {prompt_len} tokens; the context is {max_model_len} tokens",
                           param="prompt")
        if max_tokens is not None and prompt_len + max_tokens > max_model_len:
            raise APIError(400, f"max_tokens {max_tokens} + prompt {prompt_len} tokens exceeds the context "
                           f"of {max_model_len} tokens", param="max_tokens")
        try:
            return req.sampling_params(max_tokens, logprobs, so)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def choice(req, request: Request) -> tuple[int | None, str | None]:
        """(priority, precision): the request's own, else its API key's class; 400 if not served."""
        priority = req.priority_level or key_priority(request.headers.get("authorization"), config.api_key_classes)
        try:
            return priority, request_precision(req.precision, split_model(req.model, config.model_name)[1],
                                               llm.engine.precisions)
        except ValueError as e:
            raise APIError(400, str(e), param="precision") from None

    def run(prompt_ids, params, choice, rid) -> AsyncIterator:
        stream = llm.generate(prompt_ids, params, rid, choice[0], precision=choice[1])  # queued now: counts for 429

        async def outputs():
            try:
                async for out in stream:
                    yield out
            except ValueError as e:
                raise APIError(400, str(e)) from None
        return outputs()

    async def collect(request: Request, gens: list[AsyncIterator]) -> list:
        """Run to completion, aborting everything if the client goes away."""
        async def last(gen):
            out = None
            async for out in gen:
                pass
            return out
        tasks = [asyncio.ensure_future(last(g)) for g in gens]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=0.5)
                if not pending:
                    return [t.result() for t in tasks]
                if await request.is_disconnected():
                    raise asyncio.CancelledError
        finally:
            for t in tasks:
                t.cancel()

    def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
        async def body():
            try:
                async for chunk in chunks:
                    yield R.sse_event(chunk)
            except APIError as e:
                yield R.error_event(e.message, e.status, e.type)
            except RuntimeError as e:
                yield R.error_event(str(e))
            yield R.SSE_DONE
        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_admission(req.model, req.n)
        prompts = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) else [req.prompt]
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        encoded = [encode(p) for p in prompts]
        so = constraint_of(req)
        params = [params_for(req, len(ids), req.max_tokens, req.logprobs, so) for ids in encoded]
        how = choice(req, request)  # before the compile: a refused precision costs no compile, no count
        await compiled(so)
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), config.model_name
        gens = [run(ids, sp, how, f"{rid}-{i}") for i, (ids, sp) in enumerate(zip(encoded, params))]
        want_lp = req.logprobs is not None
        if not req.stream:
            outs = await collect(request, gens)
            return R.completion_body(rid, model, created, outs, req.n, want_lp, tokenizer)

        async def chunks():
            finals, queue = [None] * len(gens), asyncio.Queue()
            finish_sent = [set() for _ in gens]

            async def pump(i, gen):
                try:
                    async for out in gen:
                        await queue.put((i, out))
                except Exception as e:
                    await queue.put((i, e))
                await queue.put((i, None))
            tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
            try:
                remaining = len(gens)
                while remaining:
                    i, out = await queue.get()
                    if out is None:
                        remaining -= 1
                        continue
                    if isinstance(out, Exception):
                        raise out
                    finals[i] = out
                    chunk = R.completion_chunk(rid, model, created, i, req.n, out, finish_sent[i], want_lp, tokenizer)
                    if chunk:
                        yield chunk
                if req.stream_options and req.stream_options.include_usage:
                    yield {"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": R.usage(finals), "metrics": R.latency_split(finals)}
            finally:
                for t in tasks:
                    t.cancel()
        return sse(chunks())

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_admission(req.model, req.n)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        so = constraint_of(req)
        try:
            tools = plan_tool_calls(req)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from None
        if tools is not None and so is not None:
            raise APIError(400, "tool calls force their own output schema: drop response_format / "
                           "structured_outputs / guided_*, or set tool_choice to 'none'", param="tool_choice")
        try:
            conversation = [m.template_dict() for m in req.messages]
            # Templates that know tools render them; the output schema is forced either way.
            kwargs = {"tools": [t.model_dump() for t in req.tools]} if tools is not None else {}
            text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=req.add_generation_prompt, **kwargs)
        except Exception as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        ids = encode(text)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if tools is not None:
            so = tools.constraint
        params = params_for(req, len(ids), max_tokens, logprobs, so)
        how = choice(req, request)  # before the compile: a refused precision costs no compile, no count
        await compiled(so, "tool_calls" if tools is not None else None)
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), config.model_name
        gen = run(ids, params, how, rid)
        if not req.stream:
            out = (await collect(request, [gen]))[0]
            return R.chat_body(rid, model, created, out, req.logprobs, tokenizer, tools)

        async def chunks():
            first = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None} for i in range(req.n)]}
            yield first
            final, finish_sent = None, set()
            async for out in gen:
                final = out
                chunk = R.chat_chunk(rid, model, created, out, finish_sent, req.logprobs, tokenizer, tools)
                if chunk:
                    yield chunk
            if req.stream_options and req.stream_options.include_usage:
                yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": R.usage([final]), "metrics": R.latency_split([final])}
        return sse(chunks())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": model_cards(config.model_name, llm.engine.precisions, max_model_len)}

    @app.get("/health")
    async def health():
        if not llm.alive:
            return error_response(503, "engine loop is not running", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        if req.messages is not None:
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer")
            text = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages],
                                                 tokenize=False, add_generation_prompt=True)
        elif req.prompt is not None:
            text = req.prompt
        else:
            raise APIError(400, "give `prompt` or `messages`")
        ids = encode(text)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        bad = [t for t in req.tokens if not 0 <= t < llm.engine.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    return app
