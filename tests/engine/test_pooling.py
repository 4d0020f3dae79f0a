"""Pooling requests on the engine: parity with sentence-transformers (last token, mean, CLS; inputs longer than the
token budget pooled across chunks), request options, and embeddings mixed into a generation batch."""

import numpy as np
import pytest

from jaxllm import LLM
from jaxllm.engine import compile_monitor
from jaxllm.errors import InvalidRequestError, PromptTooLongError
from jaxllm.pooling_params import PoolingParams
from jaxllm.sampling_params import SamplingParams
from tests.tiny_models import TOKENIZER_CORPUS

pytestmark = pytest.mark.slow  # embedding engines

BUDGET = 64  # tokens a step: the longest inputs below take two or three chunks
OPTIONS = dict(dtype="float32", max_num_batched_tokens=BUDGET, max_num_seqs=8, num_pages=256, max_model_len=256)
TEXTS = [t * k for k in (1, 3, 8) for t in TOKENIZER_CORPUS[:4]]


@pytest.fixture(scope="module")
def engines(tiny_embedding_dir, compile_cache_dir):
    cache = {}

    def get(pooling: str) -> LLM:
        if pooling not in cache:
            cache[pooling] = LLM(str(tiny_embedding_dir(pooling)), compilation_cache_dir=compile_cache_dir, **OPTIONS)
        return cache[pooling]

    return get


def _st_embeddings(folder, texts, **kwargs) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, convert_to_numpy=True, batch_size=5, **kwargs)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_match_sentence_transformers(engines, tiny_embedding_dir, pooling):
    llm = engines(pooling)
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) > BUDGET  # pooled across chunks
    got = np.stack([o.outputs.data for o in outs])
    want = _st_embeddings(tiny_embedding_dir(pooling), TEXTS)
    assert got.shape == want.shape == (len(TEXTS), 64)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages  # pooled requests hold no pages once finished


def test_dimensions_and_normalize(engines):
    llm = engines("mean")
    full = llm.embed(TEXTS[:4], use_tqdm=False)
    raw = llm.embed(TEXTS[:4], PoolingParams(normalize=False), use_tqdm=False)
    short = llm.embed(TEXTS[:4], PoolingParams(dimensions=16), use_tqdm=False)
    for f, r, s in zip(full, raw, short, strict=True):
        norm = np.linalg.norm(r.outputs.data)
        assert abs(norm - 1) > 1e-2  # really not normalized
        np.testing.assert_allclose(r.outputs.data / norm, f.outputs.data, atol=1e-6)
        assert s.outputs.data.shape == (16,)  # Matryoshka: the first 16 values, normalized after truncation
        np.testing.assert_allclose(s.outputs.data, r.outputs.data[:16] / np.linalg.norm(r.outputs.data[:16]),
                                   atol=1e-6)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        llm.embed(TEXTS[:1], PoolingParams(dimensions=65), use_tqdm=False)


def test_truncate_prompt_tokens(engines):
    llm = engines("last")
    ids = llm.get_tokenizer().encode(" ".join(TOKENIZER_CORPUS) * 8)
    assert len(ids) > llm.engine.max_model_len
    with pytest.raises(PromptTooLongError, match="truncate_prompt_tokens"):
        llm.embed({"prompt_token_ids": ids}, use_tqdm=False)
    (cut,) = llm.embed({"prompt_token_ids": ids}, PoolingParams(truncate_prompt_tokens=100), use_tqdm=False)
    (tail,) = llm.embed({"prompt_token_ids": ids[-100:]}, use_tqdm=False)
    assert cut.prompt_token_ids == ids[-100:]
    np.testing.assert_allclose(cut.outputs.data, tail.outputs.data, atol=1e-6)  # (the second may hit the cache)


def test_repeated_inputs_pool_the_same_with_the_prefix_cache(engines):
    for pooling in ("last", "mean"):
        llm = engines(pooling)
        first, again = (llm.embed(TEXTS[-1], use_tqdm=False)[0] for _ in range(2))
        # Last-token pooling may reuse cached pages; mean pooling reads every token, so it never does.
        assert (again.num_cached_tokens > 0) == (pooling == "last")
        np.testing.assert_allclose(again.outputs.data, first.outputs.data, atol=1e-6)


def test_a_model_without_pooling_refuses_to_embed(tiny_model_dir, compile_cache_dir):
    folder, _ = tiny_model_dir("qwen3")  # no sentence-transformers files, no pooling set
    llm = LLM(str(folder), compilation_cache_dir=compile_cache_dir, **OPTIONS)
    assert llm.engine.limits.tasks == ("generate",)
    with pytest.raises(InvalidRequestError, match="does not support the 'embed' task"):
        llm.embed({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)
    # ... until told how to pool
    pooled = LLM(str(folder), compilation_cache_dir=compile_cache_dir, pooling="mean", **OPTIONS)
    (out,) = pooled.embed({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)
    assert out.outputs.data.shape == (64,)


def test_embeddings_mixed_into_32_generation_streams(engines, monkeypatch):
    """Generation outputs are the same with embedding requests sharing their steps (batch invariance), the
    embeddings are the ones computed alone, and nothing compiles."""
    llm = engines("last")
    engine = llm.engine
    tok = llm.get_tokenizer()
    prompts = [tok.encode(TOKENIZER_CORPUS[i % 6] * (1 + i % 3)) for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = {o.request_id: o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)}
    embedded_alone = [o.outputs.data for o in llm.embed(TEXTS, use_tqdm=False)]
    engine.block_manager.page_of_hash.clear()  # no prefix-cache help the first run did not have either
    engine.block_manager.hash_of_page.clear()
    mixed_steps = []
    dispatch = engine.runner.dispatch

    def recording(step, bucket=None, after=None):
        kinds = {seq.pooled is None for seq in step.seqs}
        mixed_steps.append(kinds == {True, False})
        return dispatch(step, bucket, after)

    monkeypatch.setattr(engine.runner, "dispatch", recording)
    before = compile_monitor.snapshot()
    results, texts = {}, list(enumerate(TEXTS))
    arrivals = []  # generation and embedding requests interleaved, arriving one a step after the first eight
    for i, p in enumerate(prompts):
        arrivals.append((f"g{i}", p, params))
        if i % 3 == 1 and texts:
            j, text = texts.pop(0)
            arrivals.append((f"e{j}", text, PoolingParams()))
    arrivals += [(f"e{j}", text, PoolingParams()) for j, text in texts]
    texts = []
    for request in arrivals[:8]:
        engine.add_request(*request)
    arrivals = arrivals[8:]
    while engine.has_unfinished_requests() or arrivals:
        if arrivals:
            engine.add_request(*arrivals.pop(0))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    assert not texts and sum(mixed_steps) >= 5  # steps that held both kinds of request
    assert compile_monitor.snapshot() == before
    gen = [results[f"g{i}"].outputs[0].token_ids for i in range(32)]
    assert gen == [alone[k] for k in sorted(alone, key=int)]
    for j in range(len(TEXTS)):
        np.testing.assert_allclose(results[f"e{j}"].outputs.data, embedded_alone[j], atol=1e-5)
    bm = engine.block_manager
    assert bm.num_free_pages == bm.num_pages
