"""Automatic migration in the router: every `migration.interval_s`, `migration.choose_migration`
looks at each disaggregated group's polled states and the P/D requests decoding there, and may
move one request off a decode instance short of KV through the operator's path
(`DecodeChain.migrate`). Decisions wait while a move is under way and then for a poll begun
after it, so a move the states do not show yet is never made twice."""

from __future__ import annotations

import asyncio
import logging
import time

from tandem.cluster.policy.migration import (
    DecodingRequest,
    Migration,
    MigrationConfig,
    choose_migration,
)
from tandem.cluster.router.pd_decode import DecodeChain
from tandem.cluster.router.pool import InstancePool

log = logging.getLogger(__name__)


class MigrationLoop:
    def __init__(self, cfg: MigrationConfig, chain: DecodeChain, pool: InstancePool) -> None:
        self.cfg, self.chain, self.pool = cfg, chain, pool
        self.moved_at: dict[str, float] = {}  # response id -> when the loop last moved it
        self.fresh_after = float("-inf")  # decide only on states polled after this
        self.settling = False  # a move was under way at the last check, or just asked for

    async def run(self) -> None:
        if not self.cfg.enabled:
            return
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            await self.step(time.monotonic())

    async def step(self, now: float) -> Migration | None:
        """One check: at most one move, in the first group that needs one."""
        chain, pool = self.chain, self.pool
        legs = list(chain.live.values())
        moving = any(leg.move_to is not None for leg in legs)
        if moving or self.settling:  # by now the move has landed, or is landing
            self.fresh_after = now
        self.settling = moving
        if moving or pool.polled_at < self.fresh_after:
            return None
        self.moved_at = {rid: t for rid, t in self.moved_at.items() if rid in chain.live}
        for model in dict.fromkeys(leg.model for leg in legs):
            requests = [
                DecodingRequest(leg.id, leg.dec.id, leg.num_tokens, leg.kv_tokens)
                for leg in legs
                if leg.model == model and leg.num_tokens
            ]  # 0: its first leg is not up
            move = choose_migration(
                [i.state for i in pool.group(model)], requests, self.cfg, now, self.moved_at
            )
            if move is None:
                continue
            self.moved_at[move.request_id] = (
                now  # tried: not again within the cooldown, moved or not
            )
            resp = await chain.migrate(move.request_id, move.target, reason="kv_short")
            if resp.status_code != 200:
                log.info(
                    "migration of %s %s -> %s not made: %s",
                    move.request_id,
                    move.source,
                    move.target,
                    resp.body.decode(errors="replace")[:300],
                )
                return None
            log.info(
                "migrating %s: %s is short of KV, %s has room",
                move.request_id,
                move.source,
                move.target,
            )
            self.settling = True
            return move
        return None
