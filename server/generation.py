"""Submitting prompts to the engine loop for one HTTP request and following their outputs."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator

from jaxllm.engine.engine_loop import EngineDeadError
from jaxllm.errors import EngineBusyError, InvalidRequestError
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from server.bridge import OutputStream
from server.errors import APIError
from server.state import ServerState

POLL_S = 0.25  # how often a waiting request checks that its client and the engine are still there


class Held:
    """A streamed choice's tokens not sent yet (their text is empty so far: a partial character, a held-back
    stop string): they go out with the choice's next chunk, so that every token's logprobs are sent once."""

    def __init__(self):
        self.text, self.token_ids, self.logprobs = "", [], None

    def keep(self, c: CompletionOutput, text: bool = True) -> None:
        """c: what `take` returned (this one's held part included); text: keep its text too (False: the caller
        consumed it)."""
        self.text, self.token_ids, self.logprobs = c.text if text else "", c.token_ids, c.logprobs

    def take(self, c: CompletionOutput) -> CompletionOutput:
        """c (a delta) with what was held before it."""
        if not self.token_ids and not self.text:
            return c
        merged = dataclasses.replace(c, text=self.text + c.text, token_ids=self.token_ids + c.token_ids,
                                     logprobs=None if c.logprobs is None else (self.logprobs or []) + c.logprobs)
        self.text, self.token_ids, self.logprobs = "", [], None
        return merged


class ClientGone(Exception):
    """The client closed its connection before the answer was ready; its engine requests are aborted."""


class Joined:
    """A request's DELTA outputs added up, for an answer given whole: O(tokens) over the request."""

    def __init__(self):
        self.last: RequestOutput | None = None
        self.prompt_logprobs = None
        self.choices: dict[int, tuple[list[str], list[int], list | None, CompletionOutput]] = {}

    def add(self, out: RequestOutput | PoolingRequestOutput) -> None:
        if isinstance(out, PoolingRequestOutput):  # one output, when pooled
            self.last = out
            return
        if self.last is None:
            self.prompt_logprobs = out.prompt_logprobs  # (a DELTA stream sends them with its first output)
        self.last = out
        for c in out.outputs:
            text, ids, logprobs, _ = self.choices.setdefault(c.index, ([], [], None if c.logprobs is None else [], c))
            text.append(c.text)
            ids += c.token_ids
            if logprobs is not None:
                logprobs += c.logprobs
            self.choices[c.index] = (text, ids, logprobs, c)

    def output(self) -> RequestOutput | PoolingRequestOutput:
        if isinstance(self.last, PoolingRequestOutput):
            return self.last
        outputs = [dataclasses.replace(c, text="".join(text), token_ids=ids, logprobs=logprobs)
                   for text, ids, logprobs, c in (self.choices[i] for i in sorted(self.choices))]
        return dataclasses.replace(self.last, outputs=outputs, prompt_logprobs=self.prompt_logprobs)


class Generation:
    """The engine requests behind one HTTP request (one per prompt, each already `engine.prepare_prompt`d). They
    ask for DELTA outputs (each carries what is new: a stream costs O(tokens)); an answer given whole adds them up
    (`Joined`), and every output still marks the time to first token and between tokens.

    Engine request ids are generated here, never taken from the client (an `X-Request-Id` a client chose could
    name another client's request, to abort it or to collide with it)."""

    def __init__(self, state: ServerState, prompts: list[tuple[str | None, list[int]]],
                 params: SamplingParams | PoolingParams, *,
                 cache_salt: str | None = None, client_gone: Callable[[], bool] | None = None,
                 lora_request: LoRARequest | None = None):
        if not state.loop.alive:
            raise APIError(503, "the engine is not running", code="engine_dead")
        if len(prompts) * params.n > state.capacity:
            raise APIError(400, f"{len(prompts)} prompts x n={params.n} exceed what this server holds at once "
                           f"({state.capacity} sequences)", param="n")
        if state.active_requests + len(prompts) > state.capacity:
            raise APIError(429, "the server's request queue is full; retry later", code="queue_full")
        self.state = state
        self.client_gone = client_gone
        base = uuid.uuid4().hex
        self.ids = [f"{base}-{i}" for i in range(len(prompts))]
        self.prompt_ids = [p[1] for p in prompts]  # each prompt's token ids as the engine gets them
        if isinstance(params, SamplingParams):
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        self.joined: dict[str, Joined] = {}  # each request's outputs so far, added up by `wait`
        self.finished: set[str] = set()
        self.prompt_tokens = self.completion_tokens = 0
        self.stream = OutputStream()
        self.start = time.monotonic()
        self.first_output_at: float | None = None
        self.done = False
        added = []
        try:
            for rid, prompt in zip(self.ids, prompts, strict=True):
                state.loop.add_request(rid, None, params, self.stream.push, cache_salt=cache_salt, prepared=prompt,
                                       lora_request=lora_request)
                added.append(rid)
        except EngineDeadError as e:
            self._abort(added)
            raise APIError(503, str(e), code="engine_dead") from None
        state.active_requests += len(self.ids)

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.state.loop.abort_request(rid)

    def updates(self) -> Iterator[RequestOutput]:
        """Yields each output as it arrives until every prompt is finished. Raises ClientGone when the client
        left, APIError when the engine died or the request failed."""
        metrics = self.state.metrics
        last = None
        checked = time.monotonic()
        while len(self.finished) < len(self.ids):
            item = self.stream.get(timeout=POLL_S)
            now = time.monotonic()
            if item is None or now - checked >= POLL_S:  # outputs may arrive every step: check on a clock
                checked = now
                if not self.state.loop.alive:
                    raise APIError(503, "the engine died", code="engine_dead")
                if self.client_gone is not None and self.client_gone():
                    self.finish()
                    raise ClientGone
            if item is None:
                continue
            if isinstance(item, EngineDeadError):
                raise APIError(503, f"the engine failed: {item}", code="engine_dead")
            if isinstance(item, EngineBusyError):
                raise APIError(429, f"the server's request queue is full; retry later ({item})", code="queue_full")
            if isinstance(item, InvalidRequestError):  # what only the engine could check (an adapter's files
                raise APIError(400, str(item), param=item.param)  # changed since the server checked them)
            if isinstance(item, Exception):
                raise APIError(500, f"the request failed: {item}", code="request_failed")
            if item.error is not None:
                raise APIError(500, f"the request failed: {item.error}", code="request_failed")
            if self.first_output_at is None:
                self.first_output_at = now
                metrics.ttft.observe(now - self.start)
            elif last is not None:
                metrics.itl.observe(now - last)
            last = now
            if item.request_id not in self.joined:
                self.prompt_tokens += len(item.prompt_token_ids)
                self.joined[item.request_id] = Joined()
            if isinstance(item, RequestOutput):
                self.completion_tokens += sum(len(c.token_ids) for c in item.outputs)
            if item.finished:
                self.finished.add(item.request_id)
            yield item
        self.finish()

    def wait(self) -> list[RequestOutput]:
        """Each prompt's whole output, once every one finished."""
        try:
            for out in self.updates():
                self.joined[out.request_id].add(out)
        finally:
            self.finish()
        return [self.joined[i].output() for i in self.ids]

    def finish(self) -> None:
        """Releases the request's slot; aborts the engine requests if they are still running."""
        if self.done:
            return
        self.done = True
        self.state.active_requests -= len(self.ids)
        unfinished = [i for i in self.ids if i not in self.finished]
        self._abort(unfinished)
        if not unfinished:
            self.state.metrics.e2e.observe(time.monotonic() - self.start)

    @property
    def usage(self) -> dict[str, int]:
        prompt, completion = self.prompt_tokens, self.completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
