"""Shared harness for the scheduler tests (tests/test_scheduler.py, tests/test_multilevel.py).

The scheduler is driven without a model by a fake executor that mirrors everything the
executor is told (block tables, computed positions, a host tier for swap) from the
SchedulerOutputs alone and checks it against the scheduler. The "KV" of a device slot is
modelled as the token id written there, so a block's content is the tuple of token ids in
it: swap-outs copy device contents to the host map and swap-ins copy them back before the
step runs, and after every step each request's blocks must hold exactly its tokens. That
catches wrong swap pairs, a host block reused before it was read, a device block handed out
twice, a wrong num_computed_tokens on resume, and bad prefix hits.

A token is sampled for every scheduled request whose prefill has caught up
(num_computed_tokens == num_tokens after schedule). It is a deterministic function of the
request id and either the sequence so far (`fake_token_from_sequence`, the default) or just
its length (`fake_token_from_length`), so runs can be compared.

Speculative steps (`propose=fake_propose`): after each token the executor proposes up to
MAX_DRAFTS drafts, a deterministic mix of the true continuation and wrong tokens, so the
acceptance varies. With num_lookahead_tokens (a draft model), drafts come only where the
scheduler gave lookahead slots, and the executor writes draft "KV" (DRAFT_KV) into them. A
verify step writes the drafts' "KV", samples the true token after each
accepted prefix and keeps the longest run that matches, as the real verifier does; the
scheduler must then roll back to exactly the tokens kept (the next step's num_computed_tokens
is checked), and every block in the prefix index must hold exactly the tokens it is indexed by.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from tandem.config import PreemptionMode, SchedulerConfig, SchedulingPolicy
from tandem.core.kv_cache_coordinator import cdiv
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.core.preemption import PreemptionCosts
from tandem.core.request import Request, RequestStatus
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler
from tandem.core.spec_planner import Speculation

EOS = 0
VOCAB = 50

Sampler = Callable[[str, list[int]], int]
Proposer = Callable[[str, list[int], Sampler], list[int]]
MAX_DRAFTS = 4
DRAFT_KV = -1  # what a draft model writes into a lookahead slot (never a token id)


def fake_token_from_length(req_id: str, length: int, vocab: int = VOCAB) -> int:
    """Deterministic in (id, length); EOS (0) now and then."""
    return zlib.crc32(f"{req_id}/{length}".encode()) % vocab


def fake_token_from_sequence(req_id: str, tokens: list[int], vocab: int = VOCAB) -> int:
    """Deterministic in (id, sequence so far); EOS (0) now and then."""
    return zlib.crc32(f"{req_id}/{','.join(map(str, tokens))}".encode()) % vocab


def fake_propose(req_id: str, tokens: list[int], sample: Sampler) -> list[int]:
    """0..MAX_DRAFTS drafts whose first `good` are the true continuation (sample's), the
    rest wrong; both counts a deterministic function of (id, length)."""
    h = zlib.crc32(f"draft/{req_id}/{len(tokens)}".encode())
    k, good = h % (MAX_DRAFTS + 1), (h >> 8) % (MAX_DRAFTS + 1)
    seq, drafts = list(tokens), []
    for j in range(k):
        t = sample(req_id, seq)
        drafts.append(t if j < good else (t + 1 + h % 7) % VOCAB)
        seq.append(drafts[-1])
    return drafts


def sample_from_length(req_id: str, tokens: list[int]) -> int:
    """A Sampler that looks only at the length of the sequence so far."""
    return fake_token_from_length(req_id, len(tokens))


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_sched(
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=None,
    num_host_blocks=0,
    enable_caching=True,
    clock=None,
    **cfg_kw,
) -> Scheduler:
    """Anything else goes to SchedulerConfig (scheduling_policy, preemption_mode, ...),
    PreemptionCosts (swap_cost_per_token, ...) or Speculation (num_speculative_tokens, ...),
    whose defaults apply where it is not given."""
    kv = KVCacheManager(
        num_blocks,
        block_size=block_size,
        enable_caching=enable_caching,
        num_host_blocks=num_host_blocks,
    )
    max_model_len = max_model_len or min(128, num_blocks * block_size)
    costs = {k: cfg_kw.pop(k) for k in PreemptionCosts.__dataclass_fields__ if k in cfg_kw}
    spec = {k: cfg_kw.pop(k) for k in Speculation.__dataclass_fields__ if k in cfg_kw}
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, **cfg_kw
    )
    return Scheduler(
        cfg, kv, clock or Clock(), max_model_len, PreemptionCosts(**costs), Speculation(**spec)
    )


def make_req(rid, tokens, max_tokens=4, *, eos=None, priority=2, arrival=0.0, **kw) -> Request:
    return Request(
        rid,
        list(tokens),
        SamplingParams(max_tokens=max_tokens),
        eos_token_id=eos,
        priority=priority,
        arrival_time=arrival,
        **kw,
    )


# =====================================================================================
# Random prompts sharing prefixes
# =====================================================================================

BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]]


@st.composite
def prompts(draw, max_len):
    n = draw(st.integers(1, max_len - 1))
    base = draw(st.sampled_from(BASES + [[]]))
    k = draw(st.integers(0, min(n, len(base))))
    rest = draw(st.lists(st.integers(1, 40), min_size=n - k, max_size=n - k))
    return base[:k] + rest


# =====================================================================================
# Fake executor with a host tier
# =====================================================================================


class FakeExecutor:
    """Mirrors block tables, positions, token lists and block *contents* (device and host)
    from the SchedulerOutputs alone, checks them against the scheduler, and samples fake
    tokens. With strict_preemption, a request preempted in a step may not be scheduled in
    that same step at all (not even re-admitted as a new request)."""

    def __init__(
        self,
        sched: Scheduler,
        sample: Sampler = fake_token_from_sequence,
        strict_preemption: bool = False,
        propose: Proposer | None = None,
    ) -> None:
        self.s = sched
        self.bs = sched.kv.block_size
        self.sample = sample
        self.propose = propose
        self.num_drafts = self.num_accepted = 0
        self.strict_preemption = strict_preemption
        self.dev: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}
        self.tables: dict[str, list[int]] = {}
        self.pos: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.out_on_host: dict[str, tuple[list[int], int]] = {}  # rid -> (host blocks, computed)
        self.num_swap_outs = self.num_swap_ins = 0

    def _slot(self, table, store, p):
        return store.setdefault(table[p // self.bs], [None] * self.bs)

    def _check_content(self, rid: str, upto: int, what: str) -> None:
        table, toks = self.tables[rid], self.tokens[rid]
        assert len(table) * self.bs >= upto
        for p in range(upto):
            got = self._slot(table, self.dev, p)[p % self.bs]
            assert got == toks[p], f"{what}: {rid} position {p} holds {got}, expected {toks[p]}"

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        s, bs = self.s, self.bs
        ids_new = [r.req_id for r in out.scheduled_new_reqs]
        ids_cached = [r.req_id for r in out.scheduled_cached_reqs]
        assert len(set(ids_new + ids_cached)) == len(ids_new) + len(ids_cached)
        assert set(ids_new + ids_cached) == set(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        # A request preempted this step can only be scheduled again as a new request.
        assert not set(ids_cached) & out.preempted_req_ids
        if self.strict_preemption:
            assert not set(out.num_scheduled_tokens) & out.preempted_req_ids
        for rid in out.finished_req_ids:
            self.out_on_host.pop(rid, None)
        held = {h for hosts, _ in self.out_on_host.values() for h in hosts}

        # 1. swap-outs, before anything: each victim's whole table, in order.
        pairs = list(out.blocks_to_swap_out)
        assert len({h for _, h in pairs}) == len(pairs), "host block written twice in one step"
        victims = [rid for rid in self.tables if rid in out.preempted_req_ids]
        k = 0
        while k < len(pairs):
            match = next(
                (
                    rid
                    for rid in victims
                    if [d for d, _ in pairs[k : k + len(self.tables[rid])]] == self.tables[rid]
                ),
                None,
            )
            assert match is not None, f"swap-out pairs {pairs[k:]} match no preempted table"
            victims.remove(match)
            hosts = [h for _, h in pairs[k : k + len(self.tables[match])]]
            for d, h in pairs[k : k + len(self.tables[match])]:
                assert h not in held, f"host block {h} still held by a swapped request"
                self.host[h] = list(self.dev.setdefault(d, [None] * bs))
            self.out_on_host[match] = (hosts, self.pos[match])
            held |= set(hosts)
            k += len(self.tables[match])
            self.num_swap_outs += 1

        # 2. swap-ins, then forget finished / preempted requests.
        for h, d in out.blocks_to_swap_in:  # (host, device)
            assert h in self.host, f"swap-in from host block {h}, never written"
            self.dev[d] = list(self.host[h])
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tables.pop(rid, None)
            self.pos.pop(rid, None)

        expected_in = []
        for r in out.scheduled_new_reqs:
            assert r.req_id not in self.tables, "new request the executor already holds"
            self.tables[r.req_id] = list(r.block_ids)
            self.pos[r.req_id] = r.num_computed_tokens
            self.tokens[r.req_id] = list(r.prompt_token_ids) + list(r.output_token_ids)
            if r.req_id in self.out_on_host:
                hosts, computed = self.out_on_host.pop(r.req_id)
                assert r.num_computed_tokens == computed, "swapped-in request lost progress"
                expected_in += list(zip(hosts, r.block_ids[: len(hosts)]))
                self.num_swap_ins += 1
            # prefix hits and swapped-in blocks must already hold the request's tokens
            self._check_content(r.req_id, r.num_computed_tokens, "resume")
        assert expected_in == list(out.blocks_to_swap_in), "swap-in pairs differ from the swap-outs"
        for r in out.scheduled_cached_reqs:
            assert r.req_id in self.tables, "cached request the executor dropped"
            assert self.pos[r.req_id] == r.num_computed_tokens, "gap or overlap in KV"
            self.tables[r.req_id].extend(r.new_block_ids)

        # 3. the step: write each scheduled token's "KV" into its slot.
        sampled, proposals = {}, {}
        for rid, n in out.num_scheduled_tokens.items():
            table, toks, p0 = self.tables[rid], self.tokens[rid], self.pos[rid]
            drafts = out.spec.draft_token_ids.get(rid, [])
            assert not drafts or p0 + n == len(toks) + len(drafts), (
                "drafts not after the next position"
            )
            seq = toks + drafts
            assert p0 + n <= len(seq)
            for p in range(p0, p0 + n):
                self._slot(table, self.dev, p)[p % bs] = seq[p]
            self.pos[rid] = p0 + n
            req = s.requests.get(rid)
            if req is None:  # aborted between schedule and execute
                continue
            # The scheduler may not know yet the token the step before sampled (async
            # scheduling), but it counts it, and the one this step samples, as placeholders.
            samples = n > 0 and self.pos[rid] == len(seq)
            assert toks[: req.num_tokens] == req.all_token_ids, (
                "executor and scheduler disagree on tokens"
            )
            assert len(toks) + samples == req.num_tokens_with_placeholders
            assert self.pos[rid] == req.num_computed_tokens
            assert table == s.kv.block_ids(req), "executor block table diverged"
            assert len(table) * bs >= req.num_computed_tokens
            if samples:
                sampled[rid] = [self.sample(rid, toks)]
                while (
                    len(sampled[rid]) <= len(drafts)
                    and drafts[len(sampled[rid]) - 1] == sampled[rid][-1]
                ):
                    sampled[rid].append(self.sample(rid, toks + drafts[: len(sampled[rid])]))
                toks.extend(sampled[rid])
                if drafts:  # the rejected drafts' slots are written again later
                    self.pos[rid] = len(toks) - 1
                    self.num_drafts += len(drafts)
                    self.num_accepted += len(sampled[rid]) - 1
                lookahead = out.spec.num_lookahead_tokens.get(rid, 0)
                if self.propose is not None and not s.planner.max_lookahead and out.spec.propose:
                    proposals[rid] = self.propose(rid, toks, self.sample)
                elif self.propose is not None and lookahead:
                    # a draft model: its "KV" (DRAFT_KV) goes into the lookahead slots after the
                    # sampled token, in this step, before the scheduler sees the proposal
                    proposals[rid] = self.propose(rid, toks, self.sample)[:lookahead]
                    for p in range(len(toks) - 1, len(toks) - 1 + lookahead):
                        assert p // bs < len(table), f"{rid}: lookahead slot {p} not allocated"
                        self._slot(table, self.dev, p)[p % bs] = DRAFT_KV
        # every live request's blocks hold its tokens (not just the scheduled ones)
        for rid in self.tables:
            if rid in s.requests:
                self._check_content(rid, self.pos[rid], "after step")
        # the prefix index holds verified KV only: each cached block holds its tokens
        for b in s.kv.pool.blocks:
            if b.block_hash is not None:
                assert tuple(self.dev.get(b.block_id, ())) == b.token_ids, (
                    f"cached block {b.block_id} holds other KV"
                )
        return ModelRunnerOutput(sampled_token_ids=sampled, spec_token_ids=proposals)


# =====================================================================================
# Invariants
# =====================================================================================


def check_state(s: Scheduler, unverified: dict[str, int] | None = None) -> None:
    """Queues, levels, device block ownership and ref counts, the pool's free lists, and
    the host tier. `unverified`: drafts per request in the steps scheduled and not yet handed
    back (Driver.unverified()); a request's computed positions run ahead of its tokens by
    those alone."""
    unverified = unverified or {}
    kv, pool, cfg = s.kv, s.kv.pool, s.config
    req_to_blocks, host = kv.coordinator.managers[0].req_to_blocks, kv.host_tier
    running_ids = [r.request_id for r in s.running]
    waiting = list(s.waiting)
    waiting_ids = [r.request_id for r in waiting]
    assert len(set(running_ids)) == len(running_ids) and len(set(waiting_ids)) == len(waiting_ids)
    assert not set(running_ids) & set(waiting_ids)
    assert set(running_ids) | set(waiting_ids) == set(s.requests)
    assert len(s.running) <= cfg.max_num_seqs
    # A verify step holds slots for its drafts; rejected ones stay allocated. Under async
    # scheduling a verify step may still be in flight behind a later step that drafts nothing.
    spec = (
        s.spec_stats.num_drafts
        or unverified
        or (s._step is not None and s._step.out.spec.draft_token_ids)
    )
    # + a draft model's lookahead slots
    slack = (MAX_DRAFTS + 1 if spec else 0) + s.planner.max_lookahead
    for r in s.running:
        assert r.status == RequestStatus.RUNNING and not r.swapped
        assert (
            cdiv(r.num_computed_tokens, kv.block_size)
            <= len(kv.block_ids(r))
            <= cdiv(r.num_computed_tokens + slack, kv.block_size)
        )
        assert (
            0
            < r.num_computed_tokens
            <= r.num_tokens_with_placeholders + unverified.get(r.request_id, 0)
        )
        assert r.num_output_placeholders <= 2  # the step in flight's and the one just scheduled
    for level in (1, 2, 3):
        for r in s.waiting.queues[level]:
            assert r.level == level
    for r in list(s.running) + waiting:
        multilevel = cfg.scheduling_policy == SchedulingPolicy.MULTILEVEL
        assert r.level == (r.priority if multilevel else 2)
    for r in waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if r.swapped:
            assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens > 0
            (hosts,) = host.req_to_host_blocks[r.request_id]
            assert (
                cdiv(r.num_computed_tokens, kv.block_size)
                <= len(hosts)
                <= cdiv(r.num_computed_tokens + slack, kv.block_size)
            )
        else:
            assert r.num_computed_tokens == 0
    # device: ref counts are the number of running requests holding each block
    assert set(req_to_blocks) <= set(running_ids)
    refs = [0] * pool.num_blocks
    for rid, blocks in req_to_blocks.items():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), f"{rid} owns a block twice"
        for i in ids:
            refs[i] += 1
    assert refs == [b.ref_cnt for b in pool.blocks]
    assert kv.num_free_blocks + sum(1 for x in refs if x) == pool.num_blocks
    free = set(pool._free)
    assert len(free) == len(pool._free), "a block is on the free list twice"
    for b in pool.blocks:
        if b.ref_cnt == 0:  # free: either plain or cached-and-evictable
            assert (b.block_id in pool._evictable) == (b.block_hash is not None)
            assert (b.block_id in free) == (b.block_hash is None)
    assert 0.0 <= kv.usage <= 1.0 and 0.0 <= kv.utilization <= 1.0
    # host: free + held by swapped + pending == all, nothing twice
    swapped = {r.request_id for r in waiting if r.swapped}
    assert swapped == set(host.req_to_host_blocks), "swapped requests != holders of host blocks"
    held = [h for (hs,) in host.req_to_host_blocks.values() for h in hs]
    every = held + list(host._free) + list(host._pending)
    assert len(every) == len(set(every)), "a host block is in two places"
    assert sorted(every) == list(range(host.num_host_blocks))


def bandwidth_bound(out: SchedulerOutput) -> float:
    """A step's seconds where extra positions are cheap (so drafting pays when some are
    accepted)."""
    return 0.01 + 1e-4 * out.total_num_scheduled_tokens


def l1_limit(s: Scheduler) -> int:
    b = s.config.max_num_batched_tokens
    return b - int(s.config.l2_min_share * b)


def l2_has_work(s: Scheduler) -> bool:
    return any(r.level == 2 for r in s.running) or s.waiting.count(2) > 0


# =====================================================================================
# Driver
# =====================================================================================


class Driver:
    """Runs schedule -> execute -> update, checking every step.

    strict_preemption: a request preempted in a step must still be waiting after it (never
    preempted and re-admitted within one schedule()); without it such re-admissions are
    allowed and counted in readmitted_same_step. max_steps: run()'s bound on progress.
    """

    def __init__(
        self,
        sched: Scheduler,
        clock: Clock | None = None,
        tick: float = 0.0,
        *,
        sample: Sampler = fake_token_from_sequence,
        strict_preemption: bool = False,
        max_steps: int = 5_000,
        propose: Proposer | None = None,
        step_seconds: Callable[[SchedulerOutput], float] = bandwidth_bound,
    ) -> None:
        self.s = sched
        self.step_seconds = step_seconds  # what a step "took", for the speculation policy
        self.ex = FakeExecutor(sched, sample, strict_preemption, propose)
        self.clock, self.tick = clock, tick
        self.strict_preemption = strict_preemption
        self.max_steps = max_steps
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.outputs: list[SchedulerOutput] = []
        self.pending_finished: set[str] = set()
        self.level_of: dict[str, int] = {}
        self.readmitted_same_step = 0  # preempted and admitted again within one schedule()
        self.preempted_in_flight = 0  # preempted while a token of theirs was in flight (async)
        self.not_handed_back: list[
            SchedulerOutput
        ] = []  # scheduled, update_from_output not yet called

    def add(self, req: Request) -> Request:
        self.s.add_request(req)
        self.tokens[req.request_id] = []
        self.level_of[req.request_id] = req.level
        return req

    def schedule(self) -> SchedulerOutput:
        s = self.s
        l2_work = s.config.scheduling_policy == SchedulingPolicy.MULTILEVEL and l2_has_work(s)
        before = {r.request_id: (r.num_computed_tokens, r.swapped) for r in s.waiting}
        n_pre = s.num_preemptions
        out = s.schedule()
        assert out.finished_req_ids == self.pending_finished
        self.pending_finished = set()
        assert 0 <= out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert len(s.running) <= s.config.max_num_seqs
        assert s.num_preemptions - n_pre == len(out.preempted_req_ids)
        assert sum(s.preemptions_by_mode.values()) == s.num_preemptions
        if l2_work:
            l1 = sum(n for rid, n in out.num_scheduled_tokens.items() if self.level_of[rid] == 1)
            assert l1 <= l1_limit(s), f"L1 took {l1} tokens of {s.config.max_num_batched_tokens}"
        for rid in out.preempted_req_ids:
            req = s.requests[rid]
            self.preempted_in_flight += (
                req.status == RequestStatus.PREEMPTED and req.num_output_placeholders > 0
            )
            if req.status == RequestStatus.RUNNING and not self.strict_preemption:
                self.readmitted_same_step += 1  # preempted and re-admitted in one step
                continue
            assert req.status == RequestStatus.PREEMPTED and req in s.waiting
            assert rid not in s.kv.coordinator.managers[0].req_to_blocks
            if req.swapped:
                assert s.config.preemption_mode != PreemptionMode.RECOMPUTE
                assert rid in s.kv.host_tier.req_to_host_blocks
            else:
                assert req.num_computed_tokens == 0
        for new in out.scheduled_new_reqs:  # a swapped request resumes where it was
            if new.req_id in before and before[new.req_id][1]:
                assert new.num_computed_tokens == before[new.req_id][0]
        self.not_handed_back.append(out)
        self.check()
        self.outputs.append(out)
        return out

    def top_up(self, out: SchedulerOutput) -> None:
        """Scheduler.top_up between schedule() and the step's start: admissions only."""
        s = self.s
        n_pre, preempted, tokens = (
            s.num_preemptions,
            set(out.preempted_req_ids),
            dict(out.num_scheduled_tokens),
        )
        s.top_up(out)
        assert s.num_preemptions == n_pre and out.preempted_req_ids == preempted
        assert all(out.num_scheduled_tokens[rid] == n for rid, n in tokens.items()), (
            "top_up changed a scheduled request"
        )
        assert 0 <= out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert len(s.running) <= s.config.max_num_seqs
        self.check()

    def unverified(self) -> dict[str, int]:
        """Drafts per request in the steps not yet handed back."""
        counts: dict[str, int] = {}
        for out in self.not_handed_back:
            for rid, drafts in out.spec.draft_token_ids.items():
                counts[rid] = counts.get(rid, 0) + len(drafts)
        return counts

    def check(self) -> None:
        check_state(self.s, self.unverified())

    def finish_step(self, out: SchedulerOutput):
        return self.update(out, self.ex.execute(out))

    def update(self, out: SchedulerOutput, res: ModelRunnerOutput):
        before = set(self.s.requests)
        core = self.s.update_from_output(out, res)
        self.not_handed_back.remove(out)
        if self.s.planner.policy is not None:
            seconds = self.step_seconds(out)
            self.s.observe_step(out, seconds)
            self.s.planner.observe_step(out, seconds)
        for o in core:
            self.tokens[o.req_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish[o.req_id] = o.finish_reason
        self.pending_finished |= before - set(self.s.requests)
        self.check()
        if self.clock is not None:
            self.clock.t += self.tick
        return core

    def step(self) -> SchedulerOutput:
        out = self.schedule()
        self.finish_step(out)
        return out

    def abort(self, rids):
        before = set(self.s.requests)
        self.s.finish_requests(list(rids), RequestStatus.FINISHED_ABORTED)
        gone = before - set(self.s.requests)
        for rid in gone:
            self.finish[rid] = "abort"
        self.pending_finished |= gone
        self.check()

    def run(self, max_steps: int | None = None) -> int:
        max_steps = self.max_steps if max_steps is None else max_steps
        steps = 0
        while self.s.num_unfinished:
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        return steps

    def first_scheduled(self) -> dict[str, int]:
        first = {}
        for i, o in enumerate(self.outputs):
            for r in o.scheduled_new_reqs:
                first.setdefault(r.req_id, i)
        return first


class PipelinedDriver(Driver):
    """Async scheduling, as LLMEngine runs it: step N+1 is scheduled (and handed to the
    executor, which runs steps in order) before step N's tokens reach the scheduler. A step
    that schedules nothing drains the pipeline, and one the scheduler plans to draft in first
    hands back the step in flight (EngineCore.step)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    def finish_step(self, out: SchedulerOutput):
        res = self.ex.execute(out)
        prev, self.in_flight = self.in_flight, (out, res)
        core = self.update(*prev) if prev is not None else []
        if out.is_empty:
            core += self.update(*self.in_flight)
            self.in_flight = None
        return core

    def step(self) -> SchedulerOutput:
        if self.in_flight is not None and self.s.planner.will_draft():
            # as the engine does: a step that drafts is planned once the step in flight is back
            self.update(*self.in_flight)
            self.in_flight = None
        return super().step()

    def run(self, max_steps: int | None = None) -> int:
        max_steps = self.max_steps if max_steps is None else max_steps
        steps = 0
        while self.s.num_unfinished or self.in_flight is not None:
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        return steps


class DriverMachine(RuleBasedStateMachine):
    """Rules shared by the scheduler state machines: stepping, and aborts (also between
    schedule() and update_from_output()). A subclass's @initialize sets self.sched and
    self.d (a Driver of it)."""

    @rule(k=st.integers(1, 6))
    def step(self, k):
        for _ in range(k):
            self.d.step()

    @rule(data=st.data())
    def step_with_abort_midway(self, data):
        """Abort some requests between schedule() and update_from_output()."""
        out = self.d.schedule()
        if self.sched.requests:
            rids = data.draw(st.sets(st.sampled_from(sorted(self.sched.requests)), max_size=2))
            self.d.abort(rids)
        self.d.finish_step(out)

    @rule(data=st.data())
    def step_with_arrivals_midway(self, data):
        """Requests that arrive between schedule() and the step's start join it (top_up)."""
        out = self.d.schedule()
        for _ in range(data.draw(st.integers(1, 3))):
            self.add_arrival(data)
        self.d.top_up(out)
        self.d.finish_step(out)

    def add_arrival(self, data) -> None:
        raise NotImplementedError

    @precondition(lambda self: bool(self.sched.requests))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.d.abort([rid])
