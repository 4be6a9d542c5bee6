"""The Responses API's stored responses, for `previous_response_id` and GET /v1/responses/{id}:
kept in memory for a bounded time, count and size (oldest dropped first), each readable only
with the API key that created it (another key gets the 404 an unknown id gets)."""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class StoredResponse:
    owner: str  # a hash of the creating key ("" on a server without keys)
    body: dict  # the response object, as answered
    messages: list[dict]  # the conversation so far, as chat messages (instructions aside)
    size: int  # bytes it is counted as
    expires: float  # time.monotonic()


def owner_of(key: str | None) -> str:
    return hashlib.sha256(key.encode()).hexdigest() if key else ""


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int, ttl_s: float) -> None:
        self.max_count, self.max_bytes, self.ttl_s = max_count, max_bytes, ttl_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def put(self, key: str | None, body: dict, messages: list[dict]) -> bool:
        """Whether it is kept: not one larger than the whole store."""
        size = len(json.dumps(body)) + len(json.dumps(messages))
        if size > self.max_bytes:
            return False
        self._entries[body["id"]] = StoredResponse(
            owner_of(key), body, messages, size, time.monotonic() + self.ttl_s
        )
        self._bytes += size
        self._drop(time.monotonic())
        return True

    def get(self, key: str | None, response_id: str) -> StoredResponse | None:
        """The entry, if it is there, alive and the key's; else None."""
        self._drop(time.monotonic())
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner_of(key) else None

    def delete(self, key: str | None, response_id: str) -> bool:
        if self.get(key, response_id) is None:
            return False
        self._bytes -= self._entries.pop(response_id).size
        return True

    def _drop(self, now: float) -> None:
        """The expired ones, then the oldest while over a bound."""
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if (
                oldest.expires > now
                and len(self._entries) <= self.max_count
                and self._bytes <= self.max_bytes
            ):
                return
            self._bytes -= self._entries.popitem(last=False)[1].size
