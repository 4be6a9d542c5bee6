"""CUDA graphs for decode-only steps: a decode step launches a few kernels per layer, each too
short to hide its launch, so at small batches the GPU waits on the CPU. At start the model
(forward and LM head) is captured once per bucketed batch size over persistent input buffers
(input ids, positions, slot mapping, block tables, sequence lengths); a decode step is
copied into the smallest bucket that holds it (padding rows write no KV: slot -1) and
replayed. Mixed steps, and batches above the largest bucket, run eagerly."""

from __future__ import annotations

import logging
import time

import torch

from tandem.config import AttentionBackend
from tandem.executor.attention import AttentionMetadata

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then every 32 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [s for s in (1, 2, 4, 8, 16, 32) if s < max_num_seqs] + list(
        range(64, max_num_seqs, 32)
    )
    return sizes + [max_num_seqs]


def capture_graphs(
    model,
    kv_caches: list[torch.Tensor],
    block_size: int,
    max_len: int,
    max_num_seqs: int,
    device: torch.device,
    attention_backend: AttentionBackend,
    enforce_eager: bool,
) -> CUDAGraphRunner | None:
    """The default variant's decode graphs (requests up to `max_len` tokens), captured now, where
    they run: CUDA with the Triton backend, unless enforce_eager (or the default variant fell
    back: `model` None)."""
    if (
        device.type != "cuda"
        or attention_backend != AttentionBackend.TRITON
        or enforce_eager
        or model is None
    ):
        return None
    runner = CUDAGraphRunner(
        model, kv_caches, block_size, -(-max_len // block_size), max_num_seqs, device
    )
    runner.capture()
    return runner


class CUDAGraphRunner:
    """Captured decode graphs of one model; `run` replays the one that fits a step."""

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_blocks_per_seq: int,
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        i64 = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i64)
        self.seq_lens = torch.ones(n, **i64)
        self.query_start_loc = torch.arange(n + 1, **i64)  # one query token per row, always
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(
            self.slot_mapping[:b],
            self.block_tables[:b],
            self.seq_lens[:b],
            self.query_start_loc[: b + 1],
            num_decodes=b,
            decodes=[],
            prefills=[],
            block_size=self.block_size,
            triton=True,
            max_query_len=1,
        )
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest batch first, all in one memory pool (a smaller graph reuses the larger's
        memory)."""
        torch.cuda.synchronize()
        start, before = time.perf_counter(), torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            self._forward(b)  # compiles the kernels for this shape; writes only slot -1 (nothing)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(b)
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = torch.cuda.memory_reserved() - before
        log.info(
            "CUDA graphs: %d decode batch sizes (%d..%d) captured in %.1f s, %.0f MiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            self.capture_seconds,
            self.capture_bytes / 2**20,
        )

    def bucket(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Logits [num_seqs, vocab] of a decode-only step, or None when no graph fits it."""
        n = meta.seq_lens.shape[0]
        b = self.bucket(n) if meta.num_decodes == n else None
        if b is None or meta.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        graph, logits = self.graphs[b]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if n < b:  # rows of an earlier, larger step: make them padding (no KV write, one key read)
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
        graph.replay()
        return logits[:n]
