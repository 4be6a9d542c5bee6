"""The scheduler side of a KV connector, as vLLM's KVConnector has one: hooks the scheduler and
the engine's step loop call at named points of a request's life. A hook a connector has no work
for is a no-op."""

from __future__ import annotations

from tandem.core.outputs import SchedulerOutput


class KVConnectorScheduler:
    def build_connector_meta(self, out: SchedulerOutput) -> None:
        """The step `out` is planned in full (topped up, if it was) and about to run."""

    def request_finished(self, req_id: str) -> None:
        """`req_id` finished or was aborted: give back what is held for it."""
