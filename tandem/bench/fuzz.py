"""`tandem bench fuzz`: API fuzzing driven by the server's own OpenAPI document (schemathesis).
Every operation gets bodies generated from its schema (positive), bodies that break it (wrong
types, out-of-range values: negative), and hostile raw bodies no schema describes (deep
nesting, bad UTF-8, duplicate keys, huge and negative numbers, long strings, truncated JSON).
It counts the answers, by operation too: the goal is no 5xx, none without an answer within
--timeout, the server serving afterwards and, given a second key, a response stored with one key
a 404 to the other. Only loopback targets."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from urllib.parse import urlparse

import httpx

from tandem.bench.fuzz_checks import serving, stored_response_private

HUGE = [10**400, -(10**400), 2**64, -(2**63) - 1, 1e308, -1, 0, 2**31]
LONG = "\u00e9" * 200_000


def hostile_values() -> list:
    """What a field gets in a hostile body (beside its schema's wrong types)."""
    deep: object = 1
    for _ in range(200):
        deep = {"a": [deep]}
    return [*HUGE, LONG, deep, [{"": None}] * 10_000, "\x00", True, None, "", []]


def hostile_raw(fields: list[str], rng: random.Random) -> tuple[bytes, str]:
    """A raw body no JSON schema generator writes, and its content type."""
    name = rng.choice(fields) if fields else "x"
    kind = rng.randrange(8)
    if kind == 0:
        return b'{"' + name.encode() + b'": "\xff\xfe\xc3\x28"}', "application/json"  # bad UTF-8
    if kind == 1:
        return (
            f'{{"{name}": 1, "{name}": "two", "{name}": [3]}}'.encode(),
            "application/json",
        )  # duplicate keys
    if kind == 2:
        d = rng.choice([1000, 100_000])
        return (
            f'{{"{name}": ' + "[" * d + "]" * d + "}"
        ).encode(), "application/json"  # deep nesting
    if kind == 3:
        return (
            f'{{"{name}": '
            f"{rng.choice(['1e999', '-1e999', 'NaN', 'Infinity', '9' * 5000])}}}".encode(),
            "application/json",
        )
    if kind == 4:
        return b'{"' + name.encode() + b'": "abc', "application/json"  # truncated
    if kind == 5:
        return rng.choice([b"", b"null", b"[]", b"0", b'"x"']), "application/json"
    if kind == 6:
        return json.dumps({name: "x"}).encode(), rng.choice(
            ["text/plain", "application/x-www-form-urlencoded"]
        )
    return json.dumps({name: rng.choice(hostile_values())}).encode(), "application/json"


class Tally:
    """Answers by status, and the cases that got a 5xx or no answer in time."""

    def __init__(self) -> None:
        self.statuses: Counter = Counter()
        self.by_path: dict[str, Counter] = {}  # "METHOD /path" -> its answers by status
        self.server_errors: list[dict] = []
        self.unanswered: list[dict] = []
        self.slowest = 0.0

    def add(self, where: str, status: int | None, seconds: float, detail: str) -> None:
        self.slowest = max(self.slowest, seconds)
        path = where.split(" ", 1)[1]  # the mode goes: positive, negative or raw
        self.by_path.setdefault(path, Counter())[str(status or "none")] += 1
        if status is None:
            self.unanswered.append({"where": where, "error": detail[:300]})
            self.statuses["none"] += 1
            return
        self.statuses[str(status)] += 1
        if status >= 500:
            self.server_errors.append({"where": where, "status": status, "body": detail[:300]})

    @property
    def cases(self) -> int:
        return sum(self.statuses.values())


def fuzz_schema(
    url: str,
    doc: dict,
    per_operation: int,
    seed: int,
    headers: dict,
    timeout: float,
    tally: Tally,
    progress=None,
    model: str | None = None,
) -> None:
    """Positive and negative cases from each operation's schema, seeded; a positive body that
    names a model names `model`, the served one, so that it gets past the model check."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_dict(doc)
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            # `one` runs at once below, while `where` still names this operation and mode
            where = f"{mode.value} {op.label}"
            pin = model if mode is schemathesis.GenerationMode.POSITIVE else None

            @hseed(seed)
            @settings(
                max_examples=per_operation,
                database=None,
                deadline=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(op.as_strategy(generation_mode=mode))
            def one(case) -> None:
                if pin and isinstance(case.body, dict) and "model" in case.body:  # noqa: B023
                    case.body["model"] = pin  # noqa: B023
                start = time.monotonic()
                try:
                    r = case.call(base_url=url, headers=headers, timeout=timeout)
                    tally.add(where, r.status_code, time.monotonic() - start, r.text)  # noqa: B023
                except Exception as e:  # no answer within the timeout, or the connection dropped
                    tally.add(where, None, time.monotonic() - start, repr(e))  # noqa: B023
                if progress:
                    progress()

            try:
                one()
            except Unsatisfiable:  # nothing to break: an operation without parameters or body
                pass


def fuzz_raw(
    url: str,
    operations: list[tuple[str, list[str]]],
    per_operation: int,
    seed: int,
    headers: dict,
    timeout: float,
    tally: Tally,
    progress=None,
) -> None:
    """Hostile raw bodies to each POST operation (path, its body's field names)."""
    rng = random.Random(seed)
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        for path, fields in operations:
            for _ in range(per_operation):
                body, content_type = hostile_raw(fields, rng)
                start = time.monotonic()
                try:
                    r = client.post(
                        url + path, content=body, headers={**headers, "content-type": content_type}
                    )
                    tally.add(f"raw POST {path}", r.status_code, time.monotonic() - start, r.text)
                except httpx.HTTPError as e:
                    tally.add(f"raw POST {path}", None, time.monotonic() - start, repr(e))
                if progress:
                    progress()


def post_operations(doc: dict) -> list[tuple[str, list[str]]]:
    """(path, field names) of each POST operation with a JSON body, from the OpenAPI document."""
    out = []
    for path, ops in doc["paths"].items():
        body = ops.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if body is not None:
            name = body["schema"].get("$ref", "").rsplit("/", 1)[-1]
            out.append(
                (path, sorted(doc["components"]["schemas"].get(name, {}).get("properties", {})))
            )
    return out


def run_fuzz(
    url: str,
    cases: int,
    seed: int = 0,
    api_key: str | None = None,
    timeout: float = 30.0,
    progress=None,
    other_api_key: str | None = None,
) -> dict:
    """About `cases` requests spread over every operation (a third positive, a third negative,
    a third hostile raw bodies on the POST ones); the report of what came back. With a second
    key, also whether a stored response stays private to the key that made it."""
    if urlparse(url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"bench fuzz only targets loopback, not {url}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    doc = httpx.get(url + "/openapi.json", headers=headers, trust_env=False).json()
    num_ops = sum(len(ops) for ops in doc["paths"].values())
    posts = post_operations(doc)
    per_op = max(1, cases // (3 * num_ops))
    models = httpx.get(url + "/v1/models", headers=headers, trust_env=False).json()["data"]
    tally, start = Tally(), time.monotonic()
    fuzz_schema(url, doc, per_op, seed, headers, timeout, tally, progress, models[0]["id"])
    fuzz_raw(
        url,
        posts,
        max(1, (cases - tally.cases) // max(len(posts), 1)),
        seed,
        headers,
        timeout,
        tally,
        progress,
    )
    return {
        "cases": tally.cases,
        "operations": num_ops,
        "seed": seed,
        "statuses": dict(tally.statuses),
        "server_errors": tally.server_errors,
        "unanswered": tally.unanswered,
        "slowest_s": round(tally.slowest, 3),
        "seconds": round(time.monotonic() - start, 1),
        "serving_after": serving(url, headers),
        "stored_response_private": (
            stored_response_private(url, api_key, other_api_key)
            if api_key and other_api_key
            else None
        ),
        "by_path": {path: dict(counts) for path, counts in sorted(tally.by_path.items())},
    }


def main(args: argparse.Namespace) -> None:
    report = run_fuzz(
        args.url.rstrip("/"),
        args.cases,
        args.seed,
        args.api_key,
        args.timeout,
        other_api_key=args.other_api_key,
    )
    text = json.dumps(report, indent=2)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)
    ok = (
        not report["server_errors"]
        and not report["unanswered"]
        and report["serving_after"]
        and report["stored_response_private"] is not False
    )
    sys.exit(0 if ok else 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="a running `tandem serve` on loopback"
    )
    p.add_argument("--cases", type=int, default=3000, help="requests in all (default 3000)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the generated cases: the same seed sends the same requests (default 0)",
    )
    p.add_argument(
        "--api-key", default=None, help="bearer key the server at --url expects (default: none)"
    )
    p.add_argument(
        "--other-api-key",
        default=None,
        help="a second key the server accepts: a response stored with --api-key must be a 404 "
        "to it (default: not checked)",
    )
    p.add_argument(
        "--timeout", type=float, default=30.0, help="seconds a request may take to be answered"
    )
    p.add_argument("--output", default=None, help="also write the JSON report here")
