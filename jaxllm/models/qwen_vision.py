"""The vision encoder of Qwen2.5-VL: patch embedding, 2D rotary positions, blocks of window attention (full
attention in a few), and the patch merger that turns each merge window of patches into one language-model token.

The layout of a batch of images (which patches attend to which, their rotary positions, the window order) is
computed on the host from the images' patch grids (`vision_layout`) and passed in as arrays: the encoder itself is
a pure function of its parameters, the patch rows and that layout. Attention is dense over the batch's patches,
masked to each image (full blocks) or each window (the others): a reference form, exact for any mix of images.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ConfigError


class PatchGeometry:
    """What both Qwen-VL vision configs derive from their fields (a mixin of the frozen dataclasses)."""

    hidden_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int

    @staticmethod
    def common_fields(raw: dict[str, Any], patch_size: int) -> dict[str, Any]:
        """The fields both configs read from a ``vision_config`` (``patch_size``: the family's default)."""
        try:
            return dict(depth=int(raw["depth"]), hidden_size=int(raw["hidden_size"]),
                        intermediate_size=int(raw["intermediate_size"]), num_heads=int(raw["num_heads"]),
                        out_hidden_size=int(raw["out_hidden_size"]), patch_size=int(raw.get("patch_size", patch_size)),
                        temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
                        spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
                        in_channels=int(raw.get("in_channels", raw.get("in_chans", 3))),
                        rope_theta=float((raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
        except KeyError as e:
            raise ConfigError(f"vision_config: missing the field {e.args[0]!r}") from None

    def check_heads(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(f"vision hidden_size {self.hidden_size} / {self.num_heads} heads: the head size must be "
                              "a multiple of 4 (2D rotary)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


@dataclasses.dataclass(frozen=True)
class VisionConfig(PatchGeometry):
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        self.check_heads()

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> VisionConfig:
        return cls(**cls.common_fields(raw, patch_size=14), window_size=int(raw.get("window_size", 112)),
                   fullatt_block_indexes=tuple(raw.get("fullatt_block_indexes", (7, 15, 23, 31))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionLayout:
    """A batch of images' patches in window order (what the blocks see), N patches in all."""

    order: jax.Array  # [N] int32: window-order position -> patch row (rows are in merge-window order per image)
    positions: jax.Array  # [N, 2] int32: each window-ordered patch's (row, column) in its image's patch grid
    image: jax.Array  # [N] int32: its image (full-attention blocks attend within it)
    window: jax.Array  # [N] int32: its window (the other blocks attend within it)
    restore: jax.Array  # [N / merge_unit] int32: merged token in window order -> its place in image order


def merge_order_positions(h: int, w: int, m: int) -> np.ndarray:
    """[h * w, 2] (row, column) of an image's patches in the preprocessor's merge-window-major order."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    block = (h // m, m, w // m, m)
    return np.stack([rows.reshape(block).transpose(0, 2, 1, 3).ravel(),
                     cols.reshape(block).transpose(0, 2, 1, 3).ravel()], axis=-1)


def vision_layout(grids: list[tuple[int, int, int]], cfg: VisionConfig) -> VisionLayout:
    """Host-side layout of images with patch grids (t, h, w) (numpy arrays; the rows of each image are in the
    preprocessor's merge-window order, the images one after another)."""
    m = cfg.spatial_merge_size
    side = cfg.window_size // m // cfg.patch_size  # merged tokens per window side
    positions, image_of, window_of, unit_order = [], [], [], []
    units_before, windows_before = 0, 0
    for i, (t, h, w) in enumerate(grids):
        hw = merge_order_positions(h, w, m)
        gh, gw = h // m, w // m  # merged-token grid
        for frame in range(t):
            units = np.arange(gh * gw).reshape(gh, gw)
            for wr in range(0, gh, side):
                for wc in range(0, gw, side):
                    members = units[wr:wr + side, wc:wc + side].ravel()
                    unit_order.append(members + units_before + frame * gh * gw)
                    window_of.append(np.full(len(members) * cfg.merge_unit, windows_before, np.int32))
                    windows_before += 1
            positions.append(hw)
        image_of.append(np.full(t * h * w, i, np.int32))
        units_before += t * gh * gw
    units = np.concatenate(unit_order)
    unit = cfg.merge_unit
    order = (units[:, None] * unit + np.arange(unit)[None]).ravel().astype(np.int32)
    all_positions = np.concatenate(positions)[order].astype(np.int32)
    image = np.concatenate(image_of)[order]
    return VisionLayout(order=order, positions=all_positions, image=image, window=np.concatenate(window_of),
                        restore=np.argsort(units).astype(np.int32))


def _param(shape, rngs, scale=0.02, ones=False):
    if rngs is None:
        return nnx.Param(jax.ShapeDtypeStruct(shape, jnp.float32))
    if ones:
        return nnx.Param(jnp.ones(shape))
    if len(shape) == 1:
        return nnx.Param(jnp.zeros(shape))
    return nnx.Param(jax.random.normal(rngs.params(), shape) * scale)


class _Linear(nnx.Module):
    def __init__(self, din, dout, rngs, bias=True):
        self.weight = _param((dout, din), rngs)  # [out, in]
        self.bias = _param((dout,), rngs) if bias else None

    def __call__(self, x):
        y = x @ self.weight[...].T
        return y if self.bias is None else y + self.bias[...]


class _RMSNorm(nnx.Module):
    def __init__(self, dim, eps, rngs):
        self.weight = _param((dim,), rngs, ones=True)
        self.eps = eps

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + self.eps) * self.weight[...]


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def attend(qkv: _Linear, proj: _Linear, heads: int, x: jax.Array, cos: jax.Array, sin: jax.Array,
           mask: jax.Array) -> jax.Array:
    """A vision block's attention: x [N, E] (normalized); cos, sin [N, head_dim] (2D rotary); mask [N, N] bool
    (which patches see which) -> [N, E]. Dense: a reference form, exact for any mix of images."""
    n, e = x.shape
    q, k, v = jnp.moveaxis(qkv(x).reshape(n, 3, heads, e // heads), 1, 0)
    q, k = _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])
    scores = jnp.einsum("qhd,khd->hqk", q, k) * (e // heads) ** -0.5
    probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
    return proj(jnp.einsum("hqk,khd->qhd", probs, v).reshape(n, e))


def rotary_2d(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """positions [N, 2] (row, column) -> cos, sin [N, head_dim]: the rows' frequencies, then the columns', twice
    (rotate-half layout)."""
    quarter = head_dim // 4
    inv_freq = 1.0 / theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter))
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [N, 2, head_dim / 4]
    angles = angles.reshape(angles.shape[0], -1)
    angles = jnp.concatenate([angles, angles], -1)
    return jnp.cos(angles), jnp.sin(angles)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, rngs):
        e = cfg.hidden_size
        self.heads = cfg.num_heads
        self.norm1, self.norm2 = _RMSNorm(e, cfg.rms_norm_eps, rngs), _RMSNorm(e, cfg.rms_norm_eps, rngs)
        self.qkv, self.proj = _Linear(e, 3 * e, rngs), _Linear(e, e, rngs)
        self.gate_proj, self.up_proj = _Linear(e, cfg.intermediate_size, rngs), _Linear(e, cfg.intermediate_size, rngs)
        self.down_proj = _Linear(cfg.intermediate_size, e, rngs)

    def __call__(self, x, cos, sin, mask):
        """x [N, E]; cos, sin [N, head_dim]; mask [N, N] bool."""
        x = x + attend(self.qkv, self.proj, self.heads, self.norm1(x), cos, sin, mask)
        h = self.norm2(x)
        return x + self.down_proj(jax.nn.silu(self.gate_proj(h)) * self.up_proj(h))


class QwenVisionEncoder(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs | None = None):
        self.config = cfg
        e, merged = cfg.hidden_size, cfg.hidden_size * cfg.merge_unit
        self.patch_embed = _Linear(cfg.patch_dim, e, rngs, bias=False)  # the Conv3d's kernel, flattened
        self.blocks = nnx.List([VisionBlock(cfg, rngs) for _ in range(cfg.depth)])
        self.merger_norm = _RMSNorm(e, 1e-6, rngs)
        self.merger_fc1, self.merger_fc2 = _Linear(merged, merged, rngs), _Linear(merged, cfg.out_hidden_size, rngs)

    feature_levels = 1  # embeddings per image token (Qwen3-VL adds DeepStack features)

    def layout(self, grids: list[tuple[int, int, int]]) -> VisionLayout:
        return vision_layout(grids, self.config)

    def features(self, rows: jax.Array, layout: VisionLayout) -> jax.Array:
        """As `__call__`, [1, N / merge_unit, out_hidden_size] (the engine's form for every encoder)."""
        return self(rows, layout)[None]

    def __call__(self, rows: jax.Array, layout: VisionLayout) -> jax.Array:
        """rows [N, patch_dim] (the images' patch rows, `preprocess` order) -> [N / merge_unit, out_hidden_size]:
        one embedding per language-model image token, in the images' order."""
        cfg = self.config
        x = self.patch_embed(rows.astype(jnp.float32))[layout.order]
        cos, sin = rotary_2d(layout.positions, cfg.head_dim, cfg.rope_theta)
        same_image = layout.image[:, None] == layout.image[None, :]
        same_window = layout.window[:, None] == layout.window[None, :]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, same_image if i in cfg.fullatt_block_indexes else same_window)
        merged = self.merger_norm(x).reshape(-1, cfg.hidden_size * cfg.merge_unit)
        out = self.merger_fc2(jax.nn.gelu(self.merger_fc1(merged), approximate=False))
        return out[layout.restore]


def vision_parameter_names(cfg: VisionConfig) -> dict[str, tuple]:
    """Checkpoint tensor name (after the "visual." prefix) -> path in `QwenVisionEncoder`."""
    names = {"patch_embed.proj.weight": ("patch_embed", "weight"), "merger.ln_q.weight": ("merger_norm", "weight")}
    for ours, theirs in (("merger_fc1", "merger.mlp.0"), ("merger_fc2", "merger.mlp.2")):
        for kind in ("weight", "bias"):
            names[f"{theirs}.{kind}"] = (ours, kind)
    for i in range(cfg.depth):
        names[f"blocks.{i}.norm1.weight"] = ("blocks", i, "norm1", "weight")
        names[f"blocks.{i}.norm2.weight"] = ("blocks", i, "norm2", "weight")
        for theirs, ours in (("attn.qkv", "qkv"), ("attn.proj", "proj"), ("mlp.gate_proj", "gate_proj"),
                             ("mlp.up_proj", "up_proj"), ("mlp.down_proj", "down_proj")):
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{theirs}.{kind}"] = ("blocks", i, ours, kind)
    return names


def load_vision_arrays(encoder: nnx.Module, tensors: dict[str, np.ndarray], names: dict[str, tuple] | None = None):
    """Fills `encoder` from checkpoint tensors (prefix stripped) named as `names` lists (default:
    `vision_parameter_names`)."""
    names = vision_parameter_names(encoder.config) if names is None else names
    for name, path in names.items():
        if name not in tensors:
            raise ConfigError(f"the checkpoint lacks visual.{name}")
        target = encoder
        for step in path[:-1]:
            target = target[step] if isinstance(step, int) else getattr(target, step)
        var = getattr(target, path[-1])
        value = np.asarray(tensors[name], np.float32)
        value = value.reshape(value.shape[0], -1) if name == "patch_embed.proj.weight" else value
        if value.shape != var.get_value().shape:
            raise ConfigError(f"visual.{name}: shape {value.shape}, expected {var.get_value().shape}")
        var.set_value(jnp.asarray(value))
