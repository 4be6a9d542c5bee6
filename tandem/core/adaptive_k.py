"""AdaptiveK: speculative decoding's k per step (0 = off), from the batch size, the measured
acceptance and the measured step costs (no torch; SpecPlanner asks it)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from statistics import median


def batch_bucket(num_decodes: int) -> int:
    """The batch-size bucket: 1, 2, 3-4, 5-8, ..., 17-32, 33-64. A full batch at a power of two
    (max_num_seqs 32) shares its bucket with the sizes it falls to as requests finish."""
    return (num_decodes - 1).bit_length() if num_decodes > 0 else 0


class AdaptiveK:
    """Drafts per request for the next step, 0 meaning off, from the number of decoding
    requests B, the measured acceptance and the measured step costs.

    Whether to draft compares measured costs, not a model of them: per batch-size bucket
    (`batch_bucket`) it keeps the tokens per second of its last pure-decode steps with drafts
    and without (`rate`), since a verify step's extra costs (k + 1 rows of GEMMs, the async
    overlap it loses) are what throughput sees and a fit of cost against tokens misses them. A
    step's seconds are the executor's plus its idle wait before the step. A drafting step is
    credited the tokens the measured acceptance expects of its drafts, not those one probe
    happened to accept, so one unlucky probe does not turn drafting off for `probe_every` steps.

    Drafting is on in a bucket while its rate beats the plain one by `min_gain`; each
    `probe_every` choices the other mode runs once to stay measured. A drafting probe that costs
    m plain steps runs m / 2 times as rarely (at most `max_probe_stretch`), so probes take about
    2 / probe_every of the time at any batch size. Until `explore_verifies` verify steps have
    measured the acceptance, which is mostly the prior's until then, probes come 8 times as often.

    Not a sample: a plain step at a never-seen number of scheduled tokens (a new shape is the
    slowest step its size sees), and a step planned to draft where nobody had a draft (it says
    nothing of what drafting yields). A bucket runs plain until it holds `min_samples` plain
    samples, so it is never judged from its first, slowest steps.

    How many to draft (k) is modelled: acceptance is independent per position with rate a
    (decayed counts from verify steps: a run of j accepted out of k is j successes in j + (j < k)
    trials, from a prior of 1 in 2), so a request emits E(k) = (1 - a^(k+1)) / (1 - a) tokens per
    verify step; a step costs fixed + per_token * tokens (a decayed least-squares fit of the same
    step seconds against scheduled tokens); k maximises E(k) * cost(B) / cost(B * (1 + k)).
    Until the fit is known, k_max.
    """

    def __init__(
        self,
        k_max: int,
        min_gain: float = 1.05,
        decay: float = 0.98,
        probe_every: int = 64,
        window: int = 8,
        min_samples: int = 7,
        max_probe_stretch: int = 4,
        explore_verifies: int = 8,
    ) -> None:
        self.k_max, self.min_gain, self.decay, self.probe_every = (
            k_max,
            min_gain,
            decay,
            probe_every,
        )
        self.min_samples, self.max_probe_stretch, self.explore_verifies = (
            min_samples,
            max_probe_stretch,
            explore_verifies,
        )
        self._num_verifies = 0  # request-verify steps seen (the acceptance's evidence)
        self._accepted, self._trials = (
            1.0,
            2.0,
        )  # a prior (a = 0.5) that real verify steps soon outweigh
        self._fit = [0.0] * 5  # decayed sums: n, x, x^2, y, x*y (x tokens, y seconds)
        # (bucket, drafted) -> the last `window` pure-decode steps' (seconds, requests, their draft
        # counts): tokens are credited when a rate is asked for, at the acceptance known then
        self._samples: dict[tuple[int, bool], deque[tuple[float, int, tuple[int, ...]]]] = {}
        self.window = window
        self._shapes: set[int] = (
            set()
        )  # scheduled-token counts seen (a step at a new one is no sample)
        self._since_probe: dict[int, int] = {}  # bucket -> choices since its last probe
        self._proposal_seconds = 0.0  # the last step's proposal (what the next verify step pays)
        # Pure recording (`tandem bench spec --trace-adaptive`): one dict per choice and per step
        # seen.
        self.trace: Callable[[dict], None] | None = None

    def observe_verify(self, num_drafts: int, num_accepted: int) -> None:
        self._num_verifies += 1
        self._accepted = self._accepted * self.decay + num_accepted
        self._trials = self._trials * self.decay + num_accepted + (num_accepted < num_drafts)

    def observe_step(
        self,
        num_tokens: int,
        seconds: float,
        num_decodes: int = 0,
        drafted: bool = False,
        draft_counts: tuple[int, ...] = (),
        proposal_seconds: float = 0.0,
    ) -> None:
        """A step of `num_tokens` scheduled tokens took `seconds`; `num_decodes` > 0 when it was
        pure decode (each request one position, plus its drafts: `draft_counts`), `drafted`
        when it was planned to draft; `proposal_seconds` of it went to proposing the next
        step's drafts (the executor times them).

        A step's cost in its mode is its seconds without its own proposal, and a drafting step
        also pays the proposal that fed it, made in the step before: the proposal is measured,
        not inferred, since the drafts a verify step proposes need not match those that fed it."""
        if num_tokens <= 0 or seconds <= 0:
            return
        f, d = self._fit, self.decay
        for i, v in enumerate(
            (1.0, num_tokens, num_tokens * num_tokens, seconds, num_tokens * seconds)
        ):
            f[i] = f[i] * d + v
        new_shape = num_tokens not in self._shapes
        self._shapes.add(num_tokens)
        fed, self._proposal_seconds = self._proposal_seconds, proposal_seconds
        cost = max(seconds - proposal_seconds, 0.0)
        if not num_decodes:
            sample = False
        elif not drafted:
            sample = not new_shape
        else:  # a verify step: a sample when someone had drafts
            sample = any(draft_counts)
            cost += fed
        if sample:
            key = (batch_bucket(num_decodes), bool(drafted))
            self._samples.setdefault(key, deque(maxlen=self.window)).append(
                (cost, num_decodes, tuple(draft_counts))
            )
        if self.trace is not None:
            self.trace(
                {
                    "event": "observe_step",
                    "tokens": num_tokens,
                    "seconds": seconds,
                    "decodes": num_decodes,
                    "drafted": drafted,
                    "proposal_seconds": proposal_seconds,
                    "draft_counts": list(draft_counts),
                    "sample": sample,
                    "cost": cost,
                }
            )

    @property
    def acceptance(self) -> float:
        return self._accepted / self._trials

    def _tokens_per_verify(self, k: int) -> float:
        """E(k): tokens a request with k drafts emits in a verify step, at the measured
        acceptance."""
        a = self.acceptance
        return (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0

    def rate(self, num_decodes: int, drafted: bool) -> float | None:
        """Tokens per second of pure-decode steps at this batch size's bucket, or None: the
        median of its last `window` steps, which a minority of slow ones (load, a new shape)
        does not move, and which treats a mode with one sample (a probe) as one with many.

        Each sample is taken to `num_decodes` requests first, its tokens in proportion and its
        seconds by the step-cost fit: a bucket spans batch sizes, and a plain step at 5 requests
        yields 5/8 of the tokens a step at 8 does for about the same seconds, so the samples of
        a batch falling from 8 to 5 read as a slower plain mode than the drafting probe at 8."""
        samples = self._samples.get((batch_bucket(num_decodes), drafted))
        if not samples:
            return None
        credit = {
            k: self._tokens_per_verify(k) - 1 for k in {k for *_, counts in samples for k in counts}
        }
        cost = self.step_cost()

        def at_batch(seconds: float, n: int, counts: tuple[int, ...]) -> tuple[float, float]:
            """(scale of the tokens, seconds) of a sample of n requests, taken to num_decodes."""
            if cost is None or n == num_decodes:
                return 1.0, seconds
            tokens, scale = n + sum(counts), num_decodes / n
            fixed, per_token = cost
            return scale, seconds * (fixed + per_token * tokens * scale) / (
                fixed + per_token * tokens
            )

        rates = []
        for s, n, counts in samples:
            scale, seconds = at_batch(s, n, counts)
            rates.append((n + sum(credit[k] for k in counts)) * scale / seconds)
        return median(rates)

    def _step_seconds(self, bucket: int, drafted: bool) -> float:
        return median(s for s, *_ in self._samples[(bucket, drafted)])

    def step_cost(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the steps seen cannot tell them
        apart."""
        n, x, xx, y, xy = self._fit
        if n < 2:
            return None
        var = xx / n - (x / n) ** 2
        if var <= 1e-9 * max(xx / n, 1.0):
            return None
        per_token = max((xy / n - x / n * y / n) / var, 0.0)
        return max(y / n - per_token * x / n, 0.0), per_token

    def choose(self, num_decodes: int) -> int:
        k = self._choose(num_decodes)
        if self.trace is not None:
            self.trace(
                {
                    "event": "choose",
                    "decodes": num_decodes,
                    "bucket": batch_bucket(num_decodes),
                    "plain": self.rate(num_decodes, False),
                    "spec": self.rate(num_decodes, True),
                    "drafting": k > 0,
                    "k": k,
                    "acceptance": self.acceptance,
                }
            )
        return k

    def _choose(self, num_decodes: int) -> int:
        bucket = batch_bucket(num_decodes)
        if len(self._samples.get((bucket, False), ())) < self.min_samples:
            return 0  # plain steps first: they cost nothing extra (the new-bucket rule)
        plain, spec = self.rate(num_decodes, False), self.rate(num_decodes, True)
        drafting = spec is not None and plain is not None and spec >= self.min_gain * plain
        every = self.probe_every
        if self._num_verifies < self.explore_verifies:  # the acceptance is mostly the prior's yet
            every //= 8
        elif (
            spec is not None and not drafting
        ):  # a drafting probe costing m plain steps: m / 2 times as rarely
            m = self._step_seconds(bucket, True) / self._step_seconds(bucket, False)
            every = round(every * min(max(m / 2, 1.0), self.max_probe_stretch))
        n = self._since_probe.get(bucket, every)  # judged for the first time: probe now
        probe = n >= every  # the other mode, once
        self._since_probe[bucket] = 1 if probe else n + 1
        return self.num_to_draft(num_decodes) if drafting != probe else 0

    def num_to_draft(self, num_decodes: int) -> int:
        """k once drafting: the most tokens per unit of step cost under the model above."""
        cost = self.step_cost()
        if cost is None:
            return self.k_max
        fixed, per_token = cost
        num_decodes = max(num_decodes, 1)  # nothing running yet: the next step's first request
        base = fixed + per_token * num_decodes

        def gain(k: int) -> float:
            return self._tokens_per_verify(k) * base / (fixed + per_token * num_decodes * (1 + k))

        return max(range(1, self.k_max + 1), key=gain)
