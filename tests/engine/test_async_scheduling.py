"""Async scheduling (a decode step dispatched before the previous one's tokens are read back): the same outputs as
fully synchronous steps, for requests that finish, stop, get aborted and arrive while steps are in flight, with
nothing compiled and every page free after, and a prefix cache that is still right after the dropped tokens."""

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine import compile_monitor
from tests.conftest import ENGINE_OPTIONS

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "List three colors:",
           "Water boils at", "My favourite book is", "In 1969, astronauts", "The quick brown fox"]


@pytest.fixture(scope="module")
def sync_llm(compile_cache_dir):
    return LLM(compilation_cache_dir=compile_cache_dir, **{**ENGINE_OPTIONS, "async_scheduling": False})


def _workload(llm):
    """(request id, prompt ids, params) in arrival order: greedy and seeded sampling, n=2, stop strings, logprobs,
    max_tokens from 1 to 40."""
    tok = llm.get_tokenizer()
    out = []
    for i, text in enumerate(PROMPTS * 2):
        kind = i % 4
        params = SamplingParams(
            max_tokens=[1, 7, 23, 40][i % 4], ignore_eos=kind != 3, temperature=0.0 if kind in (0, 3) else 0.8,
            seed=i, n=2 if kind == 2 else 1, logprobs=3 if kind == 1 else None, stop=[" the"] if kind == 3 else [])
        out.append((f"r{i}", tok.encode(text), params))
    return out


def _run(llm, monkeypatch=None, abort_at: int = 10):
    """Requests arriving one a step after the first four; r6 aborted after `abort_at` steps. Returns each request's
    choices' token ids, and the steps dispatched ahead."""
    engine = llm.engine
    engine.block_manager.page_of_hash.clear()
    engine.block_manager.hash_of_page.clear()
    ahead = []
    if monkeypatch is not None:
        dispatch = engine.runner.dispatch

        def counting(step, bucket=None, after=None):
            ahead.append(after is not None)
            return dispatch(step, bucket, after)

        monkeypatch.setattr(engine.runner, "dispatch", counting)
    arrivals = _workload(llm)
    results, steps = {}, 0
    for request in arrivals[:4]:
        engine.add_request(*request)
    arrivals = arrivals[4:]
    while engine.has_unfinished_requests() or arrivals:
        if arrivals and steps % 3 == 0:
            engine.add_request(*arrivals.pop(0))
        if steps == abort_at:
            engine.abort_request("r6")
        steps += 1
        for out in engine.step():
            if out.finished:
                results[out.request_id] = [(c.token_ids, c.finish_reason, c.text) for c in out.outputs]
    engine.step()  # reads back a step left in flight for requests that had finished
    return results, ahead


@pytest.mark.slow
def test_outputs_equal_synchronous_steps(smollm2_llm, sync_llm, monkeypatch):
    want, _ = _run(sync_llm)
    before = compile_monitor.snapshot()
    got, ahead = _run(smollm2_llm, monkeypatch)
    assert compile_monitor.snapshot() == before
    assert sum(ahead) >= 20  # most decode steps ran ahead
    assert got == want
    assert "r6" not in got and len(got) == 15  # r6 was aborted (its output goes to its callback, not step())
    bm = smollm2_llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages and smollm2_llm.engine._ahead is None


def test_prefix_cache_after_steps_run_ahead(smollm2_llm):
    """A finished request's last step ran ahead (its token dropped, its KV slot written past the cached pages):
    the same prompt again reuses the cached pages and gives the same tokens."""
    tok = smollm2_llm.get_tokenizer()
    ids = tok.encode(" ".join(PROMPTS))  # several full pages
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    (first,) = smollm2_llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    (again,) = smollm2_llm.generate({"prompt_token_ids": ids + first.outputs[0].token_ids[:5]}, params,
                                    use_tqdm=False)
    assert again.num_cached_tokens > len(ids) // 2
    (fresh,) = smollm2_llm.generate({"prompt_token_ids": ids + first.outputs[0].token_ids[:5], "cache_salt": "x"},
                                    params, use_tqdm=False)
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert first.outputs[0].token_ids[5:] == again.outputs[0].token_ids[:15]
