"""Rotary position embeddings with the scalings Hugging Face checkpoints use (linear, llama3, yarn).

Frequencies are computed once in numpy (they are constants of the model, not parameters) and the rotation
uses the rotate-half convention of Hugging Face weights.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxllm.config import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """The leading dimensions of a head that rotate (all of them unless `partial_rotary_factor` < 1)."""
    return int(head_dim * rope.partial_rotary_factor)


def rope_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Returns (inv_freq [rotary_dim // 2], attention_factor that scales cos and sin)."""
    head_dim = rotary_dim(rope, head_dim)
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / np.asarray(rope.freq_factors, np.float32)
    if rope.rope_type == "default":
        return inv_freq.astype(np.float32), 1.0
    if rope.rope_type == "linear":
        return (inv_freq / rope.factor).astype(np.float32), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    if rope.rope_type == "longrope":
        return _longrope(rope, exponents)
    return _yarn(rope, head_dim)


def _longrope(rope: RopeConfig, exponents: np.ndarray) -> tuple[np.ndarray, float]:
    """Phi-3's LongRoPE: each frequency divided by its factor of the set the model runs (`RopeConfig.long_context`);
    cos and sin scaled by sqrt(1 + ln(factor) / ln(original length)) unless the config gives the factor."""
    factors = np.asarray(rope.long_factor if rope.long_context else rope.short_factor, np.float32)
    if factors.shape != exponents.shape:
        raise ValueError(f"longrope has {factors.size} factors for {exponents.size} rotary frequencies")
    inv_freq = 1.0 / (factors * rope.theta ** exponents)
    attention = rope.attention_factor
    if attention is None:
        original = rope.original_max_position_embeddings
        attention = 1.0 if rope.factor <= 1 else math.sqrt(1 + math.log(rope.factor) / math.log(original))
    return inv_freq.astype(np.float32), float(attention)


def _llama3(rope: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = rope.factor
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def mrope_axes(sections: tuple[int, ...], interleaved: bool = False) -> np.ndarray:
    """[sum(sections)] int: the position axis (0 time, 1 height, 2 width) each frequency slot rotates by."""
    if not interleaved:
        return np.repeat(np.arange(3), sections)
    j = np.arange(sum(sections))
    return np.where((j % 3 == 1) & (j < 3 * sections[1]), 1, np.where((j % 3 == 2) & (j < 3 * sections[2]), 2, 0))


def rope_cos_sin(positions: jnp.ndarray, inv_freq: np.ndarray, attention_factor: float,
                 mrope_section: tuple[int, ...] | None = None, mrope_interleaved: bool = False):
    """positions [...] -> cos, sin [..., rotary_dim] (float32). With `mrope_section`, positions are [3, ...]
    (temporal, height, width) and each frequency slot takes its axis (`mrope_axes`)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [..., rotary_dim // 2]
    if mrope_section is not None:  # [3, ..., rotary_dim // 2] -> [..., rotary_dim // 2]: a 0/1 selection, exact
        pick = np.eye(3, dtype=np.float32)[mrope_axes(mrope_section, mrope_interleaved)]  # [rotary_dim // 2, 3]
        angles = jnp.einsum("a...j,ja->...j", angles, jnp.asarray(pick))
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [..., heads, head_dim]; cos/sin [..., rotary_dim] broadcast over heads: the first rotary_dim dimensions
    rotate, the rest pass through."""
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return jnp.concatenate([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
