"""RoPE inverse frequencies and attention factor, step by step as transformers'
`modeling_rope_utils` computes them (same operations, same order, same dtypes), so that fp32
greedy tokens match it: default, linear, Llama 3, YaRN and dynamic NTK scaling.

`scaling` is the config's `rope_scaling` with `original_max_position_embeddings` filled in
(ModelConfig does it, as transformers' `standardize_rope_params` does; for dynamic NTK it is the
config's `max_position_embeddings`, past which transformers recomputes the frequencies)."""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def rope_type(scaling: dict | None) -> str:
    """The scaling's type; one not computed here is refused rather than ignored."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})"
        )
    return kind


def rope_parameters(
    head_dim: int, theta: float, scaling: dict | None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention factor: the scale of cos and sin) at a model's start."""
    kind = rope_type(scaling)
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    if kind == "dynamic":
        return dynamic_ntk_inv_freq(
            head_dim, theta, scaling, scaling["original_max_position_embeddings"]
        ), 1.0
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return inv_freq, 1.0


def dynamic_ntk_inv_freq(
    head_dim: int, theta: float, scaling: dict, seq_len: int | torch.Tensor
) -> torch.Tensor:
    """Dynamic NTK's inverse frequencies for a sequence of `seq_len` positions (at least the
    original context). transformers passes a Python int at its start and a 0-d int64 tensor as a
    sequence grows; the two round differently, so the caller passes what it would."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    base = theta * ((factor * seq_len / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: each frequency between interpolated (divided by `factor`) and kept, by how many
    turns it makes over the original context (beta_fast / beta_slow), and cos and sin scaled by
    the attention factor (mscale)."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(
                _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        """The dimension whose frequency turns `rotations` times over the original context."""
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)
    ramp = torch.clamp(ramp, 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    """The YaRN paper's attention scale (its Eq. 21)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
