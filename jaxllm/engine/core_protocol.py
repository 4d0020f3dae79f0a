"""The messages between API servers and an engine-core process (ZeroMQ DEALER -> ROUTER), as msgspec structs
encoded to msgpack arrays whose first item is the message's tag:

client -> core (`ClientMessage`)                 core -> client (`CoreMessage`)
  Hello                                            Challenge(nonce)
  Auth(hmac_sha256(secret, nonce))                 Ready(CoreInfo) | Refused(reason)
  Add(id, text, ids, params, cache_salt,           Outs([Out(id, WireGeneration | WirePooling) | Fail, ...])
      images, lora)                                   (one engine step's, for this client)
  Abort(id)                                        Fail(id, kind, message)  (an add refused at once)
                                                   Stats(stats)             (also the core's heartbeat)

Decoding checks every field's type: a malformed message is refused as a whole (`msgspec.ValidationError`);
items past a message's last field are ignored (a newer peer's additions).
The shared secret never crosses the wire: the core sends a fresh nonce and the client answers with its HMAC.
The core only ever sees token ids, sampling parameters and preprocessed image patches (prompts are tokenized,
images decoded and preprocessed, and both validated by the API side's `Frontend`; the core checks them again);
it sends each output as the engine made it (of the request's `RequestOutputKind`: an API server streams DELTA
outputs, so a long generation costs O(tokens), not O(tokens^2), on the wire and on both sides of it)."""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any, Literal

import msgspec
import numpy as np

from jaxllm.lora.request import LoRARequest
from jaxllm.lora.spec import LoRASpec
from jaxllm.multimodal.inputs import MultiModalSpec
from jaxllm.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import RequestLimits, SamplingParams

NONCE_BYTES = 32


class _Message(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    pass


# -- the handshake
class Hello(_Message, tag="hello"):
    pass


class Challenge(_Message, tag="challenge"):
    nonce: bytes


class Auth(_Message, tag="auth"):
    proof: bytes


class CoreInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What an API server needs of the core: its request limits and tokenizer source, to validate and tokenize
    prompts on its own side, and its capacity."""
    model_name: str
    limits: RequestLimits
    eos_token_ids: tuple[int, ...]
    score_template: str | None = None
    mm_spec: MultiModalSpec | None = None
    lora_spec: LoRASpec | None = None  # what the API server checks adapters against (None: the core serves none)
    max_num_seqs: int
    max_waiting_requests: int
    page_size: int
    model: str | None = None  # where the API server loads the tokenizer from (None: the embedded model)
    revision: str | None = None
    download_dir: str | None = None
    rank: int = 0  # data-parallel rank
    stats: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def capacity(self) -> int:
        return self.max_num_seqs + self.max_waiting_requests


class Ready(_Message, tag="ready"):
    info: CoreInfo


class Refused(_Message, tag="refused"):
    reason: str


# -- requests
class WireImage(_Message):
    rows: bytes  # float32 patches, [patches, patch_dim]
    grid: tuple[int, int, int]


class WireLoRA(_Message):
    """A `LoRARequest` (the core reads the adapter from the path; API servers and the core share a filesystem)."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    @classmethod
    def of(cls, request: LoRARequest | None) -> WireLoRA | None:
        return None if request is None else cls(request.lora_name, request.lora_int_id, request.lora_path)

    def request(self) -> LoRARequest:
        """ValueError: not a valid request."""
        return LoRARequest(self.lora_name, self.lora_int_id, self.lora_path)


class Add(_Message, tag="add"):
    request_id: str
    text: str | None
    ids: list[int]
    params: dict[str, Any]  # SamplingParams or PoolingParams (`params_from_wire`)
    cache_salt: str | None = None
    images: list[WireImage] | None = None
    lora: WireLoRA | None = None


class Abort(_Message, tag="abort"):
    request_id: str


# -- outputs
class WireLogprob(_Message):
    token_id: int
    logprob: float
    rank: int
    decoded_token: str


class WireChoice(_Message):
    """A `CompletionOutput`."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[list[WireLogprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class WireGeneration(_Message, tag="gen"):
    """A `RequestOutput`, less what the client knows (its id, prompt and prompt ids)."""
    finished: bool
    num_cached_tokens: int
    error: str | None
    choices: list[WireChoice]
    prompt_logprobs: list[list[WireLogprob] | None] | None = None


class WirePooling(_Message, tag="pool"):
    finished: bool
    num_cached_tokens: int
    error: str | None
    data: bytes | None  # the vector as float32 bytes


class Out(_Message, tag="out"):
    request_id: str
    output: WireGeneration | WirePooling


class Fail(_Message, tag="fail"):
    request_id: str
    kind: Literal["invalid", "dead", "full", "error"]
    message: str


class Outs(_Message, tag="outs"):
    items: list[Out | Fail]


class Stats(_Message, tag="stats"):
    stats: dict[str, Any]


ClientMessage = Hello | Auth | Add | Abort
CoreMessage = Challenge | Ready | Refused | Outs | Fail | Stats

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_core_decoder = msgspec.msgpack.Decoder(CoreMessage)


def encode(message: _Message) -> bytes:
    return _encoder.encode(message)


def decode_client(payload: bytes) -> ClientMessage:
    """A message the core received; raises msgspec.DecodeError (a subclass of ValueError) if it is malformed."""
    return _client_decoder.decode(payload)


def decode_core(payload: bytes) -> CoreMessage:
    return _core_decoder.decode(payload)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def prove(secret: str, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), nonce, hashlib.sha256).digest()


def verify(secret: str, nonce: bytes, proof: Any) -> bool:
    return isinstance(proof, bytes) and hmac.compare_digest(prove(secret, nonce), proof)


def params_to_wire(params: SamplingParams | PoolingParams) -> dict[str, Any]:
    """The params as msgpack carries them (tuples become lists): what the core decodes, for `params_from_wire`."""
    return msgspec.msgpack.decode(_encoder.encode(params))


def params_from_wire(value: Any) -> SamplingParams | PoolingParams:
    """A request's params as encoded from either dataclass (only PoolingParams has a `task`); validated again."""
    kind = PoolingParams if isinstance(value, dict) and "task" in value else SamplingParams
    return msgspec.convert(value, kind, strict=False)


def _to_wire(entry: dict[int, Logprob]) -> list[WireLogprob]:
    return [WireLogprob(tid, lp.logprob, lp.rank, lp.decoded_token) for tid, lp in entry.items()]


def _from_wire(entry: list[WireLogprob]) -> dict[int, Logprob]:
    return {w.token_id: Logprob(w.logprob, w.rank, w.decoded_token) for w in entry}


def output_to_wire(out: RequestOutput | PoolingRequestOutput) -> WireGeneration | WirePooling:
    if isinstance(out, PoolingRequestOutput):
        data = None if out.outputs is None else np.asarray(out.outputs.data, np.float32).tobytes()
        return WirePooling(out.finished, out.num_cached_tokens, out.error, data)
    choices = [WireChoice(c.index, c.text, c.token_ids, None if c.logprobs is None else
                          [_to_wire(entry) for entry in c.logprobs], c.cumulative_logprob, c.finish_reason,
                          c.stop_reason) for c in out.outputs]
    prompt = None if out.prompt_logprobs is None else [None if e is None else _to_wire(e)
                                                        for e in out.prompt_logprobs]
    return WireGeneration(out.finished, out.num_cached_tokens, out.error, choices, prompt)


def output_from_wire(wire: WireGeneration | WirePooling, request_id: str, prompt: str | None,
                     prompt_ids: list[int]) -> RequestOutput | PoolingRequestOutput:
    """The engine's output again, for the client's request `request_id` (whose prompt the client kept)."""
    if isinstance(wire, WirePooling):
        pooled = None if wire.data is None else PoolingOutput(np.frombuffer(wire.data, np.float32).copy())
        return PoolingRequestOutput(request_id, prompt, prompt_ids, pooled, wire.finished, error=wire.error,
                                    num_cached_tokens=wire.num_cached_tokens)
    choices = [CompletionOutput(c.index, c.text, c.token_ids, c.cumulative_logprob,
                                None if c.logprobs is None else [_from_wire(e) for e in c.logprobs],
                                c.finish_reason, c.stop_reason) for c in wire.choices]
    prompt_logprobs = None if wire.prompt_logprobs is None else [None if e is None else _from_wire(e)
                                                                 for e in wire.prompt_logprobs]
    return RequestOutput(request_id, prompt, prompt_ids, choices, wire.finished,
                         num_cached_tokens=wire.num_cached_tokens, error=wire.error, prompt_logprobs=prompt_logprobs)
