"""The engine with tensor parallelism, and its persistent compilation cache across processes."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams

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
        cache = llm.engine.runner.caches[0][0]
        assert len(cache.sharding.device_set) == tp
    assert outs[1] == outs[2]
    assert all(len(o) == 12 for o in outs[1])


START = """
import json, sys
from jaxllm import LLM
from jaxllm.engine import compile_monitor
# Default attention (the CPU kernel's custom call) and the KV cache sized from RAM, as a preset does: the
# page count, a compiled shape, must come out the same in both processes.
llm = LLM(dtype="float32", compilation_cache_dir=sys.argv[1], max_num_seqs=2, max_num_batched_tokens=4,
          kv_memory_fraction=0.001, max_model_len=256)
print(json.dumps({"warmup_s": llm.engine.warmup_seconds, **compile_monitor.snapshot()}))
"""


def test_second_start_loads_every_bucket_from_the_persistent_cache(tmp_path):
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", START, str(tmp_path / "cache")], capture_output=True,
                             text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    print(f"\nwarm-up of 3 buckets: first start {first['warmup_s']:.1f} s, second start {second['warmup_s']:.1f} s")
    assert first["cache_hits"] == 0
    assert second["cache_hits"] >= 3  # the three step buckets (plus small helper computations)
    assert second["compiles"] == second["cache_hits"]  # nothing compiled again
