"""Prompt logprobs (vLLM's ``SamplingParams(prompt_logprobs=k)``): for every prompt token after the first, its log
probability given the tokens before it, its rank, and the k likeliest tokens at that position.

On the device, a step computes them for the rows whose next prompt token it is given (`targets`, -1 elsewhere):
only when some row has one (a `lax.cond`, so an ordinary step pays nothing), and a block of rows at a time, so that
a step's logits are never all materialised at once ([block, V], not [T, V]). On the host, `spans` says which rows
belong to which sequence's prompt positions, and `fill` writes the request's entries (by position, so a prompt
computed again after a preemption writes the same entries again)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.outputs import Logprob
from jaxllm.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from jaxllm.engine.sequence import Request

BLOCK_ROWS = 256  # rows whose logits are computed together: [BLOCK_ROWS, V] float32 at most


def width(vocab_size: int) -> int:
    """Int32 columns per row: logprob bits, rank, top ids, top logprob bits."""
    return 2 + 2 * min(MAX_LOGPROBS, vocab_size)


def _block(t: int) -> int:
    return max(d for d in range(1, min(t, BLOCK_ROWS) + 1) if t % d == 0)


def compute(logits: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
            vocab_size: int) -> jax.Array:
    """hidden [T, E], targets [T] i32 (the next prompt token of a row, or -1) -> [T, width] i32 (zeros where no
    row of the step has a target)."""
    t = hidden.shape[0]
    r, k = _block(t), min(MAX_LOGPROBS, vocab_size)
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)  # noqa: E731

    def block(args):
        h, target = args
        raw = jax.nn.log_softmax(logits(h), axis=-1)  # [r, V]
        chosen = jnp.take_along_axis(raw, jnp.maximum(target, 0)[:, None], axis=-1)[:, 0]
        rank = 1 + jnp.sum(raw > chosen[:, None], axis=-1, dtype=jnp.int32)
        top_lp, top_ids = jax.lax.top_k(raw, k)
        return jnp.concatenate([bits(chosen)[:, None], rank[:, None], top_ids.astype(jnp.int32), bits(top_lp)], 1)

    def run(_):
        blocks = (hidden.reshape(t // r, r, hidden.shape[-1]), targets.reshape(t // r, r))
        return jax.lax.map(block, blocks).reshape(t, 2 + 2 * k)

    return jax.lax.cond(jnp.any(targets >= 0), run, lambda _: jnp.zeros((t, 2 + 2 * k), jnp.int32), None)


@dataclasses.dataclass(frozen=True)
class Span:
    """Rows [row, row + count) of a step hold prompt positions [position, position + count) of `request`."""
    request: Request
    row: int
    position: int
    count: int


def targets(step_seqs, num_new_tokens, num_rows: int) -> tuple[np.ndarray, list[Span]]:
    """The step's targets ([num_rows] i32) and spans: the prefill rows of requests that asked for prompt logprobs
    (their first choice's sequence), each given the prompt token that follows it."""
    out = np.full(num_rows, -1, np.int32)
    spans = []
    at = 0
    for seq, n in zip(step_seqs, num_new_tokens, strict=True):
        request = seq.request
        start = seq.num_computed_tokens
        if request.prompt_logprobs is not None and seq.index == 0 and start < seq.num_prompt_tokens - 1:
            count = min(n, seq.num_prompt_tokens - 1 - start)  # the last prompt token's row samples instead
            out[at:at + count] = request.prompt_token_ids[start + 1:start + 1 + count]
            spans.append(Span(request, at, start, count))
        at += n
    return out, spans


def fill(packed: np.ndarray, spans: list[Span], token_text: Callable[[int], str]) -> None:
    """Writes each span's entries into its request's `prompt_logprobs` (index = the position of the token scored)."""
    k = (packed.shape[1] - 2) // 2
    floats = packed.view(np.float32)
    for span in spans:
        want = span.request.params.prompt_logprobs
        for j in range(span.count):
            row, position = span.row + j, span.position + j + 1
            token = span.request.prompt_token_ids[position]
            entry = {token: Logprob(float(floats[row, 0]), int(packed[row, 1]), token_text(token))}
            for rank in range(min(want, k)):
                tid = int(packed[row, 2 + rank])
                entry.setdefault(tid, Logprob(float(floats[row, 2 + k + rank]), rank + 1, token_text(tid)))
            span.request.prompt_logprobs[position] = entry
