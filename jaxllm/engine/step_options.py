"""The XLA options the engine's step is compiled with, per platform.

On a GPU, XLA runs a step's kernels as CUDA graphs (command buffers). A conditional (the sampler's branches,
prompt logprobs) or a while loop left outside a graph runs as a host-side thunk: the host copies the predicate
back and waits for the device. Dispatching a step then returned only once the device had run it, and async
scheduling could not overlap the host's next step with the device (an H100 with jax 0.11.2: 10.9 ms of a batch-1
decode step spent in dispatch, the whole step; `benchmarks/device_check.py`'s host timeline). So:
- conditionals and while loops are recorded as graph nodes (CUDA graph conditional nodes: XLA needs a 12.3+
  driver for them), the predicate staying on the device;
- sorts are XLA's own kernels, not CUB's radix sort: a CUB sort is a custom call no graph can hold, and one in a
  branch (the top-k/top-p filter, logprob ranks, prompt logprobs) kept its whole conditional out of the graph;
- GEMMs are cuBLAS's, not XLA's Triton GEMM fusions: on an H100 an 8B model's decode at batch 1 ran 150 tok/s
  against 144 and a 1024-token prefill 36.4k tok/s against 32.7k; batch 32 the same (3,642 and 3,645 tok/s), and
  the six buckets built in 20.6 s against 35.1 s (the Triton GEMMs' autotuning, most likely;
  `benchmarks/device_check.py`).
"""

from __future__ import annotations

GPU_OPTIONS: dict[str, str | bool] = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE",
    "xla_gpu_enable_cub_radix_sort": False,
    "xla_gpu_enable_triton_gemm": False,
}


def step_compiler_options(platform: str) -> dict[str, str | bool]:
    """XLA debug options for `jax.stages.Lowered.compile` of a step on `platform` (a `jaxllm.kernels` platform)."""
    return dict(GPU_OPTIONS) if platform == "gpu" else {}
