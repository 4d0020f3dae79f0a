"""jaxllm: LLM inference and serving in pure JAX.

The public names load on first use: ``import jaxllm`` (and the ``jaxllm`` command's parsing, and a gunicorn
master that imports `jaxllm.cli`) does not import JAX."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "jaxllm.llm",
    "CompletionOutput": "jaxllm.outputs", "PoolingOutput": "jaxllm.outputs",
    "PoolingRequestOutput": "jaxllm.outputs", "RequestOutput": "jaxllm.outputs",
    "EngineConfig": "jaxllm.engine.config",
    "PoolingParams": "jaxllm.pooling_params",
    "RequestOutputKind": "jaxllm.sampling_params", "SamplingParams": "jaxllm.sampling_params",
    "SpeculativeConfig": "jaxllm.speculative.config",
    "LoRARequest": "jaxllm.lora.request",
}
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LoRARequest", "PoolingOutput", "PoolingParams",
           "PoolingRequestOutput", "RequestOutput", "RequestOutputKind", "SamplingParams", "SpeculativeConfig"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from jaxllm.engine.config import EngineConfig
    from jaxllm.llm import LLM
    from jaxllm.lora.request import LoRARequest
    from jaxllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
    from jaxllm.pooling_params import PoolingParams
    from jaxllm.sampling_params import RequestOutputKind, SamplingParams
    from jaxllm.speculative.config import SpeculativeConfig


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
