"""Which precision variant serves a request: the request's own choice (its `precision` field or
a `model:precision` suffix), else its class (the priority it was given), else the default;
and the fallback when that variant could not be built. Counts both for the metrics."""

from __future__ import annotations

import collections
import logging

from tandem.config import QuantizationConfig
from tandem.config.request_class import class_name

log = logging.getLogger(__name__)


class PrecisionRouter:
    def __init__(
        self, config: QuantizationConfig, default: str, unavailable: dict[str, str]
    ) -> None:
        """default: the default variant's name; unavailable: variants that failed to build, and
        why."""
        self.default = default
        self.fallback = config.precision_fallback
        self.classes = dict(config.precision_classes or {})
        self.served = config.precisions(default)  # what a request may name
        self.unavailable = dict(unavailable)
        self.requests_by_precision: collections.Counter[str] = collections.Counter()
        self.fallbacks: collections.Counter[tuple[str, str, str]] = collections.Counter()

    def check(self, precision: str | None) -> None:
        """ValueError (a 400 at the server) for a precision this engine does not serve."""
        if precision is not None and precision not in self.served:
            raise ValueError(
                f"precision {precision!r} is not served here; served: {', '.join(self.served)}"
            )

    def choose(self, precision: str | None, priority: int | None) -> str:
        """The variant a request runs on. priority: the level it was given (1-3), if any."""
        self.check(precision)
        if precision is None and priority is not None:
            precision = self.classes.get(class_name(priority))
        chosen = precision or self.default
        if chosen in self.unavailable:
            reason = "not_built"
            log.warning(
                "precision %s is unavailable (%s): serving with the fallback %s",
                chosen,
                self.unavailable[chosen],
                self.fallback,
            )
            self.fallbacks[(chosen, self.fallback, reason)] += 1
            chosen = self.fallback
        self.requests_by_precision[chosen] += 1
        return chosen

    def cache_salt(self, precision: str) -> str | None:
        """Prefix-cache namespace: KV of one variant is never reused by another. The default
        keeps the plain key, which routers hash too (cluster/router/prefix.py)."""
        return None if precision == self.default else precision
