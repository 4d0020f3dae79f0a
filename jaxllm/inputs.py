"""Prompt shapes, named as vLLM names them (``from vllm.inputs import TextPrompt, TokensPrompt``): what `LLM.generate`,
`LLM.embed` and the other offline calls take besides a plain string."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]  # {"image": a PIL image or a list of them}
    cache_salt: NotRequired[str]  # prefix-cache isolation: only prompts with the same salt share cached pages


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt
