"""Request traces as rows: the Azure LLM 2023 CSV, the Mooncake JSONL and the server's own
request log, with malformed lines reported by line number (or rejected in strict mode), and
window selection. Shared by the load tester, the analyzer, the planner and the simulator."""

from __future__ import annotations

import csv
import gzip
import json
import lzma
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
SHIPPED_DIR = (
    Path(__file__).resolve().parent / "data" / "traces"
)  # licences and citations in its README.md
SHIPPED_TRACES = {
    "azure": "azure_llm_2023_conv.csv.xz",
    "mooncake": "mooncake_conversation.jsonl.xz",
}
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
REQUEST_LOG_FIELDS = (
    "arrival_time",
    "prompt_tokens",
    "output_tokens",
)  # written by server/metrics.py


def resolve_trace(name: str | Path) -> Path:
    """A shipped trace's file for its name (azure, mooncake); any other value is a path,
    which must exist."""
    path = SHIPPED_DIR / SHIPPED_TRACES[name] if name in SHIPPED_TRACES else Path(name)
    if not path.is_file():
        raise FileNotFoundError(
            f"trace {path} not found (give a path, or one of: {', '.join(SHIPPED_TRACES)})"
        )
    return path


def _open(path: Path):
    """The trace as text, decompressed when it ends in .xz or .gz."""
    opener = {".xz": lzma.open, ".gz": gzip.open}.get(path.suffix.lower(), open)
    return opener(path, "rt", errors="replace", newline="")


@dataclass(slots=True)
class Row:
    line: int
    arrival: float  # seconds from the trace's first row
    input_len: int
    output_len: int
    hash_ids: list[int] = field(default_factory=list)
    e2e: float | None = None  # measured end-to-end latency (request log only)
    queue_time: float | None = None  # arrival to first schedule (request log only)


class _Lines:
    """Collects malformed lines; in strict mode the first one is an error."""

    def __init__(self, path: Path, strict: bool):
        self.path, self.strict, self.skipped = path, strict, []

    def bad(self, line: int, why: str) -> None:
        if self.strict:
            raise ValueError(
                f"{self.path}:{line}: {why} (run without --strict to skip malformed lines)"
            )
        self.skipped.append({"line": line, "error": why})


def _count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    n = int(value)
    if n < 0:
        raise ValueError(f"{name} is negative ({n})")
    return n


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def read_azure(path: Path, strict: bool = False) -> tuple[list[Row], list[dict]]:
    """TIMESTAMP,ContextTokens,GeneratedTokens rows; arrival = offset from the first good row."""
    lines, rows, first = _Lines(path, strict), [], None
    with _open(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        need = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
        if not header or any(c not in header for c in need):
            raise ValueError(
                f"{path}:1: expected a header with columns {', '.join(need)}, got {header}"
            )
        col = [header.index(c) for c in need]
        while True:
            line = reader.line_num + 1  # where this record starts (an open quote can run on)
            try:
                rec = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                lines.bad(line, f"CSV: {e}")
                continue
            if not rec or rec == [""]:
                continue
            try:
                if len(rec) != len(header):
                    raise ValueError(f"expected {len(header)} fields, got {len(rec)}")
                ts = datetime.fromisoformat(rec[col[0]].strip()).timestamp()
                inp, out = (
                    _count(rec[col[1]].strip(), "ContextTokens"),
                    _count(rec[col[2]].strip(), "GeneratedTokens"),
                )
            except ValueError as e:
                lines.bad(line, str(e))
                continue
            first = ts if first is None else first
            rows.append(Row(line, ts - first, inp, out))
    return rows, lines.skipped


def _json_objects(path: Path, lines: _Lines, fields: tuple[str, ...]) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each JSON line that is an object holding all of `fields`."""
    with _open(path) as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                lines.bad(line, f"JSONDecodeError: {e}")
                continue
            missing = [k for k in fields if k not in rec] if isinstance(rec, dict) else None
            if missing is None or missing:
                lines.bad(
                    line,
                    "not a JSON object"
                    if missing is None
                    else f"missing field(s) {', '.join(missing)}",
                )
                continue
            yield line, rec


def read_mooncake(path: Path, strict: bool = False) -> tuple[list[Row], list[dict]]:
    """JSON lines with timestamp (ms), input_length, output_length, hash_ids."""
    lines, rows, first = _Lines(path, strict), [], None
    for line, rec in _json_objects(path, lines, MOONCAKE_FIELDS):
        try:
            ts = _number(rec["timestamp"], "timestamp")
            ids = rec["hash_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in ids
            ):
                raise ValueError("hash_ids must be a list of integers")
            inp, out = (
                _count(rec["input_length"], "input_length"),
                _count(rec["output_length"], "output_length"),
            )
        except ValueError as e:
            lines.bad(line, str(e))
            continue
        first = ts if first is None else first
        rows.append(Row(line, (ts - first) / 1000.0, inp, out, ids))
    return rows, lines.skipped


def read_request_log(path: Path, strict: bool = False) -> tuple[list[Row], list[dict]]:
    """The server's request log (one JSON line per finished request, in finish order);
    arrival = offset from the earliest arrival_time, e2e and queue_time when present."""
    lines, rows = _Lines(path, strict), []
    for line, rec in _json_objects(path, lines, REQUEST_LOG_FIELDS):
        try:
            ts = _number(rec["arrival_time"], "arrival_time")
            inp, out = (
                _count(rec["prompt_tokens"], "prompt_tokens"),
                _count(rec["output_tokens"], "output_tokens"),
            )
            e2e, queue = (
                _number(rec[k], k) if rec.get(k) is not None else None
                for k in ("e2e_latency", "queue_time")
            )
        except ValueError as e:
            lines.bad(line, str(e))
            continue
        rows.append(Row(line, ts, inp, out, e2e=e2e, queue_time=queue))
    first = min((r.arrival for r in rows), default=0.0)
    return [replace(r, arrival=r.arrival - first) for r in rows], lines.skipped


READERS: dict[str, Callable[[Path, bool], tuple[list[Row], list[dict]]]] = {
    "azure": read_azure,
    "mooncake": read_mooncake,
    "request-log": read_request_log,
}


def trace_format(path: Path) -> str:
    """'azure' for a .csv (or .csv.xz / .csv.gz, or a TIMESTAMP header), else 'mooncake' or
    'request-log' from the fields of the first JSON object among the first lines."""
    compressed = path.suffix.lower() in (".xz", ".gz")
    if (Path(path.stem) if compressed else path).suffix.lower() == ".csv":
        return "azure"
    with _open(path) as f:
        for _, text in zip(range(50), f):
            if text.startswith("TIMESTAMP,"):
                return "azure"
            try:
                rec = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and ("hash_ids" in rec or "timestamp" in rec):
                return "mooncake"
            if isinstance(rec, dict) and ("arrival_time" in rec or "prompt_tokens" in rec):
                return "request-log"
    raise ValueError(
        f"{path}: cannot tell the trace format (Azure CSV, Mooncake JSONL or a tandem "
        f"request log); pass --format"
    )


def read_trace(
    path: Path, strict: bool = False, kind: str = "auto"
) -> tuple[list[Row], list[dict]]:
    """Any supported trace; `kind` 'auto' picks the reader by trace_format()."""
    kind = trace_format(path) if kind == "auto" else kind
    if kind not in READERS:
        raise ValueError(f"unknown trace format {kind!r}; known: auto, {', '.join(READERS)}")
    return READERS[kind](path, strict)


def select(
    rows: list[Row],
    start: float,
    seconds: float | None,
    max_requests: int | None,
    time_scale: float,
) -> list[Row]:
    """Rows arriving in [start, start+seconds) of trace time, the first max_requests of them,
    rebased to the window start and with gaps multiplied by time_scale."""
    if time_scale < 0:
        raise ValueError("--time-scale must be >= 0")
    end = float("inf") if seconds is None else start + seconds
    picked = sorted((r for r in rows if start <= r.arrival < end), key=lambda r: r.arrival)
    picked = picked[:max_requests] if max_requests is not None else picked
    base = picked[0].arrival if picked else 0.0
    return [replace(r, arrival=(r.arrival - base) * time_scale) for r in picked]
