"""A serving process's startup heap and the garbage collector."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)
# Objects allocated, less those freed, between young collections: a step's (about 5 per
# running request) many times over.
YOUNG_THRESHOLD = 50_000


def freeze_startup_heap(process: str) -> int:
    """Collect once, then put every object alive now out of the collector's reach (gc.freeze);
    returns how many. Called by a serving process once it is built, before it serves: what is
    alive then (modules, the app, the model's Python objects) lives as long as the process, yet
    each full collection walked all of it, pausing the process for the walk: 75-110 ms in the
    API process of `tandem serve` (every SSE stream stalls), 135 ms in an engine core holding
    Gemma 3 270M (every sequence's next token waits), AMD EPYC Zen 3. The collection first, so
    that no garbage is frozen for good.

    The young generation is then sized past what one serving step allocates (a few objects per
    running request, dead by the next step): at 700, the default, a step of thousands of
    requests ran dozens of young collections, each promoting that step's live objects, until a
    full collection walked every request's token lists (80 ms at 4,096 running, Zen 3)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    frozen = gc.get_freeze_count()
    log.debug(
        "%s: %d startup objects frozen out of the garbage collector's full collections",
        process,
        frozen,
    )
    return frozen
