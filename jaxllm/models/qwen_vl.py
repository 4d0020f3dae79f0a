"""Qwen2.5-VL and Qwen3-VL: a Qwen2 / Qwen3 decoder with multimodal rotary positions (M-RoPE; Qwen3-VL interleaves
the axes' frequency slots) and a vision encoder whose outputs take the place of the image-pad tokens' embeddings
(Qwen3-VL's DeepStack features are also added to those tokens' hidden states after the decoder's first layers).

`mrope_positions` (host, numpy) gives a prompt's [3, T] positions: text tokens count up on all three axes; an
image's tokens sit at (start, start + row, start + column) of its merged patch grid, and the text after it resumes
at start + max(rows, columns). Decoding continues at the prompt's last position + 1 on all axes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ConfigError, ModelConfig
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.qwen3_vision import Qwen3VisionConfig, Qwen3VisionEncoder
from jaxllm.models.qwen_vision import QwenVisionEncoder, VisionConfig

# vision-language architecture -> its decoder's
VL_ARCHITECTURES = {"Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
                    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class VLConfig:
    text: ModelConfig
    vision: VisionConfig | Qwen3VisionConfig
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> VLConfig:
        """Both layouts: transformers 5's nested ``text_config`` (``rope_parameters``), and the flat one most
        published Qwen2.5-VL folders have (text fields at the top, ``rope_scaling: {type: mrope}``)."""
        arch = (raw.get("architectures") or [""])[0]
        if arch not in VL_ARCHITECTURES:
            raise ConfigError(f"unsupported vision-language architecture {arch!r}")
        text = dict(raw.get("text_config") or {k: v for k, v in raw.items() if k != "vision_config"})
        text["architectures"] = [VL_ARCHITECTURES[arch]]
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        if raw.get("eos_token_id") is not None:
            text["eos_token_id"] = raw["eos_token_id"]
        if "vision_config" not in raw:
            raise ConfigError("config.json has no vision_config")
        qwen3 = arch == "Qwen3VLForConditionalGeneration"
        if qwen3:  # its M-RoPE is always interleaved, with these sections unless the config says
            rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
            rope.setdefault("mrope_section", [24, 20, 20])
            rope["mrope_interleaved"] = True
            text["rope_parameters"] = rope
        text_config = ModelConfig.from_hf(text)
        if text_config.rope.mrope_section is None or sum(text_config.rope.mrope_section) * 2 != text_config.head_dim:
            raise ConfigError(f"mrope_section {text_config.rope.mrope_section} must cover head_dim / 2 = "
                              f"{text_config.head_dim // 2} frequencies")
        try:
            vision = (Qwen3VisionConfig if qwen3 else VisionConfig).from_hf(raw["vision_config"])
            return cls(text=text_config, vision=vision,
                       image_token_id=int(raw["image_token_id"]),
                       vision_start_token_id=int(raw["vision_start_token_id"]),
                       vision_end_token_id=int(raw["vision_end_token_id"]))
        except KeyError as e:
            raise ConfigError(f"missing the field {e.args[0]!r}") from None


def image_tokens(grid: tuple[int, int, int], merge: int) -> int:
    t, h, w = grid
    return t * (h // merge) * (w // merge)


def mrope_positions(token_ids: list[int] | np.ndarray, grids: list[tuple[int, int, int]], image_token_id: int,
                    merge: int) -> np.ndarray:
    """[3, T] int32 positions of a prompt whose image-pad runs hold, in order, the images with patch grids
    `grids` (each run `image_tokens(grid)` long)."""
    ids = np.asarray(token_ids)
    out = np.zeros((3, len(ids)), np.int32)
    at, next_pos, images = 0, 0, iter(grids)
    while at < len(ids):
        if ids[at] != image_token_id:
            end = at
            while end < len(ids) and ids[end] != image_token_id:
                end += 1
            out[:, at:end] = next_pos + np.arange(end - at)
            next_pos += end - at
            at = end
            continue
        try:
            t, h, w = next(images)
        except StopIteration:
            raise ValueError("more image-pad runs than images") from None
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if not np.all(ids[at:at + n] == image_token_id):
            raise ValueError(f"an image of {n} tokens needs {n} image-pad tokens in a row")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[:, at:at + n] = next_pos + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        next_pos += max(gh, gw)
        at += n
    return out


def place_images(embeds: jax.Array, ids: jax.Array, image_embeds: jax.Array, image_token_id: int) -> jax.Array:
    """embeds [..., E] with the image-pad tokens' rows replaced, in order, by image_embeds [K, E] (K >= their
    count; extra rows are padding)."""
    is_image = ids == image_token_id
    index = jnp.clip(jnp.cumsum(is_image.reshape(-1)).reshape(ids.shape) - 1, 0, image_embeds.shape[0] - 1)
    return jnp.where(is_image[..., None], image_embeds[index].astype(embeds.dtype), embeds)


class QwenVLForConditionalGeneration(nnx.Module):
    def __init__(self, cfg: VLConfig, language: LlamaForCausalLM, visual: QwenVisionEncoder | Qwen3VisionEncoder):
        self.vl_config, self.language, self.visual = cfg, language, visual

    causal = True  # `jaxllm.models.protocol.MultimodalModel`
    multimodal = True

    @property
    def config(self) -> ModelConfig:
        return self.language.config

    @property
    def dtype(self):
        return self.language.dtype

    @property
    def kernels(self):
        return self.language.kernels

    @property
    def quant_plan(self):
        return self.language.quant_plan

    def logits(self, hidden: jax.Array) -> jax.Array:
        return self.language.logits(hidden)

    def arrange_layers(self) -> None:
        self.language.arrange_layers()

    @property
    def classifies(self) -> bool:
        return self.language.classifies

    def classify(self, pooled: jax.Array) -> jax.Array:
        return self.language.classify(pooled)

    def set_classifier_tokens(self, token_ids: tuple[int, ...]) -> None:
        self.language.set_classifier_tokens(token_ids)

    def forward_paged(self, input_ids: jax.Array, positions: jax.Array, kv_cache, metadata,
                      image_embeds: jax.Array | None = None):
        """The engine's step: input_ids [T], positions [3, T], image_embeds [levels, T, E]: column i holds token i's
        image embedding (and DeepStack features) where token i is an image-pad token, zeros elsewhere (computed by
        the encoder beforehand)."""
        embeds = self.language.embed_tokens(input_ids)
        deepstack = None
        if image_embeds is not None:
            is_image = (input_ids == self.vl_config.image_token_id)[:, None]
            embeds = jnp.where(is_image, image_embeds[0].astype(embeds.dtype), embeds)
            deepstack = image_embeds[1:] if image_embeds.shape[0] > 1 else None
        return self.language.forward_paged(input_ids, positions, kv_cache, metadata, inputs_embeds=embeds,
                                           deepstack=deepstack)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, rows: jax.Array | None = None,
                 layout=None) -> jax.Array:
        """The dense path: input_ids [B, S] (image-pad runs for the images, batch order), positions [3, B, S]
        (`mrope_positions`), the images' patch rows and layout (`visual.layout(grids)`; none: text only) -> logits
        [B, S, V]."""
        embeds = self.language.embed_tokens(input_ids)
        deepstack = None
        if rows is not None:
            features = self.visual.features(rows, layout)  # [levels, K, E]
            image_id = self.vl_config.image_token_id
            embeds = place_images(embeds, input_ids, features[0], image_id)
            if features.shape[0] > 1:  # each level placed like the embeddings, zeros on the other tokens
                deepstack = jnp.stack([place_images(jnp.zeros_like(embeds), input_ids, f, image_id)
                                       for f in features[1:]])
        return self.language(input_ids, positions, inputs_embeds=embeds, deepstack=deepstack)
