"""Constrained decoding with llguidance: a grammar per constrained sequence, the token bitmask it allows.

A `StructuredOutputsParams` becomes an llguidance grammar (JSON schema, regex, choice, Lark or GBNF), compiled
into a matcher once per distinct grammar (LRU, keyed by its text) and deep-copied for each sequence (each of `n`
choices advances its own). Each step the host fills one row of an ``[S, ceil(V / 32)]`` int32 bitmask per
constrained sequence (in parallel, llguidance's executor releasing the GIL); the sampler applies it on device.
EOS is in a row's mask exactly when its matcher accepts; a matcher that has stopped ends its sequence.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
import time

import llguidance
import llguidance.numpy as llnumpy
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from jaxllm.errors import InvalidRequestError
from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.tokenizer.tokenizer import Tokenizer

GRAMMAR_CACHE_SIZE = 256
# One space after ',' and ':' and no other whitespace between tokens: free whitespace lets a small model pad JSON
# until max_tokens. A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputError(InvalidRequestError):
    """A constraint llguidance refuses; the message is llguidance's own."""


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON text) of one constraint."""
    matcher = llguidance.LLMatcher
    try:
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if spec.json_object:
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.regex is not None:
            return matcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            # a Lark alternation of string literals: exact text, no regex escaping to get wrong
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return matcher.grammar_from_lark(any_to_lark(spec.grammar))
    except (ValueError, TypeError, RecursionError) as e:
        raise StructuredOutputError(f"invalid structured output: {e}", "structured_outputs") from None
    except Exception as e:  # llguidance's GBNF converter raises its own types for unparsable grammars
        raise StructuredOutputError(f"invalid grammar: {e}", "structured_outputs") from None


def schema_error(schema) -> str | None:
    """llguidance's complaint about a JSON schema, or None when it compiles (no tokenizer needed)."""
    try:
        grammar = grammar_text(StructuredOutputsParams(json=schema))
    except InvalidRequestError as e:
        return str(e)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else None


class GrammarCompiler:
    """Compiled grammars for one tokenizer, thread-safe (requests are validated on server threads)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size  # the model's (logits') vocabulary, which may exceed the tokenizer's
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self.compile_seconds: list[float] = []  # per newly compiled grammar (for benchmarks)

    def is_compiled(self, spec: StructuredOutputsParams) -> bool:
        """Whether `matcher(spec)` would only copy (no compile); False for a spec that does not even render."""
        try:
            grammar = grammar_text(spec)
        except InvalidRequestError:
            return False
        with self._lock:
            return grammar in self._compiled

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for `spec` (compiled once per distinct grammar, then copied). Raises
        StructuredOutputError with llguidance's message when the constraint is invalid."""
        grammar = grammar_text(spec)
        with self._lock:
            proto = self._compiled.get(grammar)
            if proto is not None:
                self._compiled.move_to_end(grammar)
                return proto.deep_copy()
        start = time.perf_counter()
        proto = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)  # compiles with the GIL released
        if proto.is_error():
            raise StructuredOutputError(f"invalid structured output: {proto.get_error()}", "structured_outputs")
        with self._lock:
            self.compile_seconds.append(time.perf_counter() - start)
            self._compiled[grammar] = proto
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return proto.deep_copy()


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()  # llguidance's thread pool for masks


def fill_bitmask(matchers: list[tuple[llguidance.LLMatcher, int]], bitmask: np.ndarray) -> None:
    """Writes row i of bitmask [S, W] int32 from each (matcher, i), in parallel (the GIL released)."""
    llnumpy.fill_next_token_bitmask_par(_executor(), matchers, bitmask)
