"""The vision encoder of Qwen3-VL: patch embedding (with bias) plus a learned position table resampled to each
image's patch grid (bilinear, corners aligned), 2D rotary positions, LayerNorm blocks attending within each image,
the patch merger, and the DeepStack taps: the outputs of a few blocks, merged like the final ones, that the language
model adds to the image tokens' hidden states after its first layers.

As for Qwen2.5-VL (`qwen_vision`), a batch's layout (positions, which patches attend to which, the table's
interpolation taps) is computed on the host from the grids and passed in as arrays."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ConfigError
from jaxllm.models.qwen_vision import PatchGeometry, _Linear, _param, attend, merge_order_positions, rotary_2d

ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False), "silu": jax.nn.silu}


@dataclasses.dataclass(frozen=True)
class Qwen3VisionConfig(PatchGeometry):
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        self.check_heads()
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"vision hidden_act {self.hidden_act!r} is not supported")
        side = int(round(self.num_position_embeddings ** 0.5))
        if side * side != self.num_position_embeddings:
            raise ConfigError(f"num_position_embeddings {self.num_position_embeddings} is not a square")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ConfigError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} outside the {self.depth} "
                              "blocks")

    @property
    def grid_side(self) -> int:
        return int(round(self.num_position_embeddings ** 0.5))

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> Qwen3VisionConfig:
        return cls(**cls.common_fields(raw, patch_size=16),
                   num_position_embeddings=int(raw.get("num_position_embeddings", 2304)),
                   deepstack_visual_indexes=tuple(int(i) for i in raw.get("deepstack_visual_indexes", (8, 16, 24))),
                   hidden_act=raw.get("hidden_act", "gelu_pytorch_tanh"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen3VisionLayout:
    """A batch of images' N patches in the preprocessor's order."""

    positions: jax.Array  # [N, 2] int32: each patch's (row, column) in its image's patch grid
    image: jax.Array  # [N] int32: its image (frame): attention stays within it
    table_index: jax.Array  # [N, 4] int32: the position table rows its embedding interpolates
    table_weight: jax.Array  # [N, 4] float32: their bilinear weights


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (corners aligned) into a `side`-long axis for positions `index` of axes `size` long."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    taps = floor[:, None] + np.arange(2, dtype=np.float32)
    weights = np.clip(1 - np.abs(src[:, None] - taps), 0, None)
    return np.clip(taps, 0, side - 1).astype(np.int32), weights.astype(np.float32)


def qwen3_vision_layout(grids: list[tuple[int, int, int]], cfg: Qwen3VisionConfig) -> Qwen3VisionLayout:
    m, side = cfg.spatial_merge_size, cfg.grid_side
    positions, image, heights, widths = [], [], [], []
    frame = 0
    for t, h, w in grids:
        hw = merge_order_positions(h, w, m)
        for _ in range(t):
            positions.append(hw)
            image.append(np.full(h * w, frame, np.int32))
            heights.append(np.full(h * w, h))
            widths.append(np.full(h * w, w))
            frame += 1
    pos = np.concatenate(positions).astype(np.int32)
    rt, rw = _axis_taps(pos[:, 0], np.concatenate(heights), side)
    ct, cw = _axis_taps(pos[:, 1], np.concatenate(widths), side)
    index = (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4)
    weight = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
    return Qwen3VisionLayout(positions=pos, image=np.concatenate(image), table_index=index.astype(np.int32),
                             table_weight=weight)


class _LayerNorm(nnx.Module):
    def __init__(self, dim, rngs, eps=1e-6):
        self.weight, self.bias = _param((dim,), rngs, ones=True), _param((dim,), rngs)
        self.eps = eps

    def __call__(self, x):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + self.eps) * self.weight[...] + self.bias[...]


class _Merger(nnx.Module):
    """Each merge window's patches -> one token; `postshuffle`: normalized after concatenating them (the DeepStack
    mergers), else before."""

    def __init__(self, cfg: Qwen3VisionConfig, rngs, postshuffle: bool):
        merged = cfg.hidden_size * cfg.merge_unit
        self.postshuffle, self.merged = postshuffle, merged
        self.norm = _LayerNorm(merged if postshuffle else cfg.hidden_size, rngs)
        self.linear_fc1, self.linear_fc2 = _Linear(merged, merged, rngs), _Linear(merged, cfg.out_hidden_size, rngs)

    def __call__(self, x):
        x = self.norm(x.reshape(-1, self.merged)) if self.postshuffle else self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))


class Qwen3VisionBlock(nnx.Module):
    def __init__(self, cfg: Qwen3VisionConfig, rngs):
        e = cfg.hidden_size
        self.heads, self.act = cfg.num_heads, ACTIVATIONS[cfg.hidden_act]
        self.norm1, self.norm2 = _LayerNorm(e, rngs), _LayerNorm(e, rngs)
        self.qkv, self.proj = _Linear(e, 3 * e, rngs), _Linear(e, e, rngs)
        self.linear_fc1, self.linear_fc2 = _Linear(e, cfg.intermediate_size, rngs), _Linear(cfg.intermediate_size, e,
                                                                                            rngs)

    def __call__(self, x, cos, sin, mask):
        """x [N, E]; cos, sin [N, head_dim]; mask [N, N] bool."""
        x = x + attend(self.qkv, self.proj, self.heads, self.norm1(x), cos, sin, mask)
        return x + self.linear_fc2(self.act(self.linear_fc1(self.norm2(x))))


class Qwen3VisionEncoder(nnx.Module):
    def __init__(self, cfg: Qwen3VisionConfig, *, rngs: nnx.Rngs | None = None):
        self.config = cfg
        e = cfg.hidden_size
        self.patch_embed = _Linear(cfg.patch_dim, e, rngs)  # the Conv3d's kernel, flattened, and its bias
        self.pos_embed = _param((cfg.num_position_embeddings, e), rngs)
        self.blocks = nnx.List([Qwen3VisionBlock(cfg, rngs) for _ in range(cfg.depth)])
        self.merger = _Merger(cfg, rngs, postshuffle=False)
        self.deepstack_mergers = nnx.List([_Merger(cfg, rngs, postshuffle=True)
                                           for _ in cfg.deepstack_visual_indexes])

    @property
    def feature_levels(self) -> int:
        """Embeddings per image token: the merged output, then one per DeepStack tap."""
        return 1 + len(self.config.deepstack_visual_indexes)

    def layout(self, grids: list[tuple[int, int, int]]) -> Qwen3VisionLayout:
        return qwen3_vision_layout(grids, self.config)

    def __call__(self, rows: jax.Array, layout: Qwen3VisionLayout) -> jax.Array:
        """rows [N, patch_dim] (`preprocess` order) -> [1 + taps, N / merge_unit, out_hidden_size]: the image tokens'
        embeddings, then their DeepStack features, in the images' order."""
        cfg = self.config
        x = self.patch_embed(rows.astype(jnp.float32))
        table = self.pos_embed[...][layout.table_index]  # [N, 4, E]
        x = x + jnp.einsum("nke,nk->ne", table, layout.table_weight)
        cos, sin = rotary_2d(layout.positions, cfg.head_dim, cfg.rope_theta)
        mask = layout.image[:, None] == layout.image[None, :]
        taps = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask)
            if i in cfg.deepstack_visual_indexes:
                taps.append(self.deepstack_mergers[cfg.deepstack_visual_indexes.index(i)](x))
        return jnp.stack([self.merger(x)] + taps)

    features = __call__


def qwen3_vision_parameter_names(cfg: Qwen3VisionConfig) -> dict[str, tuple]:
    """Checkpoint tensor name (after the "visual." prefix) -> path in `Qwen3VisionEncoder`."""
    names = {"patch_embed.proj.weight": ("patch_embed", "weight"), "patch_embed.proj.bias": ("patch_embed", "bias"),
             "pos_embed.weight": ("pos_embed",)}
    mergers = [("merger", ("merger",))] + [(f"deepstack_merger_list.{j}", ("deepstack_mergers", j))
                                           for j in range(len(cfg.deepstack_visual_indexes))]
    for theirs, ours in mergers:
        for part in ("norm", "linear_fc1", "linear_fc2"):
            for kind in ("weight", "bias"):
                names[f"{theirs}.{part}.{kind}"] = (*ours, part, kind)
    for i in range(cfg.depth):
        for theirs, ours in (("norm1", "norm1"), ("norm2", "norm2"), ("attn.qkv", "qkv"), ("attn.proj", "proj"),
                             ("mlp.linear_fc1", "linear_fc1"), ("mlp.linear_fc2", "linear_fc2")):
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{theirs}.{kind}"] = ("blocks", i, ours, kind)
    return names
