"""Resident memory of quantized weights: the parameters hold exactly the GGUF's tensor bytes, and RSS after loading
minus RSS before stays within RSS_BOUND of them, for the embedded SmolLM2 and a synthetic ~1B-parameter Q4_0 file
(float32 would be 5.6x; the issue's goal is 1.15x). Each load runs in a fresh process (RSS of this one holds the
whole suite's allocations), with the JAX backend and the kernels' compiled code loaded before the baseline: what is
measured is the weights."""

import json
import subprocess
import sys
import textwrap

import pytest
from gguf import GGMLQuantizationType as T

from tests.gguf_writer import write_synthetic_llama_gguf

RSS_BOUND = 1.15

MEASURE = textwrap.dedent("""
    import json, os, sys
    import jax, jax.numpy as jnp
    from jaxllm.loading import load_model, weight_bytes
    from jaxllm.loading.gguf_file import GGUFFile

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    from jaxllm.kernels import attention_kernel, choose_kernels, matmul_kernel, quantized_matmul_kernel

    path = sys.argv[1] if sys.argv[1] != "embedded" else None
    jnp.zeros(1).block_until_ready()  # the backend and the kernels' code, before the baseline
    kernels = choose_kernels()
    attention_kernel(kernels), matmul_kernel(kernels), quantized_matmul_kernel(kernels)
    from jaxllm.loading.embedded import embedded_model_path
    tensor_bytes = sum(t.nbytes for t in GGUFFile(path or embedded_model_path()).tensors.values())
    before = rss()
    loaded = load_model(path, load_tokenizer_too=False)
    after = rss()
    print(json.dumps({"rss_growth": after - before, "tensor_bytes": tensor_bytes,
                      "weight_bytes": weight_bytes(loaded.model)}))
""")


def _measure(path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, path], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_embedded_model_resident_memory():
    r = _measure("embedded")
    assert r["weight_bytes"] <= 1.01 * r["tensor_bytes"]
    assert r["rss_growth"] <= RSS_BOUND * r["tensor_bytes"], r


@pytest.mark.slow
def test_1b_q4_0_resident_memory(tmp_path):
    path = write_synthetic_llama_gguf(tmp_path / "synthetic-1b.Q4_0.gguf", layers=22, hidden=2048, ffn=5632,
                                      heads=32, kv_heads=4, vocab=32000, weight_type=T.Q4_0)
    r = _measure(str(path))
    assert r["tensor_bytes"] > 0.55e9  # ~1.1B parameters at 4.5 bits
    assert r["weight_bytes"] <= 1.01 * r["tensor_bytes"]
    assert r["rss_growth"] <= RSS_BOUND * r["tensor_bytes"], r
