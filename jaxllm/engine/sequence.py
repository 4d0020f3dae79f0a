"""Requests and their sequences (one per choice when n > 1), with the state the scheduler tracks."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.lora.request import LoRARequest
from jaxllm.multimodal.inputs import MultiModalInputs
from jaxllm.outputs import Logprob
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams


class Emitted:
    """How much of a sequence its request's outputs carried so far: a DELTA output carries what lies past these
    (written by `request_outputs` alone)."""
    __slots__ = ("chars", "logprobs", "tokens")

    def __init__(self):
        self.chars = self.tokens = self.logprobs = 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    def __init__(self, request: Request, index: int, detokenizer: IncrementalDetokenizer | None):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index  # choice index within the request
        self.token_ids: list[int] = list(request.prompt_token_ids)  # prompt + generated
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.block_table: list[int] = []
        self.page_hashes: list[bytes] = []  # chained hashes of this sequence's full pages, in order
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, Logprob]] | None = [] if request.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.detokenizer = detokenizer
        self.num_preemptions = 0
        self.matcher = None  # llguidance.LLMatcher of a constrained sequence: advanced by each token it gets
        self.pooled = None  # a pooling request's PooledState: it is prefilled, pooled, and never decodes
        self.emitted = Emitted()
        self.drafts: list[int] = []  # speculative tokens proposed for its next step (`jaxllm.speculative`)
        self.lora_slot: int | None = None  # the device slot of its adapter while it runs (`jaxllm.lora.manager`)

    @property
    def params(self) -> SamplingParams | PoolingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request.request_id}#{self.index}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, pages={len(self.block_table)})")


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams | PoolingParams,
                 seed: int, on_output: Callable | None = None, cache_salt: str | None = None,
                 mm: MultiModalInputs | None = None, lora_request: LoRARequest | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.cache_salt = cache_salt  # requests with different salts never share prefix-cache pages
        self.mm = mm  # a vision-language prompt's images and M-RoPE positions
        self.lora_request = lora_request  # its adapter (`jaxllm.lora.LoRARequest`), None: the base model
        self.seed = seed  # the request's seed, or one drawn by the engine: sampling is reproducible per request
        self.on_output = on_output  # called on the engine thread with each RequestOutput
        self.seqs: list[Sequence] = []
        self.error: str | None = None  # set when handling this request raised; it then ends
        self.num_outputs = 0  # generation outputs built so far (written by `request_outputs`: DELTA's first)
        # vLLM's prompt_logprobs: entry i scores prompt token i given those before it (entry 0: None), filled as
        # the prompt is prefilled (`engine.prompt_logprobs`)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = \
            [None] * len(prompt_token_ids) if getattr(params, "prompt_logprobs", None) is not None else None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def prefix_salt(self) -> str | tuple[str | None, str] | None:
        """What its prefix-cache pages are keyed by besides their tokens: the tenant's cache_salt, and with an
        adapter (whose KV differs from the base model's for the same tokens) the pair (cache_salt, adapter), which
        no cache_salt string can equal (`block_manager.root_hash` hashes it in a domain of its own)."""
        if self.lora_request is None:
            return self.cache_salt
        return self.cache_salt, self.lora_request.cache_key
