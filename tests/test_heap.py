"""freeze_startup_heap: what a serving process holds once built is frozen out of the garbage
collector's full collections, and startup garbage is collected first, not frozen for good. In
a fresh interpreter: in the test process another thread's collection can be under way (its
finalizers let this thread run), and gc.collect() then returns at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tandem

CODE = """
import gc, weakref
from tandem.heap import YOUNG_THRESHOLD, freeze_startup_heap

class Node:
    pass

alive = Node()
cycle = Node()
cycle.me = cycle  # garbage only a collection frees
gone = weakref.ref(cycle)
del cycle
frozen = freeze_startup_heap("test")
assert gone() is None, "startup garbage was frozen, not collected"
assert frozen == gc.get_freeze_count() > 0, frozen
# a step's short-lived objects die before a young collection could promote them
assert gc.get_threshold()[0] == YOUNG_THRESHOLD
# the collector's generations no longer hold what was alive; what comes after, they do
later = Node()
tracked = gc.get_objects()
assert not any(o is alive for o in tracked) and any(o is later for o in tracked)
"""


def test_garbage_is_collected_then_what_lives_is_frozen():
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(tandem.__file__).resolve().parents[1]),
    }  # this tree's code
    run = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60, env=env
    )
    assert run.returncode == 0, run.stderr[-2000:]
