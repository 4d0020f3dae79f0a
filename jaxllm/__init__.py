"""jaxllm: LLM inference and serving in pure JAX."""

from jaxllm.engine.config import EngineConfig
from jaxllm.llm import LLM
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
