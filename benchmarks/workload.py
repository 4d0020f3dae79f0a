"""The shared peer workload (peer_workload.json, a copy of ../shared/peers/workload.json) run on a jaxllm
engine: 32 prompts of 128 tokens x 128 new tokens, greedy, EOS ignored, and a single stream (prompt 0)."""

from __future__ import annotations

import json
import time
from pathlib import Path

WORKLOAD = Path(__file__).with_name("peer_workload.json")


def load() -> dict:
    return json.loads(WORKLOAD.read_text())


def run(llm, single_runs: int = 1) -> dict:
    """Generated tok/s of the batch over the whole run (prefill included), and the single stream's decode tok/s
    after its first token (the best of `single_runs`) and its time to first token (the first run's). No run
    starts from pages an earlier one left in the prefix cache."""
    from jaxllm import SamplingParams

    workload = load()
    engine = llm.engine
    gen = workload["gen_len"]
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    batch = [{"prompt_token_ids": workload["prompts"][i]} for i in workload["batch_prompt_indices"]]
    single = workload["prompts"][workload["single_stream_prompt_index"]]
    llm.generate(batch[:2], params, use_tqdm=False)  # touch every code path once

    def no_prefix_hits():
        engine.block_manager.page_of_hash.clear()
        engine.block_manager.hash_of_page.clear()

    no_prefix_hits()
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == gen for o in outs)
    decode, ttfts = [], []
    for r in range(single_runs):
        no_prefix_hits()
        start = time.perf_counter()
        engine.add_request(f"single-{r}", single, params)
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            first = first or time.perf_counter()
        decode.append((gen - 1) / (time.perf_counter() - first))
        ttfts.append(first - start)
    return {"batch_tok_s": len(batch) * gen / elapsed, "single_tok_s": max(decode), "ttft_s": ttfts[0],
            "weights": sorted({f.label for f in engine.model.quant_plan.values()}) or ["float32"]}
