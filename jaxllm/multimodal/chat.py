"""Images in chat messages, as the OpenAI API and vLLM's `LLM.chat` send them: content parts
``{"type": "image_url", "image_url": {"url": ...}}`` (a ``data:`` URL, or http(s) when the policy allows) and, from
Python, ``{"type": "image_pil", "image_pil": PIL.Image}``. Each becomes ``{"type": "image"}`` in the messages the
chat template sees (vision-language templates write their image placeholder for it), and the images are returned
in prompt order."""

from __future__ import annotations

from typing import Any

from jaxllm.errors import InvalidRequestError
from jaxllm.multimodal.image_input import ImagePolicy, load_image

IMAGE_PART_TYPES = ("image_url", "image_pil")


def has_images(messages: list[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                                          for p in m["content"]) for m in messages)


def chat_images(messages: list[dict[str, Any]], policy: ImagePolicy,
                param: str = "messages") -> tuple[list[dict[str, Any]], list]:
    """(messages for the chat template, the images they hold in order). Messages without image parts are returned
    as they are."""
    out, images = [], []
    for m in messages:
        content = m.get("content")
        if not has_images([m]):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(load_image(url, policy, param))
                parts.append({"type": "image"})
            elif kind == "image_pil":
                image = part.get("image_pil")
                if not hasattr(image, "convert"):
                    raise InvalidRequestError("image_pil must be a PIL.Image", param)
                images.append(image)
                parts.append({"type": "image"})
            elif kind == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
            else:
                raise InvalidRequestError(f"content part type {kind!r} is not supported", param)
        out.append({**m, "content": parts})
    return out, images
