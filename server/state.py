"""What the app holds: the engine loop, settings, metrics, and a count of unfinished requests."""

from __future__ import annotations

import dataclasses

from jaxllm.engine.engine_client import EngineClient
from jaxllm.engine.frontend import Frontend
from server.lora_modules import LoRARegistry
from server.metrics import ServerMetrics
from server.settings import ServerSettings


@dataclasses.dataclass
class ServerState:
    settings: ServerSettings
    loop: EngineClient  # the engine loop here, or the engine-core processes' client
    metrics: ServerMetrics
    loras: LoRARegistry  # adapters served by name
    active_requests: int = 0  # touched only by request greenlets (one hub thread)

    @property
    def frontend(self) -> Frontend:
        return self.loop.frontend

    @property
    def model_name(self) -> str:
        return self.frontend.model_name

    @property
    def capacity(self) -> int:
        """Requests in flight beyond which new ones get 429: the running batch plus the waiting queue."""
        return self.loop.capacity
