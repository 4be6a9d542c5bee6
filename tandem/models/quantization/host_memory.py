"""How the weights are held in host memory: quantised tables on transparent huge pages (Linux),
and the C heap's free pages handed back as loading goes.

A batch-1 decode step streams every weight from memory; on 4 KiB pages each 4 KiB of it costs a
TLB entry. With the quantised tables on 2 MiB pages, batch-1 decode ran 3% (a ~1B Q4_K_M file)
and 7% (~3B) faster, the same process swapping its weights between the two kinds of page
(AMD EPYC Zen 4). Where `transparent_hugepage` is `madvise` (the default of many distributions)
only memory advised so gets huge pages; this module advises what it maps.

The price is paid at load: a VM's first huge pages come slowly (here the ~3B file loaded in 20 s
instead of 12-15), so only what the decode streams, the tables, moves. Not the KV pool:
its pages would arrive as requests first write them. Not every large allocation, as torch's
`THP_MEM_ALLOC_ENABLE` would: the loader's temporaries too.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_MAPPED: set[int] = set()  # the addresses of huge_bytes' mappings while they live


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim). A layer's temporaries
    (decoded blocks, int32 codes for packing) are freed into the heap, between the layers'
    packed weights, where glibc keeps them: trimmed after each layer, loading holds the weights
    and one layer's temporaries, not every layer's."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def thp_available() -> bool:
    """Whether advised memory can get huge pages here: Linux with THP `always` or `madvise`."""
    try:
        return sys.platform == "linux" and "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def huge_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeros as a uint8 tensor: fresh anonymous memory, 2 MiB-aligned, advised as huge
    pages before anything touches it. Its storage keeps the mapping alive."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    address = whole.untyped_storage().data_ptr()
    _MAPPED.add(address)
    weakref.finalize(mapping, _MAPPED.discard, address)
    start = -whole.data_ptr() % HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return whole[start : start + nbytes]


def on_huge_pages(t: torch.Tensor) -> bool:
    """Whether `t` views memory that huge_bytes mapped."""
    return _in_host_memory(t) and t.untyped_storage().data_ptr() in _MAPPED


def _in_host_memory(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided  # not oneDNN's opaque packed layout


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty; a CPU tensor of a huge page or more goes on huge pages where the system gives
    them. A table built in place (a Q6_K or int8 vocabulary, filled a slice at a time) is then
    never held twice, as moving it would hold it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not _goes_on_huge_pages(nbytes, device):
        return torch.empty(shape, dtype=dtype, device=device)
    return huge_bytes(nbytes).view(dtype).view(shape)


def _goes_on_huge_pages(nbytes: int, device: torch.device) -> bool:
    return device.type == "cpu" and nbytes >= HUGE_PAGE and thp_available()


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Copy each CPU storage of a huge page or more that `tensors` view onto huge pages and point
    the tensors at the copy in place (`set_`: every reference to them sees it). The old memory
    is freed and trimmed before the next storage moves: this holds one storage twice at most. A
    storage that a tensor not given here also views stays put: moving it would keep the old
    copy alive. Returns the bytes moved."""
    if not thp_available():
        return 0
    moved = 0
    for group in _movable(tensors, lambda nbytes: nbytes >= HUGE_PAGE):
        moved += _move(group, huge_bytes(_storage_bytes(group)))
        trim_heap()
    return moved


def gather_on_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Copy the CPU storages under a huge page that `tensors` view (those move_to_huge_pages
    leaves) back to back onto one huge-page mapping, 64-byte aligned, and point the tensors at
    it in place; the storages it may not free stay put, as there. An MoE block's experts are
    hundreds of tables of 0.01-1.5 MiB each, streamed one after another: on 4 KiB pages a
    block's experts ran 20-35% slower at 1 and 16 rows (AMD EPYC Zen 3). Returns the bytes
    moved."""
    if not thp_available():
        return 0
    groups = list(_movable(tensors, lambda nbytes: nbytes < HUGE_PAGE))
    if not groups:
        return 0
    sizes = [-(-_storage_bytes(group) // 64) * 64 for group in groups]
    mapping, at, moved = huge_bytes(sum(sizes)), 0, 0
    for group, size in zip(groups, sizes, strict=True):
        moved += _move(group, mapping[at : at + size])
        at += size
    trim_heap()
    return moved


def _movable(
    tensors: Iterable[torch.Tensor], fits: Callable[[int], bool]
) -> Iterator[list[torch.Tensor]]:
    """The tensors grouped by the CPU storage they view, for each storage not on huge pages
    whose size `fits` and that no tensor outside `tensors` views."""
    views: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
    for t in tensors:
        if _in_host_memory(t) and not on_huge_pages(t) and fits(t.untyped_storage().nbytes()):
            views[t.untyped_storage().data_ptr()][id(t)] = t
    for group in views.values():
        old = next(iter(group.values())).untyped_storage()
        # held by each tensor here and by `old`; one more: a view this was not given
        sole = torch._C._storage_Use_Count(old._cdata) == len(group) + 1
        del old  # not held here while the caller moves it
        if sole:
            yield list(group.values())


def _storage_bytes(group: list[torch.Tensor]) -> int:
    return group[0].untyped_storage().nbytes()


def _move(group: list[torch.Tensor], new: torch.Tensor) -> int:
    """Copy the storage that `group` views into the start of `new` (uint8 bytes) and point each
    tensor at it; the old storage is freed with the last of them. Returns its bytes."""
    old = group[0].untyped_storage()
    nbytes = old.nbytes()
    with torch.no_grad():
        new[:nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(old, 0, (nbytes,)))
        base = new.storage_offset()  # bytes into the mapping
        for t in group:
            t.set_(
                new.untyped_storage(),
                base // t.element_size() + t.storage_offset(),
                t.shape,
                t.stride(),
            )
    return nbytes
