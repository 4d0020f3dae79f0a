"""An exception while handling one request (its detokenizer, its output callback) ends that request with an
error and leaves every other request running; the engine thread never dies of it and no page leaks."""

import _queue
import time

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.engine_loop import EngineLoop

pytestmark = pytest.mark.slow  # an engine of its own


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir, compile_cache_dir):
    folder, _ = tiny_model_dir("llama")
    return LLM(str(folder), dtype="float32", attn_impl="reference", max_num_seqs=4, max_num_batched_tokens=16,
               num_pages=64, max_model_len=64, page_size=4, compilation_cache_dir=compile_cache_dir)


class BrokenDetokenizer:
    def add_token(self, token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    def visible_text(self, finished):
        return ""


def outputs_of(q, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        out = q.get(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(out, Exception) or out.finished:
            return out


def test_one_failing_request_does_not_stop_the_others(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    loop = EngineLoop(engine)
    try:
        queues = {name: _queue.SimpleQueue() for name in ("ok-1", "bad-detok", "bad-callback", "ok-2")}
        calls = {"bad-callback": 0}

        def broken_callback(out):
            calls["bad-callback"] += 1
            raise RuntimeError("the client's callback is broken")

        for name, q in queues.items():
            callback = broken_callback if name == "bad-callback" else q.put
            loop.add_request(name, [1, 2, 3, 4, 5], params, callback)
        # Break one request's detokenizer once it is in the engine (its own per-request state).
        deadline = time.monotonic() + 10
        while "bad-detok" not in engine.requests:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        for seq in engine.requests["bad-detok"].seqs:
            seq.detokenizer = BrokenDetokenizer()
        bad = outputs_of(queues["bad-detok"])
        assert bad.finished and bad.error and "UnicodeDecodeError" in bad.error
        assert bad.outputs[0].finish_reason == "error"
        for name in ("ok-1", "ok-2"):
            out = outputs_of(queues[name])
            assert out.error is None and len(out.outputs[0].token_ids) == 20, name
        assert calls["bad-callback"] == 1  # called once, failed, and the request was ended
        deadline = time.monotonic() + 5
        while loop.stats["num_requests"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.alive
        stats = loop.stats
        assert stats["num_running"] == 0 and stats["num_free_pages"] == stats["num_pages"]
        assert stats["num_failed_requests"] >= 2
    finally:
        loop.stop()
