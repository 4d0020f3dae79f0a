"""Speculative decoding's settings, as vLLM takes them: ``LLM(speculative_config={"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 4})``, ``JAXLLM_SPECULATIVE_CONFIG`` (JSON) or
``jaxllm serve --speculative-config '{...}'``. A frozen dataclass that validates itself: a bad config is refused
when the engine is made, with one line that says what is wrong.

A draft model (``{"method": "draft_model", "model": ..., "quantization": ...}``) is loaded as the target is, with
the target's dtype, kernels and mesh; without ``model`` it is the target's own checkpoint, so
``{"method": "draft_model", "quantization": "auto"}`` drafts a float load of a GGUF with the file's own quantized
weights (vLLM requires ``model``; here the quantized copy of the model served is the common case)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxllm.config import ConfigError
from jaxllm.loading.quantize import QUANTIZATIONS

MAX_SPECULATIVE_TOKENS = 16  # drafts a step verifies per sequence at most (each is a row of the LM head)
DRAFT_BUDGETS = ("step_cost", "all")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # a registered method (`jaxllm.speculative.methods`): "ngram", "draft_model", "eagle3"
    num_speculative_tokens: int = 4  # k: drafts proposed per sequence and step
    # ngram (prompt lookup): the longest and shortest suffix of the sequence looked up earlier in it
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # No drafts in a step whose running batch holds this many sequences or more (vLLM's disable_by_batch_size):
    # a batch that large is compute-bound, and each draft costs a full row of the step. None: never (vLLM's
    # default); "auto" (jaxllm's default): from the step times measured at warm-up (`batch_limit`), never (by the
    # rule) on a host whose steps barely grow with their rows.
    disable_by_batch_size: int | str | None = "auto"
    # Which proposed drafts a step verifies (jaxllm's own field): "all", every one (vLLM's behaviour); "step_cost",
    # those that make the most expected tokens a second by the steps' measured times (`draft_budget`: opt-in, as
    # its runs on a 2-core CPU were mixed: docs/performance.md).
    draft_budget: str = "all"
    # draft_model: its checkpoint (a path or hub id, as `LLM(model=...)`; None: the target's), the hub revision,
    # and how its weights load (`EngineConfig.quantization`: "auto" keeps a GGUF's quantized weights); eagle3:
    # the head's folder or hub id (required) and revision
    model: str | None = None
    revision: str | None = None
    quantization: str = "auto"

    def __post_init__(self) -> None:
        from jaxllm.speculative.methods import METHODS, MODEL_METHODS

        checks = [
            (self.method in METHODS, f"unknown method {self.method!r}; methods: {', '.join(sorted(METHODS))}"),
            (isinstance(self.num_speculative_tokens, int) and
             1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
             f"got {self.num_speculative_tokens!r}"),
            (isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
             f"prompt_lookup_min must be an integer >= 1, got {self.prompt_lookup_min!r}"),
            (isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
             f"prompt_lookup_max must be an integer >= prompt_lookup_min, got {self.prompt_lookup_max!r}"),
            (self.disable_by_batch_size is None or self.disable_by_batch_size == "auto" or
             (isinstance(self.disable_by_batch_size, int) and not isinstance(self.disable_by_batch_size, bool)
              and self.disable_by_batch_size >= 1),
             f"disable_by_batch_size must be an integer >= 1, \"auto\" or null, got {self.disable_by_batch_size!r}"),
            (self.draft_budget in DRAFT_BUDGETS,
             f"draft_budget must be one of {', '.join(DRAFT_BUDGETS)}, got {self.draft_budget!r}"),
            (self.quantization in QUANTIZATIONS,
             f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"),
            (self.method in MODEL_METHODS or (self.model is None and self.revision is None),
             f"model and revision name a draft model: not used by method {self.method!r}"),
            (self.method != "eagle3" or self.model is not None, "eagle3 needs a model: the head's folder or hub id"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"speculative_config: {message}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config, a dict of its fields (vLLM's form) or their JSON; None or an empty text: no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config: not JSON ({e})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config: expected an object of fields, got {type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(value) - fields):
            raise ConfigError(f"speculative_config: unknown fields {unknown}; fields: {', '.join(sorted(fields))}")
        if "method" not in value:
            raise ConfigError("speculative_config: a method is required")
        return cls(**value)
