"""The Triton KV write and unified paged attention agree with the PyTorch reference
(executor/attention.py) on mixed batches: decodes and prefill chunks with and without a
cached prefix, GQA, head_dim 32/64/128 (256 with a sliding window), block sizes 16/32, sliding
windows. On CPU they run under
TRITON_INTERPRET=1 (set by conftest.py when there is no GPU), on tiny shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.executor import triton_attention
from tandem.executor.attention import AttentionMetadata, TorchAttention, build_attention_metadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _interpreter_runs_loops() -> bool:
    """Triton 3.6's interpreter cannot take a loop bound read at run time under numpy 2 (its
    tensors' __index__ is int() of a 1-element array); 3.9's can. Compiled kernels are
    unaffected."""
    if DEVICE.type == "cuda" or not triton_attention.available():
        return True
    import triton
    import triton.language as tl

    @triton.jit
    def loop(n_ptr, out_ptr):
        total = 0
        for _ in range(0, tl.load(n_ptr)):
            total += 1
        tl.store(out_ptr, total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        loop[(1,)](torch.tensor([3], dtype=torch.int32), out)
    except Exception:
        return False
    return int(out) == 3


pytestmark = [
    pytest.mark.skipif(
        not triton_attention.available(),
        reason="triton is not installed: the Triton kernels are untested here",
    ),
    pytest.mark.skipif(
        not _interpreter_runs_loops(),
        reason="this triton's interpreter fails on run-time loop bounds (3.6 does; 3.9 runs them)",
    ),
]


def _batch(
    query_lens: list[int], context_lens: list[int], bs: int, num_blocks: int, g: torch.Generator
):
    """Block tables (random distinct blocks), seq lens, query_start_loc and slot mapping for
    sequences with `context_lens` cached tokens and `query_lens` new ones, decodes first."""
    seq_lens = torch.tensor([c + q for c, q in zip(context_lens, query_lens)])
    max_blocks = (int(seq_lens.max()) + bs - 1) // bs
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = perm[: len(query_lens) * max_blocks].view(len(query_lens), max_blocks)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.long)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    seq = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    slots = block_tables[seq, positions // bs] * bs + positions % bs
    return block_tables, seq_lens, qsl, slots


def _reference_meta(block_tables, seq_lens, qsl, slots, query_lens, bs) -> AttentionMetadata:
    """The metadata the model runner builds for TorchAttention's PyTorch path (no native kernel)."""
    return build_attention_metadata(
        block_tables.numpy(), seq_lens.numpy(), np.array(query_lens), slots.numpy(), bs, DEVICE
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,bs", [(4, 2, 32, 16), (6, 2, 64, 32), (4, 4, 128, 16), (4, 2, 64, 4)]
)
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        # decodes (short and block-crossing contexts), a chunk after a cached prefix, a fresh prompt
        # longer than one program's query tile
        ([1, 1, 1, 7, 40], [0, 16, 40, 33, 0]),
        ([1, 1, 1], [3, 16, 50]),  # decode only: the CUDA-graph shape
    ],
    ids=["mixed", "decode"],
)
def test_unified_attention_matches_torch_reference(
    dtype, tol, heads, kv_heads, head_dim, bs, query_lens, context_lens
):
    g = torch.Generator().manual_seed(0)
    num_blocks = 512 // bs
    block_tables, seq_lens, qsl, slots = _batch(query_lens, context_lens, bs, num_blocks, g)
    t = sum(query_lens)
    q, k, v = (
        torch.randn(t, h, head_dim, generator=g).to(dtype).to(DEVICE)
        for h in (heads, kv_heads, kv_heads)
    )
    cache = torch.randn(2, num_blocks * bs, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)

    ref_cache = cache.clone()
    meta = _reference_meta(block_tables, seq_lens, qsl, slots, query_lens, bs)
    ref = (
        TorchAttention(heads, kv_heads, head_dim)
        .forward(q, k, v, ref_cache, meta)
        .view(t, heads, head_dim)
    )

    triton_attention.reshape_and_cache(k, v, cache, meta.slot_mapping)
    assert torch.equal(cache, ref_cache)  # every new token landed in its slot, nothing else moved
    out = triton_attention.unified_attention(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        max(query_lens),
        bs,
        head_dim**-0.5,
    )
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (4, 1, 256)])
@pytest.mark.parametrize("window", [5, 20])
def test_sliding_window_matches_torch_reference(heads, kv_heads, head_dim, window):
    """A sliding-window layer: windows shorter than the chunks and contexts, in fp32."""
    g = torch.Generator().manual_seed(1)
    bs, query_lens, context_lens = 8, [1, 1, 9, 30], [3, 40, 33, 0]
    block_tables, seq_lens, qsl, slots = _batch(query_lens, context_lens, bs, 64, g)
    t = sum(query_lens)
    q, k, v = (
        torch.randn(t, h, head_dim, generator=g).to(DEVICE) for h in (heads, kv_heads, kv_heads)
    )
    cache = torch.randn(2, 64 * bs, kv_heads, head_dim, generator=g).to(DEVICE)
    meta = _reference_meta(block_tables, seq_lens, qsl, slots, query_lens, bs)
    attn = TorchAttention(heads, kv_heads, head_dim, scale=0.1, sliding_window=window)
    ref = attn.forward(q, k, v, cache.clone(), meta).view(t, heads, head_dim)
    triton_attention.reshape_and_cache(k, v, cache, meta.slot_mapping)
    out = triton_attention.unified_attention(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        max(query_lens),
        bs,
        0.1,
        window,
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_kv_write_skips_padding_slots():
    """A CUDA-graph batch pads with slot -1: those tokens write nothing."""
    k = torch.ones(3, 2, 32, device=DEVICE)
    cache = torch.zeros(2, 16, 2, 32, device=DEVICE)
    triton_attention.reshape_and_cache(k, 2 * k, cache, torch.tensor([5, -1, 0], device=DEVICE))
    assert cache[0, 5].eq(1).all() and cache[1, 0].eq(2).all()
    assert cache[:, [i for i in range(16) if i not in (0, 5)]].eq(0).all()


# head_dim 16 (GQA) and 32; Gemma 3 (sliding windows shorter than the prompts) takes ~30 s
# interpreted
@pytest.mark.parametrize("kind", ["llama", "qwen3", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_engine_on_triton_matches_hf(kind, tiny_model_dirs):
    """Through the model runner: mixed batches, chunked prefill and prefix hits on the Triton
    backend give transformers' greedy tokens."""
    from conftest import hf_greedy

    from tandem import LLM, SamplingParams

    shared = list(range(100, 140))
    prompts = [[(7 * i + j) % 512 for j in range(n)] for i, n in enumerate([5, 30, 61])] + [
        shared + [1, 2, 3]
    ]
    ref = hf_greedy(tiny_model_dirs[kind], prompts + [shared + [4, 5]], 6)
    llm = LLM(
        tiny_model_dirs[kind],
        dtype="float32",
        device=str(DEVICE),
        kv_cache_memory=1 << 22,
        block_size=8,
        max_num_batched_tokens=32,
        attention_backend="triton",
    )
    assert llm.engine.core.executor.attention_backend == "triton"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params) + llm.generate([shared + [4, 5]], params)
    assert llm.engine.core.kv_manager.stats.hits >= 40 // 8 * 8
    assert [o.outputs[0].token_ids for o in outs] == ref


class _EagerGraph:
    """Stands in for a captured graph on CPU: replay recomputes the forward into the output tensor,
    over the same persistent buffers, so the runner's copying and padding are what is tested."""

    def __init__(self, runner, b: int, logits: torch.Tensor) -> None:
        self.runner, self.b, self.logits = runner, b, logits

    def replay(self) -> None:
        self.logits.copy_(self.runner._forward(self.b))


def _graph_runner(model_dir: str, max_num_seqs: int):
    """A model runner on the Triton backend with a CUDAGraphRunner whose graphs replay eagerly."""
    from tandem import LLM
    from tandem.executor.cuda_graphs import CUDAGraphRunner

    llm = LLM(
        model_dir,
        dtype="float32",
        device=str(DEVICE),
        kv_cache_memory=1 << 22,
        max_num_seqs=max_num_seqs,
        attention_backend="triton",
        enforce_eager=True,
    )
    ex = llm.engine.core.executor
    runner = CUDAGraphRunner(ex.model, ex.kv_caches, ex.block_size, 8, max_num_seqs, DEVICE)
    runner.graphs = {
        b: (_EagerGraph(runner, b, logits), logits)
        for b in runner.sizes
        for logits in [runner._forward(b).clone()]
    }
    return llm, runner


def test_graph_padding_rows_write_no_kv(tiny_model_dirs):
    """A step smaller than the one before it in the same bucket leaves the rows it does not use
    as padding: their old slots are not written again."""
    llm, runner = _graph_runner(tiny_model_dirs["llama"], 4)  # buckets 1, 2, 4
    ex = llm.engine.core.executor

    def step(slots: list[int]) -> None:
        n = len(slots)
        meta = AttentionMetadata(
            torch.tensor(slots, device=DEVICE),
            torch.zeros(n, 1, dtype=torch.long, device=DEVICE),
            torch.ones(n, dtype=torch.long, device=DEVICE),
            torch.arange(n + 1, device=DEVICE),
            n,
            [],
            [],
            ex.block_size,
            triton=True,
        )
        assert (
            runner.run(
                torch.full((n,), 7, device=DEVICE),
                torch.zeros(n, dtype=torch.long, device=DEVICE),
                meta,
            )
            is not None
        )

    step([0, 1, 2, 3])
    ex.kv_caches[0][:, :4].zero_()
    step([0, 1, 2])  # bucket 4 again, one row of padding
    assert ex.kv_caches[0][:, 3].eq(0).all() and ex.kv_caches[0][:, :3].ne(0).any(-1).all()


def test_graph_runner_buffers_match_eager(tiny_model_dirs):
    """Decode steps through CUDAGraphRunner's persistent buffers (buckets larger than the batch,
    rows left from a larger step, mixed steps falling back to eager) give transformers' tokens."""
    from conftest import hf_greedy

    from tandem import SamplingParams
    from tandem.executor.cuda_graphs import CUDAGraphRunner, capture_sizes

    assert capture_sizes(256)[:7] == [1, 2, 4, 8, 16, 32, 64] and capture_sizes(256)[-1] == 256
    assert capture_sizes(3) == [1, 2, 3]
    prompts = [[(5 * i + j) % 512 for j in range(n)] for i, n in enumerate([3, 9, 17, 30, 4])]
    max_new = [6, 3, 8, 5, 7]
    ref = [
        r[:m] for r, m in zip(hf_greedy(tiny_model_dirs["llama"], prompts, max(max_new)), max_new)
    ]
    llm, runner = _graph_runner(tiny_model_dirs["llama"], 6)
    replays = []

    def counting_run(*args):
        replays.append(CUDAGraphRunner.run(runner, *args))
        return replays[-1]

    runner.run = counting_run
    llm.engine.core.executor.graph_runner = runner
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_new]
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert (
        sum(r is not None for r in replays) >= 4 and None in replays
    )  # decode steps replayed, mixed ones not
