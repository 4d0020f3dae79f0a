"""The XLA options a step compiles with: a GPU step keeps its conditionals, loops and sorts inside CUDA graphs."""

import jax
import jax.numpy as jnp

from jaxllm.engine.step_options import step_compiler_options


def test_gpu_step_records_conditionals_and_loops_in_graphs():
    options = step_compiler_options("gpu")
    kinds = options["xla_gpu_enable_command_buffer"].split(",")
    assert {"CONDITIONAL", "WHILE", "FUSION", "CUSTOM_CALL", "CUBLAS"} <= set(kinds)
    assert options["xla_gpu_enable_cub_radix_sort"] is False
    assert options["xla_gpu_enable_triton_gemm"] is False  # cuBLAS: faster decode and prefill on an H100
    assert step_compiler_options("cpu") == {} and step_compiler_options("tpu") == {}


def test_options_are_accepted_where_they_apply():
    # XLA parses every option it is given, whatever the backend: a misspelt name or value fails here, on CPU
    lowered = jax.jit(lambda x: jnp.sort(x) * 2).lower(jnp.arange(8.0))
    compiled = lowered.compile(compiler_options=step_compiler_options("gpu"))
    assert (compiled(jnp.arange(8.0)[::-1]) == jnp.arange(8.0) * 2).all()
