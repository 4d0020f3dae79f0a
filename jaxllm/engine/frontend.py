"""What a request needs before it reaches the scheduler: tokenization and validation against the model's limits.

One implementation for every serve mode: the in-process engine holds one (`LLMEngine.frontend`), and an API
server talking to an engine-core process builds its own from the limits the core sends at the handshake, so
a prompt is tokenized and refused (or accepted) in the API process, where the CPU work spreads over workers, and
the core only ever sees token ids. Thread-safe: nothing here changes after construction (the grammar compiler
caches behind its own lock)."""

from __future__ import annotations

import functools
from typing import NamedTuple

from jaxllm.engine.structured_output import GrammarCompiler
from jaxllm.errors import InvalidRequestError, PromptTooLongError
from jaxllm.lora.adapter import load_adapter
from jaxllm.lora.request import LoRARequest
from jaxllm.lora.spec import LoRASpec
from jaxllm.multimodal.inputs import MultiModalInputs, MultiModalSpec
from jaxllm.pooling_params import GENERATE, PoolingParams
from jaxllm.sampling_params import RequestLimits, SamplingParams, check_int, check_text
from jaxllm.tokenizer.tokenizer import Tokenizer

MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(salt: str | None) -> None:
    if salt is not None:
        check_text("cache_salt", salt)
        if not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError(f"cache_salt must have 1 to {MAX_CACHE_SALT_CHARS} characters", "cache_salt")


class PreparedPrompt(NamedTuple):
    """A prompt ready for the engine: its text (if it was text), token ids (image placeholders expanded) and
    images."""

    text: str | None
    ids: list[int]
    mm: MultiModalInputs | None = None


class Frontend:
    def __init__(self, tokenizer: Tokenizer | None, limits: RequestLimits, eos_token_ids: tuple[int, ...],
                 model_name: str, score_template: str | None = None, mm_spec: MultiModalSpec | None = None,
                 lora_spec: LoRASpec | None = None):
        """score_template: how a decoder reranker reads a (query, document) pair (`jaxllm.scoring`); mm_spec: what
        a vision-language model accepts (None: text only); lora_spec: what LoRA adapters are checked against (None:
        the engine serves none)."""
        self.tokenizer, self.limits, self.eos_token_ids, self.model_name = tokenizer, limits, eos_token_ids, model_name
        self.score_template = score_template
        self.mm_spec = mm_spec
        self.lora_spec = lora_spec
        if tokenizer is not None:
            tokenizer.max_token_bytes  # noqa: B018 (computed now, not on a request: check_text_fits uses it)

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def check_lora(self, request: LoRARequest) -> None:
        """Reads and checks the adapter as the engine will (`LoRAError`: it cannot be served on this model; an
        InvalidRequestError: the engine serves no adapters); safe to call from any thread."""
        if self.lora_spec is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (start it with enable_lora)",
                                      "lora_request")
        load_adapter(request.lora_name, request.lora_path, self.lora_spec)

    def prepare_prompt(self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
                       cache_salt: str | None = None, images: list | None = None) -> PreparedPrompt:
        """Tokenizes and validates a prompt, the sampling (or pooling) parameters against it and the model's
        limits, and the cache salt (the one validation every entry point goes through); safe to call from any
        thread. Raises InvalidRequestError naming the parameter. A pooling request's prompt may fill the whole
        context (nothing is generated after it); with `truncate_prompt_tokens` only its last tokens are kept.
        images: Pillow images for the prompt's image placeholders (one image-pad token each, expanded here), or
        preprocessed (patch rows, grid) pairs of a prompt already expanded (an engine core re-checking what an API
        server sent: `MultiModalInputs.to_wire`)."""
        check_cache_salt(cache_salt)
        pooling = isinstance(params, PoolingParams)
        if pooling:
            params.verify(self.limits, 0)
        elif GENERATE not in self.limits.tasks:
            raise InvalidRequestError(f"this model does not generate text (it supports: "
                                      f"{', '.join(self.limits.tasks)})", "model")
        vocab = self.limits.vocab_size
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            if not prompt.strip():
                raise InvalidRequestError("prompt must contain text other than whitespace", "prompt")
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass prompt token ids", "prompt")
            self.check_text_fits(prompt)  # bounds the tokenizer's work, truncated or not
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            text, ids = None, [check_int("prompt", i, 0, vocab - 1) for i in prompt]
        else:
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                      "prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        ids, mm = self._images(ids, images)
        if pooling:
            if mm is not None:
                raise InvalidRequestError("pooling requests take text only", "multi_modal_data")
            if params.truncate_prompt_tokens is not None:
                if params.truncate_prompt_tokens > self.max_model_len:
                    raise InvalidRequestError(f"truncate_prompt_tokens must be at most this model's maximum context "
                                              f"length {self.max_model_len}", "truncate_prompt_tokens")
                ids = ids[-params.truncate_prompt_tokens:]
            elif len(ids) > self.max_model_len:
                raise PromptTooLongError(f"the input has {len(ids)} tokens; this model's maximum context length is "
                                         f"{self.max_model_len} tokens (set truncate_prompt_tokens to keep only the "
                                         "last ones)")
            return PreparedPrompt(text, ids)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                                     f"{self.max_model_len} tokens, including at least one generated token")
        if params is not None:
            if not isinstance(params, SamplingParams):
                raise InvalidRequestError("sampling_params must be a SamplingParams", "sampling_params")
            params.verify(self.limits, len(ids))
            if params.structured_outputs is not None:
                self.grammars.matcher(params.structured_outputs)  # compiled (and cached) now: a bad one is refused
        return PreparedPrompt(text, ids, mm)

    def _images(self, ids: list[int], images: list | None) -> tuple[list[int], MultiModalInputs | None]:
        spec = self.mm_spec
        if spec is None:
            if images:
                raise InvalidRequestError("this model does not take images", "multi_modal_data")
            return ids, None
        images = list(images or ())
        if not images and spec.image_token_id not in ids:
            return ids, None
        if images and all(isinstance(i, tuple) for i in images):
            if len(images) > spec.max_images:
                raise InvalidRequestError(f"{len(images)} images in one prompt; at most {spec.max_images} are "
                                          "allowed", "multi_modal_data")
            return ids, MultiModalInputs.build(ids, [r for r, _ in images], [g for _, g in images], spec)
        return spec.prepare(ids, images)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """The compiled structured-output grammars of this tokenizer (built on first use)."""
        if self.tokenizer is None:
            raise InvalidRequestError("structured outputs need a tokenizer; this engine has none",
                                      "structured_outputs")
        return GrammarCompiler(self.tokenizer, self.limits.vocab_size, self.eos_token_ids)

    def check_text_fits(self, text: str) -> None:
        """Refuses, without tokenizing it, a text too long to fit in the context whatever it tokenizes to (each
        token is at most `max_token_bytes` of text; 4x slack for normalizers that shrink text). Tokenizing 10 MB
        takes seconds, so an over-long prompt must not get that far."""
        limit = 4 * self.max_model_len * self.tokenizer.max_token_bytes
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise PromptTooLongError(f"the prompt has {size} bytes of text, more than {self.max_model_len} tokens "
                                     f"of this model can hold (this model's maximum context length is "
                                     f"{self.max_model_len} tokens)")
