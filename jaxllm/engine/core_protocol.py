"""The messages between API servers and an engine-core process (ZeroMQ DEALER -> ROUTER, msgpack by msgspec).

Every message is a msgpack array whose first item names it:

client -> core                                   core -> client
  ["hello"]                                        ["challenge", nonce]
  ["auth", hmac_sha256(secret, nonce)]             ["ready", info] | ["refused", reason]
  ["add", id, text, ids, params, cache_salt(,      ["outs", [item, ...]]  (one engine step's, for this client)
         images)]                                    item: ["out", id, delta]   (see OutputDeltas)
    (params: SamplingParams, or PoolingParams;
     images: MultiModalInputs.to_wire)
                                                         | ["fail", id, kind, message]  (invalid | dead | error)
  ["abort", id]                                    ["fail", id, kind, message]  (an add refused at once;
                                                                                 kind full: at capacity)
                                                   ["stats", stats]       (also the core's heartbeat)

The shared secret never crosses the wire: the core sends a fresh nonce and the client answers with its HMAC.
The core only ever sees token ids, sampling parameters and preprocessed image patches (prompts are tokenized,
images decoded and preprocessed, and both validated by the API side's `Frontend`; the core checks them again);
it sends outputs as deltas, so a long generation costs O(tokens), not O(tokens^2), on the wire."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from jaxllm.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()
NONCE_BYTES = 32


def encode(*items: Any) -> bytes:
    return _encoder.encode(items)


def decode(payload: bytes) -> list:
    message = _decoder.decode(payload)
    if not isinstance(message, list) or not message or not isinstance(message[0], str):
        raise ValueError("not an engine-core message")
    return message


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def prove(secret: str, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), nonce, hashlib.sha256).digest()


def verify(secret: str, nonce: bytes, proof: Any) -> bool:
    return isinstance(proof, bytes) and hmac.compare_digest(prove(secret, nonce), proof)


def params_from_wire(value: Any) -> SamplingParams | PoolingParams:
    """A request's params as encoded from either dataclass (only PoolingParams has a `task`)."""
    kind = PoolingParams if isinstance(value, dict) and "task" in value else SamplingParams
    return msgspec.convert(value, kind, strict=False)


def _to_wire(entry: dict[int, Logprob]) -> list:
    """One token's {token id: Logprob} as msgpack-able lists."""
    return [[tid, lp.logprob, lp.rank, lp.decoded_token] for tid, lp in entry.items()]


def _from_wire(entry: list) -> dict[int, Logprob]:
    return {int(tid): Logprob(float(lp), rank, str(tok)) for tid, lp, rank, tok in entry}


@dataclasses.dataclass
class _Sent:
    text: str = ""
    tokens: int = 0
    logprobs: int = 0


class OutputDeltas:
    """Core side: turns a request's cumulative outputs into deltas against what was already sent."""

    def __init__(self):
        self._sent: dict[int, _Sent] = {}
        self._prompt_logprobs_sent = False

    def delta(self, out: RequestOutput | PoolingRequestOutput) -> list:
        if isinstance(out, PoolingRequestOutput):  # sent once, finished: its vector as float32 bytes
            data = None if out.outputs is None else np.asarray(out.outputs.data, np.float32).tobytes()
            return [out.finished, out.num_cached_tokens, out.error, None, data]
        choices = []
        for c in out.outputs:
            sent = self._sent.setdefault(c.index, _Sent())
            keep = len(sent.text) if c.text.startswith(sent.text) else len(os.path.commonprefix([sent.text, c.text]))
            logprobs = None if c.logprobs is None else [_to_wire(entry) for entry in c.logprobs[sent.logprobs:]]
            choices.append([c.index, keep, c.text[keep:], c.token_ids[sent.tokens:], logprobs, c.cumulative_logprob,
                            c.finish_reason, c.stop_reason])
            sent.text, sent.tokens = c.text, len(c.token_ids)
            sent.logprobs = 0 if c.logprobs is None else len(c.logprobs)
        prompt = None  # sent once, with the first output (the prompt is prefilled by then)
        if out.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            prompt = [None if e is None else _to_wire(e) for e in out.prompt_logprobs]
            self._prompt_logprobs_sent = True
        return [out.finished, out.num_cached_tokens, out.error, choices, prompt]


class OutputAssembler:
    """Client side: rebuilds a request's cumulative `RequestOutput`s from the core's deltas and hands each to the
    request's callback."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                 on_output: Callable[[RequestOutput | Exception], None]):
        self.request_id, self.prompt, self.prompt_ids, self.on_output = request_id, prompt, prompt_ids, on_output
        self._choices: dict[int, CompletionOutput] = {}
        self._prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def apply(self, delta: list) -> RequestOutput | PoolingRequestOutput:
        if delta[3] is None:  # a pooling request's
            finished, num_cached, error, _, data = delta
            pooled = None if data is None else PoolingOutput(np.frombuffer(data, np.float32).copy())
            out = PoolingRequestOutput(self.request_id, self.prompt, self.prompt_ids, pooled, bool(finished),
                                       error=error, num_cached_tokens=int(num_cached))
            self.on_output(out)
            return out
        finished, num_cached, error, choices, prompt = delta
        if prompt is not None:
            self._prompt_logprobs = [None if e is None else _from_wire(e) for e in prompt]
        for index, keep, text, ids, logprobs, cumulative, finish_reason, stop_reason in choices:
            old = self._choices.get(index)
            old_logprobs = None if old is None else old.logprobs
            new_logprobs = None if logprobs is None else (old_logprobs or []) + [_from_wire(e) for e in logprobs]
            self._choices[index] = CompletionOutput(
                index=index, text=("" if old is None else old.text[:keep]) + text,
                token_ids=([] if old is None else old.token_ids) + list(ids), cumulative_logprob=cumulative,
                logprobs=new_logprobs, finish_reason=finish_reason, stop_reason=stop_reason)
        out = RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids,
                            outputs=[self._choices[i] for i in sorted(self._choices)], finished=bool(finished),
                            num_cached_tokens=int(num_cached), error=error, prompt_logprobs=self._prompt_logprobs)
        self.on_output(out)
        return out
