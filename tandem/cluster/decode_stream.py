"""A decode leg's SSE stream (completions chunks), which can end in a migration instead of a
finish: asked to move (POST /tandem/migrate), the leg stops its request, sends the KV of the
tokens so far to the peer it was given, and ends its stream with a `migrate` event carrying the
tokens it streamed, then the send's outcome. The router continues the request on the peer from
exactly those tokens, so the client's stream has no token twice and none missing."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from tandem.engine.output_processor import RequestOutput
from tandem.server import responses as R

if TYPE_CHECKING:
    from tandem.executor.kv_transfer import KVLinks

class DecodeLegs:
    """The decode legs streaming on this instance, by request id."""

    def __init__(self, llm: Any, links: KVLinks, model: str, spawn: Callable[[Any], asyncio.Task]) -> None:
        self.llm, self.links, self.model, self.spawn = llm, links, model, spawn
        self._moves: dict[str, asyncio.Future] = {}  # request id -> (transfer id, peer) once asked to move

    def migrate(self, request_id: str, transfer_id: str, peer: int | None) -> bool:
        """Ask a streaming leg to move; False if none by that id is streaming (or already moving)."""
        move = self._moves.get(request_id)
        if move is None or move.done():
            return False
        self.links.connector(peer)  # a bad peer is the caller's error, now
        move.set_result((transfer_id, peer))
        return True

    async def stream(self, gen: AsyncIterator[RequestOutput], rid: str, prompt: list[int],
                     usage: bool) -> AsyncIterator[str]:
        move = self._moves[rid] = asyncio.get_running_loop().create_future()
        created, final, finish_sent, nxt = int(time.time()), None, set(), None
        try:
            while True:
                nxt = asyncio.ensure_future(anext(gen))
                await asyncio.wait((nxt, move), return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():  # asked to move: leaving the generator aborts the request
                    nxt.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await nxt
                    break
                final = nxt.result()
                chunk = R.completion_chunk(rid, self.model, created, 0, 1, final, finish_sent, False,
                                           self.llm.tokenizer)
                if chunk:  # with the leg's token count: the router weighs what a move would free
                    yield R.sse_event({**chunk, "num_tokens": len(final.outputs[0].token_ids)})
                if final.finished:
                    if usage:
                        yield R.sse_event({"id": rid, "choices": [], "usage": R.usage([final])})
                    yield R.SSE_DONE
                    return
            async for line in self._move_out(rid, prompt, final, *move.result()):
                yield line
        except (ValueError, RuntimeError) as e:
            yield R.error_event(str(e))
            yield R.SSE_DONE
        finally:
            self._moves.pop(rid, None)
            if nxt is not None and not nxt.done():  # this stream was cancelled mid-wait
                nxt.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await nxt
            await gen.aclose()

    async def _move_out(self, rid: str, prompt: list[int], final: RequestOutput | None, transfer_id: str,
                        peer: int | None) -> AsyncIterator[str]:
        generated = list(final.outputs[0].token_ids) if final is not None else []
        tokens = prompt + generated

        def export(engine: Any):
            # The abort above may still be queued: abort here too, so no step runs between the
            # request freeing its blocks and their export (one could evict them).
            engine.abort_request(rid)
            return engine.kv_handoff.export(tokens)
        payload = await self.llm.call(export)
        sending = self.spawn(self.links.send(peer, transfer_id, payload))
        yield R.sse_event({"migrate": {"token_ids": generated, "kv_blocks": payload.num_blocks}})
        yield R.sse_event(await send_outcome(sending))
        yield R.SSE_DONE


async def send_outcome(sending: asyncio.Future) -> dict:
    """What the router reads about a KV send once it completes (the receiver has taken it)."""
    try:
        stats = await sending
        return {"kv_bytes": stats.num_bytes, "kv_seconds": stats.seconds}
    except Exception as e:  # the peer went away or the link broke; its receive times out
        return {"error": f"KV send failed: {type(e).__name__}: {e}"}
