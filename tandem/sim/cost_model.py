"""Seconds per engine step from the shape of the batch: what the simulated executor charges.

Every cost model here has one form over the batch shape
x = (1, prefill tokens, prefill attention pairs, decode seqs, decode context):

    step_time = overhead + sum over terms of max(compute . x, memory . x)

one term per group of kernels that run one after another, each bound by its compute or its
memory traffic, whichever is slower. A roofline (sim/hardware.py) has three terms: the linear
layers, prefill attention and decode attention, with coefficients from FLOPs and bytes. A
measured profile (`tandem profile`) has one term, fitted to timed steps, with no memory roof:
step_time is then plain least squares. No torch here.

A mixture of experts' linear term also reads the experts its step's tokens touch, which is not
linear in the tokens: its "experts" entry (experts, experts per token, seconds to read every
expert) adds that read to the term's memory side (sim/moe.py).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from tandem.sim.moe import expert_read_time

FEATURES = ("const", "prefill_tokens", "prefill_attention", "decode_seqs", "decode_context")


@dataclass(slots=True, frozen=True)
class BatchShape:
    num_prefill_tokens: int = 0  # new tokens in prompt chunks this step
    prefill_attention: int = 0  # sum over chunks of chunk_len * (tokens_before_chunk + chunk_len)
    num_decode_seqs: int = 0  # requests decoding one token this step
    decode_context: int = 0  # sum of those requests' context lengths (tokens attended)

    def features(self) -> tuple[int, int, int, int, int]:
        return (
            1,
            self.num_prefill_tokens,
            self.prefill_attention,
            self.num_decode_seqs,
            self.decode_context,
        )


def prefill_shape(tokens: int, prompt_len: int) -> BatchShape:
    """A step of `tokens` prompt tokens from prompts of `prompt_len`: whole prompts when they
    fit (attention prompt_len per token), else one chunk halfway through a long prompt."""
    per_token = prompt_len if prompt_len <= tokens else (prompt_len + tokens) / 2
    return BatchShape(tokens, int(tokens * per_token))


@dataclass(slots=True, frozen=True)
class CostModel:
    kind: str  # "measured" | "roofline"
    overhead: float  # seconds every step pays (launch, scheduling, sampling)
    # name -> {"compute": 5 coefficients, "memory": 5 coefficients}: seconds per unit of FEATURES;
    # a mixture of experts' term adds "experts": (experts, experts per token, seconds to read all)
    terms: dict[str, dict[str, tuple[float, ...]]]
    block_size: int = 16
    kv_bytes_per_token: int = 0
    kv_capacity_tokens: int = 0  # KV tokens that fit one instance
    host_kv_capacity_tokens: int = 0  # host tier for swap
    host_bandwidth: float = 20e9  # bytes/s between device and host (swap)
    link_bandwidth: float = 450e9  # bytes/s between instances (P -> D KV transfer)
    link_latency: float = 1e-5  # seconds per transfer
    max_num_batched_tokens: int = 2048  # the prefill step size X is quoted at
    info: dict = field(default_factory=dict)  # provenance, tables, samples, fit error
    # seconds each decoding request adds to a step beyond the executor: on a CPU host the front
    # end's work for the token it streams shares the executor's cores (bench fidelity measures it)
    seq_overhead: float = 0.0

    def step_time(self, batch: BatchShape) -> float:
        x = batch.features()
        return (
            self.overhead
            + self.seq_overhead * batch.num_decode_seqs
            + sum(
                max(
                    sum(c * v for c, v in zip(t["compute"], x)),
                    sum(m * v for m, v in zip(t["memory"], x))
                    + (expert_read_time(t["experts"], x[1] + x[3]) if "experts" in t else 0.0),
                )
                for t in self.terms.values()
            )
        )

    def calibrated(
        self, factor: float = 1.0, extra: float = 0.0, per_seq: float = 0.0
    ) -> CostModel:
        """Every step `factor` times longer plus `extra` seconds, and `per_seq` more for each
        decoding request in it: what serving adds on top of the profiled executor (front-end
        threads sharing the CPU and the GIL, per-step engine work), calibrated from a served run
        of another workload."""
        if factor <= 0 or extra < 0 or per_seq < 0:
            raise ValueError(
                "step scale must be positive and step and request overheads >= 0, got "
                f"{factor}, {extra}, {per_seq}"
            )
        terms = {  # an experts entry scales its read time, not its expert counts
            k: {
                part: (*coefs[:2], coefs[2] * factor)
                if part == "experts"
                else tuple(c * factor for c in coefs)
                for part, coefs in t.items()
            }
            for k, t in self.terms.items()
        }
        return replace(
            self,
            overhead=self.overhead * factor + extra,
            seq_overhead=self.seq_overhead * factor + per_seq,
            terms=terms,
            info={
                **self.info,
                "step_scale": factor,
                "step_overhead_s": extra,
                "seq_overhead_s": per_seq,
            },
        )

    def kv_transfer_time(self, num_tokens: int) -> float:
        return self.link_latency + num_tokens * self.kv_bytes_per_token / self.link_bandwidth

    def preemption_costs(self) -> tuple[float, float]:
        """(s/token to swap out and back in over the host link, s/token to prefill again)."""
        return 2 * self.kv_bytes_per_token / self.host_bandwidth, 1.0 / self.prefill_throughput()

    def prefill_throughput(self, tokens: int | None = None, prompt_len: int | None = None) -> float:
        """X: prompt tokens/s of a step of `tokens` (default: the batch budget) whole prompts."""
        tokens = tokens or self.max_num_batched_tokens
        return tokens / self.step_time(prefill_shape(tokens, prompt_len or tokens))

    def decode_throughput(self, batch: int, context: int) -> float:
        """Y: tokens/s of decode steps of `batch` requests, each attending `context` tokens."""
        return batch / self.step_time(
            BatchShape(num_decode_seqs=batch, decode_context=batch * context)
        )

    def describe(self) -> str:
        i = self.info
        if "accelerator" in i:
            return (
                f"{self.kind}, {i.get('model_shape')} on "
                f"{i.get('tensor_parallel', 1)} x {i['accelerator']['name']}"
            )
        return (
            f"{self.kind}, {i.get('model', 'unnamed model')} on {i.get('device', 'unknown device')}"
        )

    # ---- persistence --------------------------------------------------------------
    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> CostModel:
        names = set(cls.__dataclass_fields__)
        if not isinstance(d, dict) or d.get("kind") not in ("measured", "roofline"):
            raise ValueError(
                "not a cost model profile: expected a JSON object with kind measured or roofline"
            )
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown cost model field(s): {', '.join(sorted(unknown))}")
        terms = d.get("terms")
        if not isinstance(terms, dict) or not terms:
            raise ValueError("a cost model needs terms: {name: {compute: [...], memory: [...]}}")
        for name, t in terms.items():
            if (
                not isinstance(t, dict)
                or any(len(t.get(k, ())) != len(FEATURES) for k in ("compute", "memory"))
                or len(t.get("experts", (0, 0, 0))) != 3
                or set(t) - {"compute", "memory", "experts"}
            ):
                raise ValueError(
                    f"term {name!r} must have compute and memory lists of {len(FEATURES)} "
                    f"coefficients ({', '.join(FEATURES)}), and may have experts "
                    "[experts, experts per token, seconds to read all]"
                )
        return cls(
            **{
                **d,
                "terms": {
                    n: {k: tuple(float(v) for v in coefs) for k, coefs in t.items()}
                    for n, t in terms.items()
                },
            }
        )

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_json(), indent=1)  # then each list of numbers on one line:
        text = re.sub(
            r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text
        )
        Path(path).write_text(text + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from e
        return cls.from_json(d)


# ---- fitting a measured profile ------------------------------------------------------
def fit_linear(samples: list[list[float]]) -> tuple[tuple[float, ...], dict]:
    """Non-negative least squares of time on FEATURES over rows (p, a, d, c, seconds).

    Residuals are relative (each row weighted by 1/time), so a 5 ms decode step counts as
    much as a 500 ms prefill. With five coefficients the exact NNLS optimum is found by
    solving every support subset and keeping the best non-negative one: 32 tiny solves.
    Returns the coefficients and {median_rel_error, max_rel_error}."""
    rows = np.asarray(samples, dtype=float)
    if rows.ndim != 2 or rows.shape[1] != 5 or len(rows) < 2:
        raise ValueError(f"need at least two samples of ({', '.join(FEATURES[1:])}, seconds)")
    t = rows[:, 4]
    if (t <= 0).any():
        raise ValueError("sample times must be positive")
    a = np.column_stack([np.ones(len(rows)), rows[:, :4]]) / t[:, None]
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)  # columns span ~9 orders of magnitude
    a_s, b = a / scale, np.ones(len(rows))
    best, best_res = np.zeros(5), np.inf
    for k in range(1, 6):
        for cols in itertools.combinations(range(5), k):
            sol, *_ = np.linalg.lstsq(a_s[:, cols], b, rcond=None)
            if (sol < 0).any():
                continue
            res = float(np.sum((a_s[:, cols] @ sol - b) ** 2))
            if res < best_res:
                best_res, best = res, np.zeros(5)
                best[list(cols)] = sol
    coef = best / scale
    rel = np.abs(np.column_stack([np.ones(len(rows)), rows[:, :4]]) @ coef - t) / t
    return tuple(float(c) for c in coef), {
        "median_rel_error": float(np.median(rel)),
        "max_rel_error": float(rel.max()),
    }


def measured(samples: list[list[float]], **kwargs) -> CostModel:
    """A measured cost model: the constant term becomes the step overhead."""
    coef, err = fit_linear(samples)
    info = dict(kwargs.pop("info", {}), fit=err, samples=[list(s) for s in samples])
    term = {"compute": (0.0, *coef[1:]), "memory": (0.0,) * len(FEATURES)}
    return CostModel("measured", coef[0], {"fit": term}, info=info, **kwargs)
