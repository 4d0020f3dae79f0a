"""jaxllm: LLM inference and serving in pure JAX."""

from jaxllm.engine.config import EngineConfig
from jaxllm.llm import LLM
from jaxllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "PoolingOutput", "PoolingParams", "PoolingRequestOutput",
           "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
