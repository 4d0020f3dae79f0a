"""Data-parallel routing: the preferred rank is a stable hash of a prompt's first pages (the same in every API
worker), load overrides it beyond the slack, and two in-process engine cores serve through one client with
outputs equal to one engine's and shared prefixes meeting on one rank's prefix cache."""

import queue
import threading

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine.core_server import EngineCoreServer
from jaxllm.engine.dp_client import AFFINITY_PAGES, DataParallelClient, choose_rank, preferred_rank
from jaxllm.engine.engine_client import EngineClient

SECRET = "dp-secret"


def test_preferred_rank_is_a_stable_hash_of_the_first_pages():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50000, 100).tolist() for _ in range(400)]
    ranks = [preferred_rank(p, None, 16, 2) for p in prompts]
    assert ranks == [preferred_rank(p, None, 16, 2) for p in prompts]  # no per-process hash seed
    assert 150 < ranks.count(0) < 250  # spread
    p = prompts[0]
    assert preferred_rank(p[:16 * AFFINITY_PAGES] + [1, 2, 3], None, 16, 2) == preferred_rank(p, None, 16, 2)
    assert preferred_rank(p[:15], None, 16, 2) is None  # no full page: no affinity
    salts = {preferred_rank(p, f"tenant-{i}", 16, 4) for i in range(32)}
    assert len(salts) > 1  # the cache salt is part of the key (tenants never share pages anyway)


def test_load_overrides_affinity_beyond_the_slack():
    assert choose_rank([3, 0], preferred=0, slack=4) == 0
    assert choose_rank([5, 0], preferred=0, slack=4) == 1
    assert choose_rank([2, 2, 1], preferred=None, slack=4) == 2
    assert choose_rank([1, 1], preferred=None, slack=4) == 0
    assert choose_rank([1, 1, 1], preferred=None, slack=4, start=2) == 2  # ties in turn
    assert choose_rank([1, 0, 1], preferred=None, slack=4, start=2) == 1


@pytest.fixture(scope="module")
def two_cores(tiny_model_dir, compile_cache_dir, tmp_path_factory):
    folder, _ = tiny_model_dir("llama")
    d = tmp_path_factory.mktemp("dp")
    servers, threads = [], []
    for rank in range(2):
        llm = LLM(str(folder), dtype="float32", attn_impl="reference", max_num_seqs=8, max_num_batched_tokens=32,
                  num_pages=128, max_model_len=128, page_size=4, compilation_cache_dir=compile_cache_dir)
        server = EngineCoreServer(llm.engine, f"ipc://{d}/core-{rank}", SECRET, rank=rank)
        servers.append(server)
        threads.append(threading.Thread(target=server.serve_forever, daemon=True))
        threads[-1].start()
    yield servers
    for server, thread in zip(servers, threads, strict=True):
        server.stop()
        thread.join(30)
        server.close()


def _run(client, request_id, ids, params):
    q = queue.SimpleQueue()
    client.add_request(request_id, list(ids), params, q.put)
    while True:
        out = q.get(timeout=60)
        if isinstance(out, Exception):
            raise out
        if out.finished:
            return out


def test_two_ranks_spread_load_and_share_prefixes(two_cores):
    client = DataParallelClient([s.address for s in two_cores], SECRET, timeout_s=30,
                                tokenizer_loader=lambda info: None)
    try:
        assert isinstance(client, EngineClient)  # what the routes talk to, whatever the serve mode
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        short = [[i + 1, i + 2, i + 3] for i in range(12)]  # under a page: routed by load alone
        outs = {}
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, _run(client, f"s{i}", short[i], params)))
                   for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(client.routed), client.routed  # both ranks served
        for i, p in enumerate(short):  # the same outputs as one engine's (each rank holds the same model)
            assert outs[i].outputs[0].token_ids == _tokens_on(two_cores[0], p, params)
        before = [s.engine.block_manager.prefix_hits for s in two_cores]
        shared = list(range(40, 40 + 12))  # three full pages of 4 tokens
        for i in range(4):
            _run(client, f"p{i}", shared + [100 + i], params)
        gained = [s.engine.block_manager.prefix_hits - b for s, b in zip(two_cores, before, strict=True)]
        assert sorted(gained) == [0, 3 * 12]  # one rank, whose cache served the later three
    finally:
        client.stop()


def _tokens_on(core, ids, params):
    """Greedy tokens of `ids` on that core's engine, through a client of its own."""
    from jaxllm.engine.core_client import EngineCoreClient

    c = EngineCoreClient(core.address, SECRET, timeout_s=30, tokenizer_loader=lambda info: None)
    try:
        return _run(c, "check", ids, params).outputs[0].token_ids
    finally:
        c.stop()
