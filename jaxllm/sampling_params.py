"""Per-request generation options, shaped like vLLM's `SamplingParams`, validated on construction.

Every entry point (the Python API, the CLI, HTTP) builds one of these, so they all reject the same things:
`__post_init__` checks what needs no model (types, ranges, finite floats, sizes of lists and strings) and
`verify` what needs the model and engine limits (vocabulary, context left after the prompt, maximum `n`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import operator
from typing import Any

from jaxllm.errors import InvalidRequestError

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # any signed or unsigned 64-bit seed
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_REPETITION_PENALTY = 100.0
MAX_INT = (1 << 31) - 1  # for counts and lengths: anything larger is no real request


class SamplingParamsError(InvalidRequestError):
    """An invalid sampling option; `param` names it (for OpenAI-style errors)."""


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What the model and engine allow a request; `LLMEngine.limits`."""

    vocab_size: int
    max_model_len: int
    max_n: int = 16
    hidden_size: int = 0  # the pooled vector's size (a pooling request's `dimensions` may not exceed it)
    tasks: tuple[str, ...] = ("generate",)  # what the model serves: "generate", "embed"


def _fail(param: str, message: str, value: Any = dataclasses.MISSING):
    got = "" if value is dataclasses.MISSING else f", got {value!r}"[:200]
    raise SamplingParamsError(f"{param} {message}{got}", param)


def check_int(param: str, value: Any, lo: int, hi: int) -> int:
    """An integer (not a bool, not a float) in [lo, hi]."""
    if isinstance(value, bool):
        _fail(param, "must be an integer", value)
    try:
        value = operator.index(value)
    except TypeError:
        _fail(param, "must be an integer", value)
    if not lo <= value <= hi:
        _fail(param, f"must be in [{lo}, {hi}]", value)
    return value


def check_float(param: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """A finite number in [lo, hi] (or (lo, hi])."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(param, "must be a number", value)
    value = float(value)
    if not math.isfinite(value):
        _fail(param, "must be a finite number", value)
    if not (lo < value if lo_open else lo <= value) or value > hi:
        _fail(param, f"must be in {'(' if lo_open else '['}{lo}, {hi}]", value)
    return value


def check_text(param: str, value: Any) -> str:
    """A string that is valid Unicode (JSON lets a client send lone surrogates, which no tokenizer takes)."""
    if not isinstance(value, str):
        _fail(param, "must be a string", value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        _fail(param, f"is not valid Unicode (a lone surrogate at position {e.start})")
    return value


MAX_GRAMMAR_CHARS = 200_000  # a schema, regex or grammar's text
MAX_CHOICES = 1024


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the generated text (vLLM's `structured_outputs`): a JSON schema (`json`, a dict or its
    text), any JSON object (`json_object`), a regular expression, one of a list of strings (`choice`), or a Lark or
    GBNF grammar. Checked here for shape; the constraint itself is compiled (and refused with llguidance's message)
    by the engine, which has the tokenizer."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if self.json_object not in (True, False):
            _fail("structured_outputs.json_object", "must be true or false", self.json_object)
        if len(given) != 1:
            _fail("structured_outputs", f"must set exactly one of json, regex, choice, grammar, json_object; "
                  f"got {given or 'none'}")
        if self.json is not None:
            if not isinstance(self.json, dict | str):
                _fail("structured_outputs.json", "must be a JSON schema (an object, or its text)", self.json)
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            if len(text) > MAX_GRAMMAR_CHARS:
                _fail("structured_outputs.json", f"must be at most {MAX_GRAMMAR_CHARS} characters")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                check_text(f"structured_outputs.{name}", value)
                if not value.strip() or len(value) > MAX_GRAMMAR_CHARS:
                    _fail(f"structured_outputs.{name}", f"must have 1 to {MAX_GRAMMAR_CHARS} characters")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice or len(self.choice) > MAX_CHOICES:
                _fail("structured_outputs.choice", f"must be a list of 1 to {MAX_CHOICES} strings", self.choice)
            for c in self.choice:
                check_text("structured_outputs.choice", c)
            if sum(len(c) for c in self.choice) > MAX_GRAMMAR_CHARS:
                _fail("structured_outputs.choice", f"must have at most {MAX_GRAMMAR_CHARS} characters in all")
            object.__setattr__(self, "choice", tuple(self.choice))

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams:
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            _fail("structured_outputs", "must be an object", value)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in value if k not in known]
        if unknown:
            _fail("structured_outputs", f"has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**value)


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what each output of a request holds. CUMULATIVE: everything so far; DELTA: what is new since the
    last output (text, token ids, logprobs; prompt logprobs in the first only); FINAL_ONLY: one output, when the
    request finished. A stream of DELTA outputs costs O(tokens) over its whole length."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


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
    prompt_logprobs: int | None = None  # the same for each prompt token (RequestOutput.prompt_logprobs)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # or a dict of its fields
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        put = object.__setattr__
        try:
            put(self, "output_kind", RequestOutputKind(self.output_kind))
        except ValueError:
            _fail("output_kind", "must be 0 (cumulative), 1 (delta) or 2 (final only)", self.output_kind)
        if self.structured_outputs is not None:
            put(self, "structured_outputs", StructuredOutputsParams.of(self.structured_outputs))
        put(self, "n", check_int("n", self.n, 1, MAX_INT))
        put(self, "temperature", check_float("temperature", self.temperature, 0, MAX_TEMPERATURE))
        put(self, "top_p", check_float("top_p", self.top_p, 0, 1, lo_open=True))
        put(self, "top_k", check_int("top_k", self.top_k, -1, MAX_INT) if self.top_k != -1 else 0)
        put(self, "min_p", check_float("min_p", self.min_p, 0, 1))
        put(self, "presence_penalty", check_float("presence_penalty", self.presence_penalty, -2, 2))
        put(self, "frequency_penalty", check_float("frequency_penalty", self.frequency_penalty, -2, 2))
        put(self, "repetition_penalty", check_float("repetition_penalty", self.repetition_penalty, 0,
                                                    MAX_REPETITION_PENALTY, lo_open=True))
        if self.seed is not None:
            put(self, "seed", check_int("seed", self.seed, SEED_MIN, SEED_MAX))
        if self.max_tokens is not None:
            put(self, "max_tokens", check_int("max_tokens", self.max_tokens, 1, MAX_INT))
        put(self, "min_tokens", check_int("min_tokens", self.min_tokens, 0, MAX_INT))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must not exceed max_tokens ({self.max_tokens})", self.min_tokens)
        if self.logprobs is not None:
            put(self, "logprobs", check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        if self.prompt_logprobs is not None:
            put(self, "prompt_logprobs", check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, "must be true or false", getattr(self, name))
        self._check_stops()
        self._check_logit_bias()

    def _check_stops(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple):
            _fail("stop", "must be a string or a list of strings", stop)
        if len(stop) > MAX_STOP_STRINGS:
            _fail("stop", f"must have at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for s in stop:
            check_text("stop", s)
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                _fail("stop", f"strings must have 1 to {MAX_STOP_STRING_CHARS} characters", s)
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple):
            _fail("stop_token_ids", "must be a list of token ids", ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            _fail("stop_token_ids", f"must have at most {MAX_STOP_TOKEN_IDS} entries, got {len(ids)}")
        object.__setattr__(self, "stop_token_ids", tuple(check_int("stop_token_ids", t, 0, MAX_INT) for t in ids))

    def _check_logit_bias(self) -> None:
        if not self.logit_bias:
            object.__setattr__(self, "logit_bias", None)
            return
        if not isinstance(self.logit_bias, dict):
            _fail("logit_bias", "must map token ids to biases", self.logit_bias)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            _fail("logit_bias", f"must have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        bias = {}
        for token, value in self.logit_bias.items():
            if isinstance(token, str):  # JSON object keys
                try:
                    token = int(token)
                except ValueError:
                    _fail("logit_bias", "keys must be token ids", token)
            bias[check_int("logit_bias", token, 0, MAX_INT)] = check_float("logit_bias", value, -100, 100)
        object.__setattr__(self, "logit_bias", bias)

    def verify(self, limits: RequestLimits, num_prompt_tokens: int) -> None:
        """The checks that need the model: token ids in its vocabulary, the context left after the prompt,
        the engine's maximum n."""
        if self.n > limits.max_n:
            _fail("n", f"must be at most {limits.max_n} on this server", self.n)
        vocab = limits.vocab_size
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                _fail(name, f"token ids must be below the vocabulary size {vocab}", bad[0])
        left = limits.max_model_len - num_prompt_tokens
        for name, value in (("max_tokens", self.max_tokens), ("min_tokens", self.min_tokens)):
            if value is not None and value > left:
                _fail(name, f"is too large: {value}. This model's maximum context length is {limits.max_model_len} "
                      f"tokens and your request has {num_prompt_tokens} input tokens ({value} > "
                      f"{limits.max_model_len} - {num_prompt_tokens})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def uses_filters(self) -> bool:
        return bool(self.top_k or self.top_p < 1 or self.min_p)
