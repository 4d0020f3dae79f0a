"""What a server's routes talk to, whichever the serve mode: the engine loop in this process (`EngineLoop`), one
engine-core process (`EngineCoreClient`) or several data-parallel ones (`DataParallelClient`). Prompts are
tokenized and validated by the client's `frontend` (in the API process in every mode); requests go in by id and
their outputs come back through each request's callback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from jaxllm.engine.frontend import Frontend, PreparedPrompt
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

OnOutput = Callable[[RequestOutput | PoolingRequestOutput | Exception], None]


@runtime_checkable
class EngineClient(Protocol):
    frontend: Frontend
    error: str | None  # why the engine died (None while it lives)

    @property
    def alive(self) -> bool: ...

    @property
    def stats(self) -> dict:
        """The engine's counters (summed over ranks)."""

    @property
    def rank_stats(self) -> list[dict]:
        """Per engine: one, or one per data-parallel rank."""

    @property
    def capacity(self) -> int:
        """Requests in flight beyond which a server refuses new ones."""

    def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams | PoolingParams,
                    on_output: OnOutput, cache_salt: str | None = None, *,
                    prepared: PreparedPrompt | None = None, lora_request: LoRARequest | None = None) -> None:
        """Raises InvalidRequestError (bad input) or EngineDeadError in the caller's thread; outputs (or an
        exception, if the request failed later) reach `on_output`. lora_request: the adapter it runs with (one
        the frontend's `check_lora` passed; the engine reads it again)."""

    def abort_request(self, request_id: str) -> None: ...

    def stop(self, drain_timeout_s: float = 0.0) -> None: ...
