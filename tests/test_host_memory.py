"""Quantised tables on huge pages: a move keeps every value and every alias, frees the old memory,
and leaves alone a storage that something it was not given also views; a model built so serves
the same tokens as one on ordinary pages."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from test_gguf_serving import GREEDY, Q4_K_M, _prompts, write_quantised_gguf

from tandem import LLM
from tandem.models.quantization import host_memory
from tandem.models.quantization.host_memory import (
    gather_on_huge_pages,
    huge_empty,
    move_to_huge_pages,
    on_huge_pages,
)

pytestmark = pytest.mark.skipif(
    not host_memory.thp_available(), reason="no transparent huge pages here"
)
HUGE = host_memory.HUGE_PAGE


def test_a_move_keeps_values_and_aliases_and_skips_what_it_cannot_free() -> None:
    a = torch.randn(3 * HUGE // 4)
    a_rows = a.view(3, -1)  # a second view of a's storage, given too
    p = torch.nn.Parameter(torch.randn(HUGE // 2), requires_grad=False)
    c = torch.randn(HUGE // 4)
    c_tail = c[10:]  # a view the move is not given: c cannot be freed, so it stays
    small = torch.randn(16)
    expected = [a.clone(), p.clone(), c.clone()]
    c_ptr = c.data_ptr()
    moved = move_to_huge_pages([a, a_rows, p, c, small])
    assert moved == a.nbytes + p.nbytes
    assert on_huge_pages(a) and on_huge_pages(p) and a_rows.data_ptr() == a.data_ptr()
    assert c.data_ptr() == c_ptr and c_tail.data_ptr() == c_ptr + 40 and not on_huge_pages(small)
    assert torch.equal(a, expected[0]) and torch.equal(a_rows.reshape(-1), expected[0])
    assert torch.equal(p, expected[1]) and torch.equal(c, expected[2])
    assert move_to_huge_pages([a, a_rows, p]) == 0  # already there


def test_a_gather_puts_small_tables_on_one_mapping() -> None:
    a = torch.randn(1000)
    a_rows = a.view(10, -1)
    b = torch.arange(77, dtype=torch.int16)
    c = torch.randn(100)
    c_tail = c[10:]  # not given: c stays
    big = torch.randn(HUGE // 2)  # move_to_huge_pages's
    expected = [a.clone(), b.clone(), c.clone(), big.clone()]
    c_ptr = c.data_ptr()
    assert gather_on_huge_pages([a, a_rows, b, c, big]) == a.nbytes + b.nbytes
    assert on_huge_pages(a) and on_huge_pages(b) and a_rows.data_ptr() == a.data_ptr()
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one mapping
    assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0
    assert c.data_ptr() == c_ptr and c_tail.data_ptr() == c_ptr + 40 and not on_huge_pages(big)
    for t, want in zip((a, b, c, big), expected, strict=True):
        assert torch.equal(t, want)
    assert torch.equal(a_rows.reshape(-1), expected[0])
    assert gather_on_huge_pages([a, b]) == 0  # already there


def test_the_old_memory_is_freed() -> None:
    array = np.ones(HUGE, dtype=np.uint8)
    t = torch.from_numpy(array)  # its storage alone holds the array once `array` is gone
    held = weakref.ref(array)
    del array
    assert move_to_huge_pages([t]) == HUGE
    gc.collect()
    assert held() is None and on_huge_pages(t) and bool((t == 1).all())


def test_huge_empty_places_large_tables_only() -> None:
    big = huge_empty((HUGE // 64, 64), torch.int8, torch.device("cpu"))
    small = huge_empty((1024,), torch.int8, torch.device("cpu"))
    assert big.shape == (HUGE // 64, 64) and on_huge_pages(big) and not on_huge_pages(small)
    assert big.data_ptr() % HUGE == 0
    assert big.count_nonzero() == 0  # fresh memory


def test_a_model_on_huge_pages_serves_the_same_tokens(tmp_path, monkeypatch) -> None:
    """The tiny file's tables are far below 2 MiB: with the page size taken as 4 KiB every one of
    them moves (or is made there), and greedy tokens equal those of the model on ordinary pages."""
    path = str(write_quantised_gguf(Path(tmp_path) / "m.gguf", Q4_K_M))
    plain = LLM(path, dtype="float32", kv_cache_memory=1 << 22)
    model = plain.engine.core.executor.model
    assert not any(on_huge_pages(b) for b in model.buffers() if b is not None)
    want = [o.outputs[0].token_ids for o in plain.generate(_prompts(), GREEDY)]
    del plain, model
    monkeypatch.setattr(host_memory, "HUGE_PAGE", 4096)
    huge = LLM(path, dtype="float32", kv_cache_memory=1 << 22)
    tables = [
        b
        for name, b in huge.engine.core.executor.model.named_buffers()
        if b is not None and b.nbytes >= 4096 and not name.startswith("rotary")
    ]  # not a table
    assert tables and all(on_huge_pages(b) for b in tables)
    assert [o.outputs[0].token_ids for o in huge.generate(_prompts(), GREEDY)] == want
