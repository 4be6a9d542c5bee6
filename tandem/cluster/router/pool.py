"""The router's view of its instances: the state each one last reported (polled), plus what
the router itself has sent since, so a burst arriving between two polls is spread by the
routing policy instead of landing on whichever instance looked idle at the last poll."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field

import httpx

from tandem.cluster.policy.routing import InstanceState, RoutingWeights, choose_instance

log = logging.getLogger(__name__)
_ids = itertools.count()
TIMEOUTS_TO_FAIL = 2  # state polls in a row that time out before an instance is marked unhealthy


@dataclass(slots=True)
class Instance:
    id: str
    url: str
    model: str
    kind: str = "chat"
    state: InstanceState = None  # type: ignore[assignment]
    block_size: int = 0  # 0: no prefix hashing (embedding instances)
    inflight: int = 0  # requests the router has open on it
    pending: dict[int, int] = field(
        default_factory=dict
    )  # sent, first token not seen: key -> prompt tokens
    precision: str | None = (
        None  # the variant it serves by default (None: not reported, an embedding instance)
    )
    precisions: tuple[str, ...] = ()  # every variant a request may name (`model:precision`)
    loras: frozenset[str] = frozenset()  # the LoRA adapters it serves by name
    kv_rank: int | None = (
        None  # rank in the KV transfer group (torch_dist); None: KV moves over shared memory
    )
    last_error: str | None = None
    failed_at: float = float("-inf")  # when the router last saw it fail (time.monotonic())
    poll_timeouts: int = 0  # state polls in a row that timed out

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = InstanceState(self.id, self.model, healthy=False)

    def view(self) -> InstanceState:
        """Polled state, with the router's not-yet-started sends counted as queued work."""
        if not self.pending:
            return self.state
        s = self.state
        return dataclasses.replace(
            s,
            num_waiting=max(s.num_waiting, len(self.pending)),
            waiting_prefill_tokens=max(s.waiting_prefill_tokens, sum(self.pending.values())),
        )

    def start(self, prompt_tokens: int) -> int:
        key = next(_ids)
        self.inflight += 1
        self.pending[key] = prompt_tokens
        return key

    def first_token(self, key: int) -> None:
        self.pending.pop(key, None)

    def finish(self, key: int) -> None:
        self.inflight -= 1
        self.pending.pop(key, None)


class InstancePool:
    """Instances grouped by served model name; a poller keeps their states fresh."""

    def __init__(
        self,
        instances: list[Instance],
        weights: RoutingWeights,
        client: httpx.AsyncClient,
        poll_interval_s: float = 0.5,
        poll_timeout_s: float = 1.0,
    ) -> None:
        self.instances = {i.id: i for i in instances}
        self.weights, self.client = weights, client
        self.poll_interval_s, self.poll_timeout_s = poll_interval_s, poll_timeout_s
        self.polled_at = float(
            "-inf"
        )  # when the last full poll began: every state is at least that fresh

    def group(self, model: str) -> list[Instance]:
        return [i for i in self.instances.values() if i.model == model]

    def choose(
        self,
        model: str,
        prefix_hashes: list[int] = (),
        role: str | None = None,
        exclude: set[str] = frozenset(),
        lora: str | None = None,
    ) -> Instance | None:
        """`lora`: only an instance serving that adapter."""
        views = [
            i.view()
            for i in self.group(model)
            if i.id not in exclude and (lora is None or lora in i.loras)
        ]
        best = choose_instance(views, prefix_hashes, self.weights, role)
        return None if best is None else self.instances[best.instance_id]

    def lora_group(self, lora: str) -> str | None:
        """The model group one of whose instances serves adapter `lora` (None: none does)."""
        return next((i.model for i in self.instances.values() if lora in i.loras), None)

    def unavailable_reason(self, model: str) -> str:
        g = self.group(model)
        down = [i.id for i in g if not i.state.healthy]
        draining = [i.id for i in g if i.state.healthy and i.state.draining]
        parts = (
            [f"{len(g)} instance(s)"]
            + ([f"unhealthy: {', '.join(down)}"] if down else [])
            + ([f"draining: {', '.join(draining)}"] if draining else [])
        )
        return f"no healthy instance can take a request for model `{model}` ({'; '.join(parts)})"

    def mark_failed(self, inst: Instance, error: str) -> None:
        if inst.state.healthy:
            log.warning("instance %s (%s) marked unhealthy: %s", inst.id, inst.url, error)
        inst.state.healthy, inst.last_error, inst.failed_at = False, error, time.monotonic()

    async def poll_once(self) -> None:
        started = time.monotonic()
        await asyncio.gather(*(self._poll(i) for i in self.instances.values()))
        self.polled_at = started

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_interval_s)

    async def _poll(self, inst: Instance) -> None:
        """A poll begun before the router saw `inst` fail does not make it healthy again (its
        answer may predate the failure): only a later one does. One poll that times out is a
        busy instance as often as a dead one (a loaded machine, a long step): it takes
        `TIMEOUTS_TO_FAIL` in a row to mark it; a refused connection or a bad answer marks it at
        once (and a dead instance's streams fail their requests sooner still)."""
        started = time.monotonic()
        try:
            r = await self.client.get(inst.url + "/tandem/state", timeout=self.poll_timeout_s)
            r.raise_for_status()
            data = r.json()
        except httpx.TimeoutException as e:
            inst.poll_timeouts += 1
            if inst.poll_timeouts >= TIMEOUTS_TO_FAIL:
                self.mark_failed(
                    inst,
                    f"state poll timed out {inst.poll_timeouts} times in a row: {type(e).__name__}",
                )
            return
        except (httpx.HTTPError, ValueError) as e:
            self.mark_failed(inst, f"state poll failed: {type(e).__name__}: {e}")
            return
        inst.poll_timeouts = 0
        s = inst.state
        if started < inst.failed_at:
            return
        if not s.healthy:
            log.info("instance %s (%s) is healthy", inst.id, inst.url)
        s.healthy, inst.last_error = True, None
        s.role, s.elastic = data.get("role", s.role), bool(data.get("elastic", False))
        for name in (
            "num_waiting",
            "num_running",
            "waiting_prefill_tokens",
            "kv_usage",
            "kv_free_tokens",
            "num_preempted",
        ):
            setattr(s, name, data.get(name, 0))
        s.cached_prefixes = frozenset(data.get("cached_prefixes") or ())
        inst.block_size = int(data.get("block_size") or 0)
        inst.precision, inst.precisions = data.get("precision"), tuple(data.get("precisions") or ())
        inst.loras = frozenset(data.get("loras") or ())
