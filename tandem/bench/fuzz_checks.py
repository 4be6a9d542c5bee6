"""What `tandem bench fuzz` checks beside the fuzzing itself: the server still serving a plain
request afterwards, and a response stored with one key private to it."""

from __future__ import annotations

import httpx


def serving(url: str, headers: dict, model: str | None = None) -> bool:
    """The server still answers a plain request."""
    try:
        if httpx.get(url + "/health", timeout=30, trust_env=False).status_code != 200:
            return False
        body = {"prompt": [1, 2, 3], "max_tokens": 2, **({"model": model} if model else {})}
        return (
            httpx.post(
                url + "/v1/completions", json=body, headers=headers, timeout=30, trust_env=False
            ).status_code
            == 200
        )
    except httpx.HTTPError:
        return False


def stored_response_private(url: str, key: str, other_key: str) -> bool:
    """A response stored with `key` is read with it, and is a 404 to `other_key`, as its
    deletion is."""

    def call(method: str, path: str, who: str, **kw) -> httpx.Response:
        auth = {"Authorization": f"Bearer {who}"}
        return httpx.request(method, url + path, headers=auth, timeout=60, trust_env=False, **kw)

    body = {"input": "hi", "max_output_tokens": 2, "store": True}
    made = call("POST", "/v1/responses", key, json=body)
    if made.status_code != 200:
        return False
    path = f"/v1/responses/{made.json()['id']}"
    return (
        call("GET", path, other_key).status_code == 404
        and call("DELETE", path, other_key).status_code == 404
        and call("GET", path, key).status_code == 200
    )
