"""The sampler's per-row inputs for a step (`SamplingTensors`), built on the host from the sequences that get a
token. Rows that need nothing beyond greedy/temperature sampling share device-resident constants, so a step
without penalties, biases or grammars transfers none of the wide tensors."""

from __future__ import annotations

import time
from collections import deque

import jax
import numpy as np

from jaxllm.engine.sampler import SamplingTensors
from jaxllm.engine.sequence import Sequence
from jaxllm.engine.structured_output import bitmask_width, fill_bitmask
from jaxllm.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

UINT32 = 1 << 32


class SamplingInputs:
    def __init__(self, *, vocab_size: int, max_model_len: int, eos_token_ids: tuple[int, ...], row_buckets: list[int]):
        """row_buckets: every step's row count (padded); each gets its own device-resident constants."""
        self.vocab_size, self.max_model_len, self.eos_token_ids = vocab_size, max_model_len, eos_token_ids
        # Logit-bias slots per row: a request's own entries, plus its stop and EOS ids masked before min_tokens.
        self.bias_width = -(-(MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + len(eos_token_ids)) // 8) * 8
        self.mask_width = bitmask_width(vocab_size)
        # (Built in numpy and put: jnp.full would compile a computation per shape at every start.)
        put, w = jax.device_put, self.bias_width
        self.no_history = {s: put(np.full((s, max_model_len), -1, np.int32)) for s in row_buckets}
        self.no_bias = {s: (put(np.full((s, w), -1, np.int32)), put(np.zeros((s, w), np.float32)))
                        for s in row_buckets}
        self.no_mask = {s: put(np.full((s, self.mask_width), -1, np.int32)) for s in row_buckets}
        self.mask_seconds: deque[float] = deque(maxlen=4096)  # grammar mask fills (host)

    @property
    def constants(self) -> dict[str, jax.Array]:
        """The device-resident constants by name (a multi-host step message names them: each host has its own)."""
        return {f"{kind}/{s}": a for s in self.no_history for kind, a in (
            ("history", self.no_history[s]), ("bias_ids", self.no_bias[s][0]),
            ("bias_values", self.no_bias[s][1]), ("mask", self.no_mask[s]))}

    def build(self, rows: list[Sequence], s: int, ahead: list[int]) -> SamplingTensors:
        """rows: the sequences that get a token, in row order, padded to `s` rows; ahead: per row, tokens it has
        beyond its host state (a step dispatched before the previous one's tokens were read back)."""
        n = len(rows)
        params = [seq.params for seq in rows]

        def column(values, dtype, fill=0) -> np.ndarray:  # a field of every row, padded to s (one C-level fill)
            out = np.full(s, fill, dtype)
            out[:n] = values
            return out
        temperature = column([0.0 if p.greedy else p.temperature for p in params], np.float32)
        top_k = column([p.top_k for p in params], np.int32)
        top_p = column([p.top_p for p in params], np.float32, 1)
        min_p = column([p.min_p for p in params], np.float32)
        rep = column([p.repetition_penalty for p in params], np.float32, 1)
        freq = column([p.frequency_penalty for p in params], np.float32)
        pres = column([p.presence_penalty for p in params], np.float32)
        seeds = np.zeros((s, 2), np.uint32)
        seed = [seq.request.seed % (1 << 64) for seq in rows]
        seeds[:n, 0] = [x % UINT32 for x in seed]
        seeds[:n, 1] = [x // UINT32 for x in seed]
        choices = column([seq.index for seq in rows], np.int32)
        outputs = [seq.num_output_tokens + a for seq, a in zip(rows, ahead, strict=True)]
        steps = column(outputs, np.int32)
        num_prompt = column([seq.num_prompt_tokens for seq in rows], np.int32)
        any_penalty = any(p.uses_penalties for p in params)
        any_random = not all(p.greedy for p in params)
        any_filter = any((not p.greedy) and p.uses_filters for p in params)
        any_logprobs = any(p.logprobs is not None for p in params)
        any_bias = any(bool(p.logit_bias) or k < p.min_tokens for p, k in zip(params, outputs, strict=True))
        history = self._history(rows, s) if any_penalty else self.no_history[s]
        bias_ids, bias_values = self._bias(rows, s, ahead) if any_bias else self.no_bias[s]
        constrained = [(seq.matcher, i) for i, seq in enumerate(rows) if seq.matcher is not None]
        if constrained:
            start = time.perf_counter()
            mask = np.full((s, self.mask_width), -1, np.int32)
            fill_bitmask(constrained, mask)
            self.mask_seconds.append(time.perf_counter() - start)
        else:
            mask = self.no_mask[s]
        return SamplingTensors(temperature, top_k, top_p, min_p, rep, freq, pres, seeds, choices, steps, bias_ids,
                               bias_values, history, num_prompt, np.bool_(any_filter), np.bool_(any_penalty),
                               np.bool_(any_random), np.bool_(any_logprobs), mask, np.bool_(bool(constrained)),
                               np.bool_(any_bias))

    def _history(self, rows: list[Sequence], s: int) -> np.ndarray:
        history = np.full((s, self.max_model_len), -1, np.int32)
        for i, seq in enumerate(rows):
            if seq.params.uses_penalties:
                history[i, :seq.num_tokens] = seq.token_ids
        return history

    def _bias(self, rows: list[Sequence], s: int, ahead: list[int]) -> tuple[np.ndarray, np.ndarray]:
        bias_ids = np.full((s, self.bias_width), -1, np.int32)
        bias_values = np.zeros((s, self.bias_width), np.float32)
        for i, seq in enumerate(rows):
            p = seq.params
            entries = dict(p.logit_bias or {})
            if seq.num_output_tokens + ahead[i] < p.min_tokens:
                banned = p.stop_token_ids + (() if p.ignore_eos else self.eos_token_ids)
                entries.update(dict.fromkeys(banned, -np.inf))
            entries = {int(k): v for k, v in entries.items() if 0 <= int(k) < self.vocab_size}
            bias_ids[i, :len(entries)] = list(entries)
            bias_values[i, :len(entries)] = list(entries.values())
        return bias_ids, bias_values
