"""The request class has one table: the names a client, an API key and the quantization section
use, the priority a request carries, and the scheduler level are read from
config/request_class.py."""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig
from tandem.config.request_class import CLASS_NAMES, LEVELS, class_name, priority_of
from tandem.core.queues import classify
from tandem.server.precision import check_key_classes, key_priority
from tandem.server.protocol import CompletionRequest


def test_names_and_numbers_map_one_way_everywhere():
    assert [priority_of(n) for n in CLASS_NAMES] == list(LEVELS) == [1, 2, 3]
    assert [class_name(p) for p in LEVELS] == list(CLASS_NAMES)
    for name, level in zip(CLASS_NAMES, LEVELS):
        assert CompletionRequest(prompt="x", priority=name).priority_level == level
        assert CompletionRequest(prompt="x", priority=level).priority_level == level
        assert key_priority("Bearer k", {"k": name}) == level
    assert classify(4, 8, 16, 16) == priority_of("interactive") and classify(
        400, 8, 16, 16
    ) == priority_of("standard")


@pytest.mark.parametrize("bad", ["urgent", 0, 4, None, True])
def test_anything_else_is_refused_in_words(bad):
    with pytest.raises(
        ValueError, match="is not a request class; known: interactive, standard, background"
    ):
        priority_of(bad)
    if isinstance(bad, str):
        with pytest.raises(ValueError, match="api_key_classes: 'urgent' is not a request class"):
            check_key_classes({"k": bad})
        with pytest.raises(ValueError, match="quantization class 'urgent' is not a request class"):
            EngineConfig.from_kwargs(precision_classes={bad: "int8"})
        with pytest.raises(ValueError, match="priority"):
            CompletionRequest(prompt="x", priority=bad)
