"""Synthetic workloads for `tandem bench serve`: prompts of an exact token count, the
`random` and `mixed` request sets, and their arrival schedules (Poisson / gamma)."""

from __future__ import annotations

import itertools
import math
import random
import re
from dataclasses import dataclass

import numpy as np

_WORD_TOKEN = re.compile(
    r"(?:\u0120|\u2581)[a-z]{3,9}"
)  # "Ġword" (byte-level BPE) or "▁word" (SentencePiece)
_WORD_TEXT = re.compile(r" ?[a-z]{3,9}")


@dataclass
class Request:
    index: int
    prompt: str
    input_len: int  # tokens of `prompt` with the benchmark's tokenizer
    output_len: int  # max_tokens (forced with ignore_eos)
    arrival: float  # seconds after the start of the run
    cls: str = "all"
    priority: str | None = None
    # a trace's prefix blocks: equal ids, equal leading tokens, `block_tokens` each
    hash_ids: tuple[int, ...] = ()
    block_tokens: int = 0


class PromptSynth:
    """Prompt text of exactly N tokens: random common words (vocabulary entries that are a space
    plus letters; low ids are the frequent merges) decoded to text, re-encoded, then trimmed or
    padded until the re-encoded count matches. Misses are recorded, never hidden."""

    def __init__(self, tokenizer, pool_size: int = 4000):
        self.tok = tokenizer
        words = sorted(i for s, i in tokenizer.get_vocab().items() if _WORD_TOKEN.fullmatch(s))
        if len(words) < 100:  # unusual vocabulary format: judge ids by their decoded text
            words = [
                i for i in range(len(tokenizer)) if _WORD_TEXT.fullmatch(tokenizer.decode([i]))
            ]
        if not words:
            raise ValueError("tokenizer has no plain-word tokens to build prompts from")
        self.pool = words[:pool_size]
        self.made = 0
        self.misses: list[tuple[int, int]] = []  # (asked, got)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def words(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self.pool, k=max(0, n))

    def fit(self, ids: list[int], target: int, rng: random.Random) -> tuple[str, int]:
        """Text starting with the decoding of `ids` (trimmed, or padded with random words) whose
        re-encoding has `target` tokens; returns (text, actual token count)."""
        target = max(1, target)
        self.made += 1
        ids = list(ids[:target]) + self.words(rng, target - len(ids))
        for _ in range(8):
            text = self.tok.decode(ids)
            got = self.encode(text)
            if len(got) == target:
                return text, target
            ids = got[:target] + self.words(rng, target - len(got))
        self.misses.append((target, len(got)))
        return text, len(got)

    def prompt(self, n: int, rng: random.Random) -> tuple[str, int]:
        return self.fit(self.words(rng, n), n, rng)

    def report(self) -> dict:
        off = [got - asked for asked, got in self.misses]
        return {
            "prompts": self.made,
            "exact": self.made - len(off),
            "off": len(off),
            "max_abs_diff": max((abs(d) for d in off), default=0),
            "examples": [{"asked": a, "got": g} for a, g in self.misses[:10]],
        }


def uniform_len(rng: random.Random, mean: int, ratio: float) -> int:
    """Uniform integer in [mean*(1-ratio), mean*(1+ratio)], at least 1."""
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def arrivals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Offsets (s) of n arrivals: all at 0 for an infinite rate, else gamma-distributed gaps with
    shape=burstiness and mean 1/rate (burstiness 1 = Poisson), the first request at 0."""
    if n == 0 or math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def _schedule(args) -> str:
    rate = (
        "all at once"
        if math.isinf(args.request_rate)
        else f"{args.request_rate:g} req/s (gamma burstiness {args.burstiness:g})"
    )
    conc = f", max concurrency {args.max_concurrency}" if args.max_concurrency else ""
    return rate + conc


def random_workload(args, synth: PromptSynth) -> tuple[list[Request], dict]:
    rng = random.Random(args.seed)
    times = arrivals(args.num_prompts, args.request_rate, args.burstiness, args.seed)
    reqs = []
    for i, t in enumerate(times):
        text, n = synth.prompt(uniform_len(rng, args.input_len, args.range_ratio), rng)
        reqs.append(Request(i, text, n, uniform_len(rng, args.output_len, args.range_ratio), t))
    desc = {
        "name": "random",
        "num_requests": len(reqs),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "description": f"random: {len(reqs)} prompts, "
        f"input {args.input_len} / output {args.output_len} tokens "
        f"(+-{args.range_ratio:.0%}), {_schedule(args)}",
    }
    return reqs, desc


def mixed_workload(args, synth: PromptSynth) -> tuple[list[Request], dict]:
    """A few long requests (round(n * long_fraction), spread at random) among many short chats;
    the long ones take the --long-input-len lengths in turn, in order of arrival."""
    if not 0 <= args.long_fraction <= 1:
        raise ValueError("--long-fraction must be in [0, 1]")
    rng = random.Random(args.seed)
    n = args.num_prompts
    long_ids = set(rng.sample(range(n), round(n * args.long_fraction)))
    times = arrivals(n, args.request_rate, args.burstiness, args.seed)
    long_lens = itertools.cycle(args.long_input_len)
    reqs = []
    for i, t in enumerate(times):
        cls = "long" if i in long_ids else "short"
        inp, out = (
            (next(long_lens), args.long_output_len)
            if cls == "long"
            else (args.short_input_len, args.short_output_len)
        )
        text, got = synth.prompt(uniform_len(rng, inp, args.range_ratio), rng)
        prio = ("standard" if cls == "long" else "interactive") if args.priority_by_class else None
        reqs.append(Request(i, text, got, uniform_len(rng, out, args.range_ratio), t, cls, prio))
    desc = {
        "name": "mixed",
        "num_requests": n,
        "num_long": len(long_ids),
        "num_short": n - len(long_ids),
        "long_input_len": args.long_input_len,
        "long_output_len": args.long_output_len,
        "short_input_len": args.short_input_len,
        "short_output_len": args.short_output_len,
        "range_ratio": args.range_ratio,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "priority_by_class": bool(args.priority_by_class),
        "description": f"mixed: {len(long_ids)} long "
        f"({'/'.join(map(str, args.long_input_len))}->{args.long_output_len} tokens) + "
        f"{n - len(long_ids)} short ({args.short_input_len}->{args.short_output_len}), "
        f"{_schedule(args)}" + (", priority by class" if args.priority_by_class else ""),
    }
    return reqs, desc
