"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, sampling_params)``, ``.chat(...)``,
``.beam_search(...)``; for a model that pools (``runner="pooling"``, ``pooling=...``, a sentence-transformers folder,
an encoder) ``.embed``, ``.encode``, ``.classify``, ``.score`` and ``.rerank``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm import tqdm

from jaxllm import scoring
from jaxllm.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from jaxllm.engine.config import EngineConfig, default_preset
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.lora.request import LoRARequest
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.multimodal.chat import chat_images
from jaxllm.multimodal.image_input import ImagePolicy
from jaxllm.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    RerankResult,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxllm.pooling_params import CLASSIFY, EMBED, PoolingParams
from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from jaxllm.speculative import SpecDecodeStats
from jaxllm.tokenizer.tokenizer import Tokenizer

# text, or {"prompt_token_ids": [...]} / {"prompt": "..."} (jaxllm.inputs: TokensPrompt / TextPrompt), optionally
# "cache_salt", and for a vision-language model "multi_modal_data": {"image": PIL.Image or [PIL.Image, ...]} (one image
# placeholder per image in the prompt)
Prompt = str | dict[str, Any]
# vLLM's older task names -> the runner that serves them
TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling", "classify": "pooling", "score": "pooling",
                "reward": "pooling"}


class LLM:
    """``LLM()`` serves the embedded SmolLM2 with the `smollm2-cpu` preset, as ``jaxllm serve`` and ``jaxllm generate``
    do; ``LLM(model="path")`` a HF folder, GGUF file or orbax checkpoint (or a hub id);
    ``LLM(model=module, tokenizer=tok)`` a model object built or edited in a notebook. Other keywords are
    `EngineConfig` fields (``max_num_seqs=...``, ``runner="pooling"``); ``preset="smollm2-cpu"`` starts from a preset
    in jaxllm/configs/. image_policy: which image URLs `chat` loads (default: data: URLs only).

    vLLM's keywords that have nothing to configure here are accepted: ``task`` (its older name for the runner),
    ``enforce_eager`` (buckets are always compiled, once, and cached), ``trust_remote_code`` (no model code is ever
    loaded from a checkpoint), ``disable_log_stats``."""

    def __init__(self, model: str | LlamaForCausalLM | None = None, *, tokenizer: Tokenizer | None = None,
                 preset: str | None = None, image_policy: ImagePolicy | None = None, task: str | None = None,
                 enforce_eager: bool = False, trust_remote_code: bool = False, disable_log_stats: bool = True,
                 **engine_options: Any):
        if task is not None:
            if task not in TASK_RUNNERS:
                raise ValueError(f"task must be one of {', '.join(TASK_RUNNERS)}, got {task!r}")
            if engine_options.setdefault("runner", TASK_RUNNERS[task]) != TASK_RUNNERS[task]:
                raise ValueError(f"task={task!r} contradicts runner={engine_options['runner']!r}")
        self.image_policy = image_policy or ImagePolicy()
        config = self.engine_config(model, preset, **engine_options)
        if isinstance(model, LlamaForCausalLM):
            self.engine = LLMEngine(config, model=model, tokenizer=tokenizer)
        else:
            self.engine = LLMEngine(config, tokenizer=tokenizer)
        self._ids = itertools.count()

    @staticmethod
    def engine_config(model: str | LlamaForCausalLM | None = None, preset: str | None = None,
                      **engine_options: Any) -> EngineConfig:
        """The engine config `LLM(model, preset=..., **engine_options)` runs with: unless a preset is named, the one
        the server and the CLI start the same model from (`default_preset`: the embedded model's own, else the
        platform's)."""
        path = model if isinstance(model, str) else None
        return EngineConfig.from_preset(preset or default_preset(model), model=path, **engine_options)

    @property
    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """With speculative decoding, what the drafts achieved so far: ``.acceptance_rate``,
        ``.mean_acceptance_length``, ``.num_drafts``, ``.num_draft_tokens``, ``.num_accepted_tokens``,
        ``.accepted_per_pos`` (vLLM's spec-decode counters); None without."""
        return self.engine.drafter.stats if self.engine.drafter is not None else None

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forgets every cached prompt page (later prompts recompute their prefixes, as in a fresh engine);
        False while requests run."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | SequenceABC[Prompt],
                 sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """lora_request: the adapter every prompt runs with, or one per prompt (None: the base model); the engine
        needs ``enable_lora=True``."""
        return self._submit(prompts, sampling_params or SamplingParams(), SamplingParams, use_tqdm, lora_request)

    def embed(self, prompts: Prompt | SequenceABC[Prompt],
              pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None, *,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``out.outputs.embedding``, a list of floats; ``.data``: as an array), batched
        and chunked like generation."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task=EMBED)
        return [EmbeddingRequestOutput.from_pooling(o) for o in outs]

    def encode(self, prompts: Prompt | SequenceABC[Prompt],
               pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None, *,
               use_tqdm: bool = True, pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """The pooled output per prompt as an array (``out.outputs.data``): an embedding, or with
        ``pooling_task="classify"`` class probabilities. Params given keep their own task."""
        if pooling_params is None:
            pooling_params = PoolingParams(task=pooling_task or EMBED)
        return self._submit(prompts, pooling_params, PoolingParams, use_tqdm)

    def classify(self, prompts: Prompt | SequenceABC[Prompt], *, use_tqdm: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (``out.outputs.probs``) from a classifier (a sequence-classification
        head, or a causal model's classifier tokens)."""
        params = PoolingParams(task=CLASSIFY, truncate_prompt_tokens=truncate_prompt_tokens)
        return [ClassificationRequestOutput.from_pooling(o) for o in self._submit(prompts, params, PoolingParams,
                                                                                   use_tqdm)]

    def beam_search(self, prompts: Prompt | SequenceABC[Prompt], params: BeamSearchParams, *,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """The `params.beam_width` best continuations of each prompt (`jaxllm.beam_search`)."""
        return beam_search(self, [prompts] if isinstance(prompts, str | dict) else list(prompts), params, use_tqdm)

    def score(self, text_1: str | SequenceABC[str], text_2: str | SequenceABC[str], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """A score per pair, 1:N (one `text_1`) or N:N: a cross-encoder's (sigmoid of its head), or the cosine
        similarity of an embedding model's vectors."""
        pairs = scoring.pairs(text_1, text_2)
        plan = scoring.plan(self.engine.limits.tasks, self.engine.tokenizer, pairs, truncate_prompt_tokens,
                            self.engine.score_template)
        outs = self._submit([{"prompt_token_ids": p} if isinstance(p, list) else p for p in plan.prompts],
                            plan.params, PoolingParams, use_tqdm)
        scores = plan.combine(outs)
        if len(outs) == len(pairs):  # one input per pair
            return [ScoringRequestOutput(o.request_id, ScoringOutput(s), o.prompt_token_ids)
                    for o, s in zip(outs, scores, strict=True)]
        by_text = {o.prompt: o for o in outs}
        return [ScoringRequestOutput(f"{by_text[a].request_id}+{by_text[b].request_id}", ScoringOutput(s),
                                     by_text[a].prompt_token_ids + by_text[b].prompt_token_ids)
                for (a, b), s in zip(pairs, scores, strict=True)]

    def rerank(self, query: str, documents: SequenceABC[str], *, top_n: int | None = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[RerankResult]:
        """The documents ordered by relevance to `query`, best first (the first `top_n`)."""
        documents = list(documents)
        scores = [o.outputs.score for o in self.score(query, documents, truncate_prompt_tokens=truncate_prompt_tokens,
                                                      use_tqdm=use_tqdm)]
        return [RerankResult(i, documents[i], s) for i, s in scoring.ranked(scores, top_n)]

    def _submit(self, prompts, params, kind, use_tqdm: bool,
                lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None) -> list:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if isinstance(params, kind):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} {kind.__name__} for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, list | tuple) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} lora requests for {len(prompts)} prompts")
        for lora in loras:
            self.engine.prepare_lora(lora)
        if not all(isinstance(p, kind) for p in params):
            raise TypeError(f"expected {kind.__name__} (or a list of them)")
        if kind is SamplingParams:  # as vLLM's LLM: one output per request, when it finished
            final = RequestOutputKind.FINAL_ONLY
            params = [p if p.output_kind == final else dataclasses.replace(p, output_kind=final) for p in params]
        # Validate everything before adding anything: a bad prompt or parameter leaves no request behind.
        prepared = []
        for prompt, p in zip(prompts, params, strict=True):
            salt, images = None, None
            if isinstance(prompt, dict):
                salt = prompt.get("cache_salt")
                images = (prompt.get("multi_modal_data") or {}).get("image")
                images = [images] if images is not None and not isinstance(images, list | tuple) else images
                prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt.get("prompt")
            prepared.append((self.engine.prepare_prompt(prompt, p, salt, images), p, salt))
        ids = []
        for (prep, p, salt), lora in zip(prepared, loras, strict=True):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, prep[1], p, prepared=prep, cache_salt=salt, lora_request=lora)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer")
        prompts = []
        for c in conversations:  # image parts: image_url (data: URLs; http(s) with image_policy) and image_pil
            c, images = chat_images(c, self.image_policy)
            prompts.append({"prompt_token_ids": tok.apply_chat_template(
                c, add_generation_prompt=add_generation_prompt, tokenize=True, **(chat_template_kwargs or {})),
                "multi_modal_data": {"image": images}})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list:
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="processing", unit="req", disable=not use_tqdm)
        while len(finished) < len(request_ids):
            for out in self.engine.step():
                if out.finished and out.request_id in request_ids:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[i] for i in request_ids]
