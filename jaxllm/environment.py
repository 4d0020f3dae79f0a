"""The process settings jaxllm reads from the environment, in one place. JAX-free: gunicorn's master reads them
before any worker starts. The engine's and the API's own options (JAXLLM_MODEL, JAXLLM_MAX_NUM_SEQS, ...) are
read by `server.settings`; these say which processes run, where they listen, how long they wait, and what they
log. (`JAXLLM_CPU_INT8_ISA`, a CPU kernel's override, stays with its kernel: `pallas_kernels.quantized_matmul.isa`.)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

ENGINE_CORE_ADDRESS = "tcp://127.0.0.1:5555"  # where a headless engine core listens unless told


@dataclasses.dataclass(frozen=True)
class Environment:
    bind: str = "0.0.0.0:8000"  # JAXLLM_BIND: the API server's host:port
    api_servers: int = 1  # JAXLLM_API_SERVERS: API worker processes
    data_parallel_size: int = 1  # JAXLLM_DATA_PARALLEL_SIZE: engine cores, one per rank
    num_hosts: int = 1  # JAXLLM_NUM_HOSTS: hosts one model spans
    host_rank: int = 0  # JAXLLM_HOST_RANK
    engine_address: str | None = None  # JAXLLM_ENGINE_ADDRESS: engine cores to use (comma-separated)
    engine_secret: str | None = None  # JAXLLM_ENGINE_SECRET: shared with them
    engine_bind: str = ENGINE_CORE_ADDRESS  # JAXLLM_ENGINE_BIND: where a headless engine core listens
    worker_timeout_s: int = 600  # JAXLLM_WORKER_TIMEOUT: loading and compiling before serving
    drain_timeout_s: float = 30.0  # JAXLLM_DRAIN_TIMEOUT: in-flight requests' time to finish at a stop
    log_level: str = "info"  # JAXLLM_LOG_LEVEL
    ssl_certfile: str | None = None  # JAXLLM_SSL_CERTFILE and JAXLLM_SSL_KEYFILE: TLS, by gunicorn
    ssl_keyfile: str | None = None
    heartbeat_timeout_s: int = 10  # JAXLLM_HEARTBEAT_TIMEOUT: multi-host, a silent host is gone after it
    multihost_init_timeout_s: int = 300  # JAXLLM_MULTIHOST_INIT_TIMEOUT: every host joined within it
    step_timeout_s: float = 60.0  # JAXLLM_STEP_TIMEOUT: multi-host, a step that takes longer ends the job

    def __post_init__(self) -> None:
        for name in ("api_servers", "data_parallel_size", "num_hosts"):
            if getattr(self, name) < 1:
                raise ValueError(f"JAXLLM_{name.upper()}={getattr(self, name)}: at least 1")
        if self.num_hosts > 1 and self.data_parallel_size > 1:
            raise ValueError("JAXLLM_NUM_HOSTS > 1 with JAXLLM_DATA_PARALLEL_SIZE > 1 is not supported yet")

    @property
    def engine_process(self) -> bool:
        """Whether the gunicorn master runs engine cores (several API servers or ranks, or several hosts: a
        multi-host job ends every process when a host fails, so its engine must not live in the API worker)
        rather than the worker holding the engine, or cores started elsewhere."""
        return (self.api_servers > 1 or self.data_parallel_size > 1 or self.num_hosts > 1) and \
            not self.engine_address

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> Environment:
        env = os.environ if env is None else env
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        names = {"worker_timeout_s": "WORKER_TIMEOUT", "drain_timeout_s": "DRAIN_TIMEOUT",
                 "heartbeat_timeout_s": "HEARTBEAT_TIMEOUT", "multihost_init_timeout_s": "MULTIHOST_INIT_TIMEOUT",
                 "step_timeout_s": "STEP_TIMEOUT"}
        values = {}
        for field, kind in kinds.items():
            raw = env.get("JAXLLM_" + names.get(field, field.upper()))
            if raw in (None, ""):
                continue
            convert = {"int": int, "float": float}.get(kind.split(" ")[0], str)
            try:
                values[field] = convert(raw)
            except ValueError:
                raise ValueError(f"JAXLLM_{names.get(field, field.upper())}={raw!r}: expected a {kind}") from None
        return cls(**values)
