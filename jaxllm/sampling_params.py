"""Per-request generation options, shaped like vLLM's `SamplingParams`, validated on construction."""

from __future__ import annotations

import dataclasses

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs


class SamplingParamsError(ValueError):
    """An invalid sampling option; `param` names it (for OpenAI-style errors)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0: only the sampled token's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (self.n >= 1, "n", "must be at least 1"),
            (self.temperature >= 0, "temperature", "must be non-negative"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be -1 (disabled) or positive"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be positive"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"must be between 0 and {MAX_LOGPROBS}"),
            (all(s for s in self.stop), "stop", "must not contain empty strings"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise SamplingParamsError(f"{param} {message}, got {getattr(self, param)!r}", param)
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                if not -100 <= bias <= 100:
                    raise SamplingParamsError(f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")
                if int(token) < 0:
                    raise SamplingParamsError(f"logit_bias token id {token} is negative", "logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def uses_filters(self) -> bool:
        return bool(self.top_k or self.top_p < 1 or self.min_p)
