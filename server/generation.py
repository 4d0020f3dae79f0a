"""Submitting prompts to the engine loop for one HTTP request and following their outputs."""

from __future__ import annotations

import time
from collections.abc import Iterator

from jaxllm.engine.engine_loop import EngineDeadError
from jaxllm.engine.llm_engine import PromptTooLongError
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams
from server.bridge import OutputStream
from server.errors import APIError
from server.state import ServerState


class Generation:
    """The engine requests behind one HTTP request (one per prompt), with their latest outputs."""

    def __init__(self, state: ServerState, request_id: str, prompts: list[str | list[int]], params: SamplingParams):
        if not state.loop.alive:
            raise APIError(503, "the engine is not running", code="engine_dead")
        if state.active_requests + len(prompts) > state.capacity:
            raise APIError(429, "the server's request queue is full; retry later", code="queue_full")
        self.state = state
        self.ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.latest: dict[str, RequestOutput] = {}
        self.stream = OutputStream()
        self.start = time.monotonic()
        self.first_output_at: float | None = None
        self.done = False
        added = []
        try:
            for rid, prompt in zip(self.ids, prompts, strict=True):
                state.loop.add_request(rid, prompt, params, self.stream.push)
                added.append(rid)
        except PromptTooLongError as e:
            self._abort(added)
            raise APIError(400, str(e), param="prompt",
                           code="context_length_exceeded") from None
        except EngineDeadError as e:
            self._abort(added)
            raise APIError(503, str(e), code="engine_dead") from None
        except ValueError as e:
            self._abort(added)
            raise APIError(400, str(e), param="prompt") from None
        state.active_requests += len(self.ids)

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.state.loop.abort_request(rid)

    def updates(self) -> Iterator[RequestOutput]:
        """Yields each output as it arrives until every prompt is finished."""
        metrics = self.state.metrics
        last = None
        while len([o for o in self.latest.values() if o.finished]) < len(self.ids):
            item = self.stream.get()
            if isinstance(item, Exception):
                raise APIError(503, f"the engine failed: {item}", code="engine_dead")
            now = time.monotonic()
            if self.first_output_at is None:
                self.first_output_at = now
                metrics.ttft.observe(now - self.start)
            elif last is not None:
                metrics.itl.observe(now - last)
            last = now
            self.latest[item.request_id] = item
            yield item
        self.finish()

    def wait(self) -> list[RequestOutput]:
        for _ in self.updates():
            pass
        return [self.latest[i] for i in self.ids]

    def finish(self) -> None:
        """Releases the request's slot; aborts the engine requests if they are still running."""
        if self.done:
            return
        self.done = True
        self.state.active_requests -= len(self.ids)
        unfinished = [i for i in self.ids if not (i in self.latest and self.latest[i].finished)]
        self._abort(unfinished)
        if not unfinished:
            self.state.metrics.e2e.observe(time.monotonic() - self.start)

    @property
    def usage(self) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in self.latest.values())
        completion = sum(len(c.token_ids) for o in self.latest.values() for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
