"""The client of `tandem bench serve`: sends each request on its arrival schedule as a
streaming OpenAI request and times it from the SSE stream (TTFT, ITL, TPOT, E2E)."""

from __future__ import annotations

import asyncio
import json
import time

from tandem.bench.workloads import Request


def _body(args, req: Request) -> dict:
    body = {
        "model": args.model,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if req.priority is not None:
        body["priority"] = req.priority
    return body


async def _stream(
    client, path: str, body: dict, headers: dict, chat: bool, out: dict, t0: float
) -> None:
    """POST one streaming request and fill `out` (times are seconds after t0)."""
    async with client.stream("POST", path, json=body, headers=headers) as resp:
        out["status"] = resp.status_code
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            out["error"] = f"HTTP {resp.status_code}: {text[:500]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out["done"] = True
                return
            chunk = json.loads(data)
            now = time.perf_counter() - t0
            if "error" in chunk:
                out["error"] = f"stream error: {json.dumps(chunk['error'])[:500]}"
                return
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    out["chunks"].append(now)
                    break
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            if isinstance(chunk.get("metrics"), dict):
                out["metrics"] = chunk["metrics"]


async def _one(client, args, req: Request, t0: float, sem, bar) -> dict:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    out = {"chunks": [], "usage": None, "metrics": None, "status": None, "error": "", "done": False}
    async with sem:
        start = time.perf_counter() - t0
        try:
            await asyncio.wait_for(
                _stream(client, path, _body(args, req), headers, args.endpoint == "chat", out, t0),
                args.request_timeout,
            )
        except (asyncio.TimeoutError, TimeoutError):
            out["error"] = f"timeout after {args.request_timeout:g}s"
        except Exception as e:  # noqa: BLE001 - any transport or protocol failure fails the request
            out["error"] = f"{type(e).__name__}: {e}"
        end = time.perf_counter() - t0
    bar.update(1)
    usage = out["usage"] or {}
    chunks = [c - start for c in out["chunks"]]
    ok = not out["error"] and out["done"] and bool(chunks)
    if not out["error"] and not ok:
        out["error"] = "stream ended before [DONE]" if not out["done"] else "stream carried no text"
    n_out = usage.get("completion_tokens", len(chunks)) if ok else 0
    ttft = chunks[0] if ok else None
    return {
        "index": req.index,
        "cls": req.cls,
        "success": ok,
        "status": out["status"],
        "error": out["error"],
        "start": start,
        "end": end,
        "e2e": end - start if ok else None,
        "ttft": ttft,
        "itl": [b - a for a, b in zip(chunks, chunks[1:])] if ok else [],
        "tpot": (end - start - ttft) / (n_out - 1) if ok and n_out > 1 else None,
        "chunk_times": chunks,
        "num_chunks": len(chunks),
        "output_tokens": n_out,
        "usage_reported": bool(out["usage"]),
        "input_len": req.input_len,
        "prompt_tokens": usage.get("prompt_tokens"),
        "requested_output": req.output_len,
        "hash_ids": list(req.hash_ids),
        "block_tokens": req.block_tokens,
        "metrics": out["metrics"],
    }


async def run_requests(args, base_url: str, requests: list[Request]) -> tuple[list[dict], float]:
    """Send `requests` at their arrival times, --max-concurrency at most in flight: the
    per-request records in index order and the run's duration in seconds."""
    import httpx
    from tqdm import tqdm

    conc = args.max_concurrency or len(requests)
    sem = asyncio.Semaphore(max(1, conc))
    limits = httpx.Limits(max_connections=max(1, conc), max_keepalive_connections=max(1, conc))
    timeout = httpx.Timeout(args.request_timeout)
    tasks = []
    with tqdm(
        total=len(requests), desc=f"bench {base_url}", unit="req", disable=args.quiet or None
    ) as bar:
        async with httpx.AsyncClient(
            base_url=base_url, timeout=timeout, limits=limits, trust_env=False
        ) as client:
            t0 = time.perf_counter()
            for req in sorted(requests, key=lambda r: r.arrival):
                delay = t0 + req.arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_one(client, args, req, t0, sem, bar)))
            results = await asyncio.gather(*tasks)
            duration = time.perf_counter() - t0
    return sorted(results, key=lambda r: r["index"]), duration
