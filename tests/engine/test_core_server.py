"""An engine core behind ZeroMQ and its clients, in one process (the core's loop on a thread, clients in OS-thread
mode): outputs equal the engine's own, the handshake refuses a wrong secret, clients cannot touch each other's
requests, and a client that vanishes has its requests aborted and their pages freed."""

import queue
import threading
import time

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.core_client import EngineCoreClient, EngineCoreRefused
from jaxllm.engine.core_server import EngineCoreServer
from jaxllm.engine.engine_client import EngineClient
from jaxllm.engine.engine_loop import EngineDeadError, EngineLoop

SECRET = "test-secret"


def _tiny_llm(tiny_model_dir, compile_cache_dir) -> LLM:
    folder, _ = tiny_model_dir("llama")
    return LLM(str(folder), dtype="float32", attn_impl="reference", max_num_seqs=8, max_num_batched_tokens=32,
               num_pages=128, max_model_len=128, page_size=4, compilation_cache_dir=compile_cache_dir)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir, compile_cache_dir):
    """The engine the module's core serves: only its core's loop steps it."""
    return _tiny_llm(tiny_model_dir, compile_cache_dir)


@pytest.fixture(scope="module")
def other_llm(tiny_model_dir, compile_cache_dir):
    """An engine of the same shape that no core of the module's serves: the reference outputs, and a core of its own
    for the tests that stop one (an engine stepped by two threads at once, its core's and the test's, went wrong
    under load)."""
    return _tiny_llm(tiny_model_dir, compile_cache_dir)


@pytest.fixture(scope="module")
def core(tiny_llm, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('core')}/engine-core"
    server = EngineCoreServer(tiny_llm.engine, address, SECRET)
    status = []
    thread = threading.Thread(target=lambda: status.append(server.serve_forever()), daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(30)
    assert status == [0]
    server.close()


def connect(core, secret=SECRET):
    return EngineCoreClient(core.address, secret, timeout_s=30, tokenizer_loader=lambda info: None)


def run(client, request_id, prompt, params, timeout=60):
    q = queue.SimpleQueue()
    client.add_request(request_id, list(prompt), params, q.put)
    deadline = time.monotonic() + timeout
    outs = []
    while True:
        out = q.get(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(out, Exception):
            raise out
        outs.append(out)
        if out.finished:
            return outs


def wait_idle(core, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        bm = core.engine.block_manager
        if not core.engine.requests and bm.num_free_pages == bm.num_pages:
            return True
        time.sleep(0.05)
    return False


def test_outputs_equal_the_engines_own(core, tiny_llm, other_llm):
    client = connect(core)
    try:
        assert client.alive and client.frontend.max_model_len == tiny_llm.engine.max_model_len
        assert isinstance(client, EngineClient) and isinstance(EngineLoop(other_llm.engine, thread=False), EngineClient)
        prompts = [[1, 5, 9, 3], [7, 7, 2], [4, 11, 30, 8, 2, 6]]
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        sampled = SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=2)
        for params in (greedy, sampled):
            want = other_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for i, (p, w) in enumerate(zip(prompts, want, strict=True)):
                outs = run(client, f"r{i}", p, params)
                got = outs[-1]
                assert [c.token_ids for c in got.outputs] == [c.token_ids for c in w.outputs]
                for gc, wc in zip(got.outputs, w.outputs, strict=True):  # the reference kernels here are not
                    for ge, we in zip(gc.logprobs or [], wc.logprobs or [], strict=True):  # batch invariant
                        assert ge.keys() == we.keys()
                        assert all(abs(ge[t].logprob - we[t].logprob) < 1e-5 for t in ge)
                assert got.prompt_token_ids == p and got.request_id == f"r{i}"
                assert len(outs) > 1  # streamed, not one final message
        deadline = time.monotonic() + 5  # the core broadcasts its stats a few times a second
        while client.stats["generation_tokens_total"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats["generation_tokens_total"] > 0
    finally:
        client.stop()


def test_wrong_secret_is_refused(core):
    with pytest.raises(EngineCoreRefused, match="secret"):
        connect(core, secret="wrong")


def test_a_stopped_client_closes_its_sockets(core):
    """Its reader closes them and ends the context: left to the garbage collector, a context with a monitored socket
    open blocked the collecting thread forever (once, pytest's main thread while it reported a failure)."""
    client = connect(core)
    client.stop()
    deadline = time.monotonic() + 10
    while not client.ctx.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.ctx.closed and client.sock.closed and client.monitor.closed


def test_clients_cannot_abort_each_others_requests(core):
    a, b = connect(core), connect(core)
    try:
        q = queue.SimpleQueue()
        a.add_request("same-id", [1, 2, 3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), q.put)
        b.requests["same-id"] = None  # b "owns" the id on its side too, so its abort is sent
        b.abort_request("same-id")
        outs = []
        while not outs or not outs[-1].finished:
            outs.append(q.get(timeout=60))
        assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 60
    finally:
        a.stop()
        b.requests.clear()
        b.stop()


def test_a_vanished_client_has_its_requests_aborted(core):
    client = connect(core)
    q = queue.SimpleQueue()
    for i in range(4):
        client.add_request(f"v{i}", [3, 1, 4, 1, 5], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                           q.put)
    q.get(timeout=60)  # running
    client.stopped = True  # its reader ends; then its socket goes, as when a worker is killed
    time.sleep(0.6)
    client.sock.close(0)
    assert wait_idle(core), "the vanished client's requests kept their pages"


def test_a_stopping_core_refuses_new_requests_and_drains(other_llm, tmp_path):
    server = EngineCoreServer(other_llm.engine, f"ipc://{tmp_path}/core", SECRET)
    status = []
    thread = threading.Thread(target=lambda: status.append(server.serve_forever()), daemon=True)
    thread.start()
    client = connect(server)
    q = queue.SimpleQueue()
    client.add_request("d", [2, 3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), q.put)
    q.get(timeout=60)
    server.stop(drain_timeout_s=30)
    refused = queue.SimpleQueue()
    client.add_request("late", [2, 3], SamplingParams(temperature=0, max_tokens=3), refused.put)
    assert isinstance(refused.get(timeout=30), EngineDeadError)
    last = None
    while last is None or not getattr(last, "finished", True):
        last = q.get(timeout=60)
    assert last.outputs[0].finish_reason == "length"  # the in-flight request finished before the core stopped
    thread.join(30)
    assert status == [0]
    server.close()
    client.stop()


def test_a_full_core_refuses_with_engine_busy(core):
    """Several API servers share the core: it enforces its capacity itself (HTTP 429 on the API side)."""
    from jaxllm.errors import EngineBusyError

    client = connect(core)
    saved, core.capacity = core.capacity, 2
    try:
        qs = [queue.SimpleQueue() for _ in range(3)]
        for i, q in enumerate(qs[:2]):
            client.add_request(f"b{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), q.put)
        qs[0].get(timeout=60)  # both admitted and running
        client.add_request("b2", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5), qs[2].put)
        assert isinstance(qs[2].get(timeout=30), EngineBusyError)
    finally:
        core.capacity = saved
        client.stop()
        assert wait_idle(core)


@pytest.fixture(scope="module")
def grammar_core(tiny_model_dir, compile_cache_dir, tmp_path_factory):
    """A core on the tiny model with a tokenizer (structured outputs need one)."""
    import shutil

    from tests.tiny_models import add_tiny_tokenizer

    folder, _ = tiny_model_dir("llama")
    with_tokenizer = tmp_path_factory.mktemp("grammar") / "llama"
    shutil.copytree(folder, with_tokenizer)
    add_tiny_tokenizer(with_tokenizer)
    llm = LLM(str(with_tokenizer), dtype="float32", attn_impl="reference", max_num_seqs=8, max_num_batched_tokens=32,
              num_pages=128, max_model_len=128, page_size=4, compilation_cache_dir=compile_cache_dir)
    server = EngineCoreServer(llm.engine, f"ipc://{tmp_path_factory.mktemp('gcore')}/core", SECRET)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(30)
    server.close()


def test_grammars_compile_off_the_loop_thread(grammar_core):
    """A new grammar compiles on the core's grammar thread while other requests keep stepping; a request aborted
    during its compile never runs; a grammar that fails to compile is refused."""
    from jaxllm.errors import InvalidRequestError
    from jaxllm.sampling_params import StructuredOutputsParams

    compiler = grammar_core.engine.grammars
    real = compiler.matcher
    started = threading.Event()

    def slow_matcher(spec):  # a compile here takes 0.5 s more, so that the races below are deterministic
        if not compiler.is_compiled(spec):
            assert threading.current_thread().name.startswith("jaxllm-grammar")  # never the loop's thread
            started.set()
            time.sleep(0.5)
        return real(spec)

    compiler.matcher = slow_matcher
    client = EngineCoreClient(grammar_core.address, SECRET, timeout_s=30)
    try:
        running = queue.SimpleQueue()
        client.add_request("plain", "hello world", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                           running.put)
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        spec = StructuredOutputsParams(json=schema)
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
        text, ids = None, [5, 6, 7]
        done = queue.SimpleQueue()
        client.add_request("json", None, params, done.put, prepared=(text, ids))
        assert started.wait(10)
        steps_during_compile = 0
        deadline = time.monotonic() + 0.4
        while time.monotonic() < deadline:  # the plain stream goes on while the grammar compiles
            try:
                running.get(timeout=0.05)
                steps_during_compile += 1
            except queue.Empty:
                pass
        assert steps_during_compile >= 3
        out = done.get(timeout=60)
        while not out.finished:
            out = done.get(timeout=60)
        assert out.outputs[0].text.lstrip().startswith("{")  # constrained by the grammar
        # aborted while compiling: never runs
        started.clear()
        spec2 = StructuredOutputsParams(json={**schema, "title": "another"})
        aborted = queue.SimpleQueue()
        client.add_request("late", None, SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec2),
                           aborted.put, prepared=(text, ids))
        assert started.wait(10)
        client.abort_request("late")
        last = aborted.get(timeout=60)
        while not last.finished:
            last = aborted.get(timeout=60)
        assert last.outputs[0].finish_reason == "abort" and len(last.outputs[0].token_ids) <= 1
        # refused by the compiler itself
        bad = queue.SimpleQueue()
        client.add_request("bad", None, SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: (")),
                           bad.put, prepared=(text, ids))
        assert isinstance(bad.get(timeout=60), InvalidRequestError)
    finally:
        compiler.matcher = real
        client.stop()
    assert wait_idle(grammar_core)
