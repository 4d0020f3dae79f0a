"""What the app holds: the engine loop, settings, metrics, and a count of unfinished requests."""

from __future__ import annotations

import dataclasses

from jaxllm.engine.core_client import EngineCoreClient
from jaxllm.engine.dp_client import DataParallelClient
from jaxllm.engine.engine_loop import EngineLoop
from server.metrics import ServerMetrics
from server.settings import ServerSettings


@dataclasses.dataclass
class ServerState:
    settings: ServerSettings
    loop: EngineLoop | EngineCoreClient | DataParallelClient  # the engine here, or engine-core processes' client
    metrics: ServerMetrics
    active_requests: int = 0  # touched only by request greenlets (one hub thread)

    @property
    def engine(self):
        return self.loop.engine

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def capacity(self) -> int:
        """Requests in flight beyond which new ones get 429: the running batch plus the waiting queue."""
        return self.loop.capacity
