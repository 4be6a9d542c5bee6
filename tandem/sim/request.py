"""A simulated request: its trace figures, its synthetic token ids, and what happened to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.core.block_pool import hash_block

TRACE_BLOCK_TOKENS = 512  # Mooncake hash ids each stand for 512 prompt tokens
_UNIQUE_BASE = 1 << 40  # token ids that make a prompt unlike any other
_SHARED_BASE = 1 << 50  # token ids of trace prefix blocks (equal hash id = equal tokens)


@dataclass(slots=True, eq=False)
class SimRequest:
    index: int
    arrival: float
    prompt_len: int
    output_len: int
    priority: int | None = None  # None: classified by length
    cls: str = "all"
    hash_ids: tuple[int, ...] = ()
    block_tokens: int = TRACE_BLOCK_TOKENS  # prompt tokens a hash id stands for
    # What happened (virtual seconds).
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_output: int = 0
    itl: list[float] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)  # where it ran (prefill first under P/D)
    transfer_s: float = 0.0
    decode_target: Any = None  # P/D: the decode instance holding this request's KV quota
    kv_reservation: Any = None  # P/D: blocks reserved on it for the transferred KV
    error: str | None = None

    def prompt_token_ids(self) -> list[int]:
        """Distinct for every request, except that equal leading trace hash ids give equal
        leading tokens, so the real prefix cache sees the trace's real reuse."""
        ids: list[int] = []
        for h in self.hash_ids:
            if len(ids) >= self.prompt_len:
                break
            ids += [_SHARED_BASE + h] + [0] * (self.block_tokens - 1)
        if len(ids) < self.prompt_len:
            ids += [_UNIQUE_BASE + self.index] + [0] * (self.prompt_len - len(ids) - 1)
        return ids[: self.prompt_len]

    def prefix_hashes(self, block_size: int, max_tokens: int) -> list[int]:
        """Chained block hashes of the prompt's shared part (what prefix-aware routing matches)."""
        if not self.hash_ids:
            return []
        ids, out, parent = self.prompt_token_ids(), [], None
        limit = min(len(self.hash_ids) * self.block_tokens, self.prompt_len - 1, max_tokens)
        for i in range(limit // block_size):
            parent = hash_block(parent, tuple(ids[i * block_size : (i + 1) * block_size]))
            out.append(parent)
        return out

    def on_token(self, t: float) -> None:
        if self.first_token is None:
            self.first_token = t
        else:
            self.itl.append(t - self.last_token)
        self.last_token = t
        self.num_output += 1

    def record(self) -> dict:
        """One result row in the shape `tandem bench serve` reports, so one summary serves both."""
        ok = self.error is None and self.finished is not None
        ttft = self.first_token - self.arrival if ok else None
        e2e = self.finished - self.arrival if ok else None
        tpot = (e2e - ttft) / (self.num_output - 1) if ok and self.num_output > 1 else None
        queue = (
            (self.first_scheduled - self.arrival)
            if ok and self.first_scheduled is not None
            else None
        )
        return {
            "index": self.index,
            "cls": self.cls,
            "success": ok,
            "status": 200 if ok else 400,
            "error": self.error or "",
            "start": self.arrival,
            "ttft": ttft,
            "itl": self.itl if ok else [],
            "tpot": tpot,
            "e2e": e2e,
            "output_tokens": self.num_output,
            "num_chunks": self.num_output,
            "input_len": self.prompt_len,
            "prompt_tokens": self.prompt_len,
            "requested_output": self.output_len,
            "usage_reported": True,
            "metrics": {
                "queue_time": queue,
                "prefill_time": ttft - queue if queue is not None else None,
                "decode_time": e2e - ttft if ok else None,
            }
            if ok
            else None,
        }
