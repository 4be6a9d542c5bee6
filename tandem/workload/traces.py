"""Production request traces as rows: the Azure LLM 2023 CSV and the Mooncake JSONL, with
malformed lines reported by line number (or rejected in strict mode), and window selection.
Shared by the load tester, the analyzer, the planner and the simulator."""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
DEFAULT_FILES = {"azure": "azure_llm_2023_conv.csv", "mooncake": "mooncake_conversation.jsonl"}


@dataclass
class Row:
    line: int
    arrival: float  # seconds from the trace's first row
    input_len: int
    output_len: int
    hash_ids: list[int] = field(default_factory=list)


class _Lines:
    """Collects malformed lines; in strict mode the first one is an error."""

    def __init__(self, path: Path, strict: bool):
        self.path, self.strict, self.skipped = path, strict, []

    def bad(self, line: int, why: str) -> None:
        if self.strict:
            raise ValueError(f"{self.path}:{line}: {why} (run without --strict to skip malformed lines)")
        self.skipped.append({"line": line, "error": why})


def _count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    n = int(value)
    if n < 0:
        raise ValueError(f"{name} is negative ({n})")
    return n


def read_azure(path: Path, strict: bool = False) -> tuple[list[Row], list[dict]]:
    """TIMESTAMP,ContextTokens,GeneratedTokens rows; arrival = offset from the first good row."""
    lines, rows, first = _Lines(path, strict), [], None
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        need = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
        if not header or any(c not in header for c in need):
            raise ValueError(f"{path}:1: expected a header with columns {', '.join(need)}, got {header}")
        col = [header.index(c) for c in need]
        for rec in reader:
            line = reader.line_num
            if not rec or rec == [""]:
                continue
            try:
                if len(rec) != len(header):
                    raise ValueError(f"expected {len(header)} fields, got {len(rec)}")
                ts = datetime.fromisoformat(rec[col[0]].strip()).timestamp()
                inp, out = _count(rec[col[1]].strip(), "ContextTokens"), _count(rec[col[2]].strip(), "GeneratedTokens")
            except ValueError as e:
                lines.bad(line, str(e))
                continue
            first = ts if first is None else first
            rows.append(Row(line, ts - first, inp, out))
    return rows, lines.skipped


def read_mooncake(path: Path, strict: bool = False) -> tuple[list[Row], list[dict]]:
    """JSON lines with timestamp (ms), input_length, output_length, hash_ids."""
    lines, rows, first = _Lines(path, strict), [], None
    with open(path) as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
                if not isinstance(rec, dict):
                    raise ValueError("not a JSON object")
                missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in rec]
                if missing:
                    raise ValueError(f"missing field(s) {', '.join(missing)}")
                ts = rec["timestamp"]
                if isinstance(ts, bool) or not isinstance(ts, (int, float)):
                    raise ValueError(f"timestamp must be a number, got {ts!r}")
                ids = rec["hash_ids"]
                if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
                    raise ValueError("hash_ids must be a list of integers")
                inp, out = _count(rec["input_length"], "input_length"), _count(rec["output_length"], "output_length")
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                lines.bad(line, f"{type(e).__name__}: {e}" if isinstance(e, json.JSONDecodeError) else str(e))
                continue
            first = ts if first is None else first
            rows.append(Row(line, (ts - first) / 1000.0, inp, out, ids))
    return rows, lines.skipped


def select(rows: list[Row], start: float, seconds: float | None, max_requests: int | None,
           time_scale: float) -> list[Row]:
    """Rows arriving in [start, start+seconds) of trace time, the first max_requests of them,
    rebased to the window start and with gaps multiplied by time_scale."""
    if time_scale < 0:
        raise ValueError("--time-scale must be >= 0")
    end = float("inf") if seconds is None else start + seconds
    picked = sorted((r for r in rows if start <= r.arrival < end), key=lambda r: r.arrival)
    picked = picked[:max_requests] if max_requests is not None else picked
    base = picked[0].arrival if picked else 0.0
    return [Row(r.line, (r.arrival - base) * time_scale, r.input_len, r.output_len, r.hash_ids) for r in picked]
