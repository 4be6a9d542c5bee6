"""The Responses API's store: bounded in count, bytes and time (oldest dropped first), and each
response readable and deletable only with the key that created it."""

from __future__ import annotations

from tandem.server.response_store import ResponseStore


def put(store: ResponseStore, rid: str, key: str | None = "k", text: str = "x") -> bool:
    return store.put(key, {"id": rid, "text": text}, [{"role": "user", "content": text}])


def test_only_the_creating_key_reads_or_deletes():
    store = ResponseStore(10, 1 << 20, 60)
    put(store, "r1", "k")
    assert store.get("k", "r1").body["id"] == "r1"
    assert store.get("other", "r1") is None and store.get(None, "r1") is None
    assert not store.delete("other", "r1") and store.get("k", "r1") is not None
    assert store.delete("k", "r1") and store.get("k", "r1") is None
    put(store, "open", None)  # a server without keys: no key reads it
    assert store.get(None, "open") is not None and store.get("k", "open") is None


def test_count_bytes_and_time_bounds_drop_the_oldest(monkeypatch):
    store = ResponseStore(2, 1 << 20, 60)
    for rid in ("a", "b", "c"):
        put(store, rid)
    assert [r for r in "abc" if store.get("k", r)] == ["b", "c"]
    small = ResponseStore(10, 300, 60)
    put(small, "a", text="x" * 100)
    assert put(small, "b", text="x" * 100)
    assert small.get("k", "a") is None and small.get("k", "b") is not None
    assert not put(small, "huge", text="x" * 1000)  # larger than the store: not kept, none dropped
    assert small.get("k", "huge") is None and small.get("k", "b") is not None
    clock = [100.0]
    monkeypatch.setattr("tandem.server.response_store.time.monotonic", lambda: clock[0])
    timed = ResponseStore(10, 1 << 20, 60)
    put(timed, "a")
    clock[0] += 30
    put(timed, "b")
    clock[0] += 31
    assert timed.get("k", "a") is None and timed.get("k", "b") is not None
