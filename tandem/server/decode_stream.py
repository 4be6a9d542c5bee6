"""A decode leg's SSE stream (completions chunks), which can end in a migration instead of a
finish: asked to move (POST /tandem/migrate), the leg has the engine stop its request and send
the KV of the tokens its client has to the peer it was given (one engine call:
`PDService.migrate_out`), and ends its stream with a `migrate` event carrying those tokens,
then the send's outcome. The router continues the request on the peer from exactly those
tokens, so the client's stream has no token twice and none missing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from tandem.engine.core_messages import CheckKVPeer, KVSent, MigrateOut
from tandem.engine.output_processor import RequestOutput
from tandem.server import responses as R


class DecodeLegs:
    """The decode legs streaming on this instance, by request id."""

    def __init__(self, llm: Any, model: str) -> None:
        self.llm, self.model = llm, model
        self._moves: dict[
            str, asyncio.Future
        ] = {}  # request id -> (transfer id, peer) once asked to move

    async def migrate(self, request_id: str, transfer_id: str, peer: int | None) -> bool:
        """Ask a streaming leg to move; False if none by that id is streaming (or already
        moving). ValueError for a peer this instance has no KV link to."""
        if not self._streaming(request_id):
            return False
        await self.llm.call_utility(CheckKVPeer(peer))  # a bad peer is the caller's error, now
        if not self._streaming(request_id):
            return False
        self._moves[request_id].set_result((transfer_id, peer))
        return True

    def _streaming(self, request_id: str) -> bool:
        move = self._moves.get(request_id)
        return move is not None and not move.done()

    async def stream(
        self, gen: AsyncIterator[RequestOutput], rid: str, prompt: list[int], usage: bool
    ) -> AsyncIterator[str]:
        move = self._moves[rid] = asyncio.get_running_loop().create_future()
        created, final, chunks_sent, nxt, sent = int(time.time()), None, R.Sent(), None, 0
        fmt = R.CompletionFormat(1, R.Tokens(self.llm.tokenizer), None)
        try:
            while True:
                nxt = asyncio.ensure_future(anext(gen))
                await asyncio.wait((nxt, move), return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():  # asked to move
                    break
                final = nxt.result()
                chunk = R.completion_chunk(rid, self.model, created, 0, final, chunks_sent, fmt)
                if (
                    chunk
                ):  # with the leg's token count (the router weighs what a move would free) and the
                    # ids of the tokens out since the last chunk (it resumes a failed leg from them)
                    ids = final.outputs[0].token_ids
                    yield R.sse_event({**chunk, "num_tokens": len(ids), "token_ids": ids[sent:]})
                    sent = len(ids)
                if final.finished:
                    if usage:
                        yield R.sse_event({"id": rid, "choices": [], "usage": R.usage([final])})
                    yield R.SSE_DONE
                    return
            async for line in self._move_out(rid, prompt, final, *move.result()):
                yield line
        except (
            ValueError,
            RuntimeError,
        ) as e:  # refused by the core (on_add gave the KV back), or it is gone
            yield R.error_event(str(e))
            yield R.SSE_DONE
        finally:
            self._moves.pop(rid, None)
            if nxt is not None and not nxt.done():  # moved, or this stream was cancelled mid-wait
                nxt.cancel()
            if nxt is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await nxt
            await gen.aclose()  # leaving the generator aborts the request (a no-op once moved)

    async def _move_out(
        self,
        rid: str,
        prompt: list[int],
        final: RequestOutput | None,
        transfer_id: str,
        peer: int | None,
    ) -> AsyncIterator[str]:
        generated = list(final.outputs[0].token_ids) if final is not None else []
        # The engine aborts the request and exports its KV in one call: no step between the
        # two could evict the blocks the request freed.
        blocks = await self.llm.call_utility(MigrateOut(rid, prompt + generated, transfer_id, peer))
        yield R.sse_event({"migrate": {"token_ids": generated, "kv_blocks": blocks}})
        yield R.sse_event(await send_outcome(self.llm, transfer_id))
        yield R.SSE_DONE


async def send_outcome(llm: Any, transfer_id: str) -> dict:
    """What the router reads about a KV send once it completes (the receiver has taken it)."""
    try:
        return await llm.call_utility(KVSent(transfer_id))
    except Exception as e:  # the engine is gone; the peer's receive times out
        return {"error": f"KV send failed: {type(e).__name__}: {e}"}
