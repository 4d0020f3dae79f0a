"""The engine with tensor parallelism, and its persistent compilation cache across processes."""

import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams

pytestmark = pytest.mark.slow  # tensor-parallel SmolLM2 engines

TINY = dict(max_num_seqs=4, max_num_batched_tokens=16, num_pages=64, max_model_len=128, page_size=4)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 host devices")
def test_tensor_parallel_2_gives_the_same_greedy_outputs(tiny_model_dir, compile_cache_dir):
    folder, _ = tiny_model_dir("qwen2_tp")
    prompts = [{"prompt_token_ids": p.tolist()} for p in np.random.default_rng(0).integers(0, 1024, (5, 9))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(str(folder), dtype="float32", attn_impl="reference", tensor_parallel_size=tp,
                  compilation_cache_dir=compile_cache_dir, **TINY)
        outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        cache = llm.engine.runner.caches[0]  # K of every layer
        assert len(cache.sharding.device_set) == tp
        model = llm.engine.model
        assert model.stacked  # the scanned layers' weights: layer axis replicated, rows split by tp
        gate_up = model.layers.layer.mlp.gate_up_proj.weight[...]
        assert gate_up.shape[0] == model.config.num_layers
        assert tuple(gate_up.sharding.spec)[:2] == (None, "tp") and len(gate_up.sharding.device_set) == tp
    assert outs[1] == outs[2]
    assert all(len(o) == 12 for o in outs[1])


START = """
import json, sys
from jaxllm import LLM, SamplingParams
from jaxllm.engine import compile_monitor
# Default attention (the CPU kernel's custom call) and the KV cache sized from RAM, as a preset does: the
# page count, a compiled shape, must come out the same in both processes.
llm = LLM(dtype="float32", compilation_cache_dir=sys.argv[1], max_num_seqs=2, max_num_batched_tokens=4,
          kv_memory_fraction=0.001, max_model_len=256)
after_warmup = compile_monitor.snapshot()
out = llm.generate([[1, 2, 3, 4, 5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                   use_tqdm=False)
print(json.dumps({"warmup_s": llm.engine.warmup_seconds, **after_warmup,
                  "sources": [b.source for b in llm.engine.startup.buckets], "tokens": out[0].outputs[0].token_ids,
                  "compiles_serving": compile_monitor.snapshot()["compiles"] - after_warmup["compiles"]}))
"""


def _start(cache) -> dict:
    out = subprocess.run([sys.executable, "-c", START, str(cache)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_later_starts_load_every_bucket_from_the_caches(tmp_path):
    """First start: every bucket traced and compiled. Second: every bucket from the executable cache, nothing traced
    or compiled. Third, with the executable cache emptied: traced again, but every compile is a hit in JAX's
    persistent cache; a fourth start runs too. The same tokens every time, and nothing compiled while
    generating."""
    cache = tmp_path / "cache"
    first = _start(cache)
    second = _start(cache)
    shutil.rmtree(cache / "executables")
    third = _start(cache)
    fourth = _start(cache)  # the third start saved nothing: executables JAX loaded from its cache are not kept
    print(f"\nwarm-up of 3 buckets: {first['warmup_s']:.1f} s, then {second['warmup_s']:.1f} s (executable cache), "
          f"{third['warmup_s']:.1f} s (XLA cache)")
    assert first["sources"] == ["compiled"] * 3 and first["cache_hits"] == 0
    assert second["sources"] == ["executable cache"] * 3
    # Only the engine's small helper computations (constant inputs) are traced, and they are XLA cache hits.
    assert second["traces"] <= first["traces"] - 3 and second["compiles"] == second["cache_hits"]
    assert third["sources"] == ["compiled"] * 3
    assert third["cache_hits"] >= 3 and third["compiles"] == third["cache_hits"]  # nothing compiled again
    assert fourth["sources"] == ["compiled"] * 3
    assert first["tokens"] == second["tokens"] == third["tokens"] == fourth["tokens"]
    assert len(first["tokens"]) == 6
    assert [r["compiles_serving"] for r in (first, second, third, fourth)] == [0] * 4, (first, second, third, fourth)
