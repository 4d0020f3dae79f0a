"""BERT-family encoders on the engine against sentence-transformers: embeddings (mean and CLS pooling) and
cross-encoder scores, for inputs of different lengths batched together."""

import numpy as np
import pytest

from jaxllm import LLM, PoolingParams, SamplingParams
from jaxllm.errors import InvalidRequestError, PromptTooLongError
from tests.matrix import sampled
from tests.tiny_models import TOKENIZER_CORPUS

BUDGET = 128  # an encoder's input runs whole in one step: at most this many tokens
TEXTS = [t * k for k in (1, 3) for t in TOKENIZER_CORPUS[:5]] + ["rain " * 100]
QUERY = "What is the capital of France?"


def _llm(folder, cache_dir) -> LLM:
    return LLM(str(folder), max_num_batched_tokens=BUDGET, max_num_seqs=8, compilation_cache_dir=cache_dir)


@pytest.mark.parametrize("family", sampled(["bert", "xlm-roberta"], lambda f: f == "bert"))
@pytest.mark.parametrize("pooling", sampled(["mean", "cls"], lambda p: p == "cls"))
def test_embeddings_match_sentence_transformers(tiny_encoder_dir, compile_cache_dir, family, pooling):
    from sentence_transformers import SentenceTransformer

    folder = tiny_encoder_dir(family, pooling)
    llm = _llm(folder, compile_cache_dir)
    assert llm.engine.limits.tasks == ("embed",)
    outs = llm.embed(TEXTS, use_tqdm=False)
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert min(lengths) < 20 and max(lengths) > 100  # short and long inputs in the same steps
    want = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True, batch_size=4)
    np.testing.assert_allclose(np.stack([o.outputs.data for o in outs]), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_match_sentence_transformers(tiny_encoder_dir, compile_cache_dir, family):
    from sentence_transformers import CrossEncoder

    folder = tiny_encoder_dir(family, "classifier")
    llm = _llm(folder, compile_cache_dir)
    assert llm.engine.limits.tasks == ("classify",)
    want = CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in TEXTS])
    got = [o.outputs.score for o in llm.score(QUERY, TEXTS, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # N:N pairs, and the ranking
    pairs = llm.score(TEXTS[:3], TEXTS[3:6], use_tqdm=False)
    assert len(pairs) == 3
    ranked = llm.rerank(QUERY, TEXTS, top_n=3, use_tqdm=False)
    assert [r.index for r in ranked] == list(np.argsort(-np.asarray(want), kind="stable")[:3])
    assert ranked[0].document == TEXTS[ranked[0].index] and ranked[0].relevance_score == pytest.approx(max(want),
                                                                                                       abs=1e-4)


def test_encoder_limits(tiny_encoder_dir, compile_cache_dir):
    llm = _llm(tiny_encoder_dir("bert", "mean"), compile_cache_dir)
    assert llm.engine.max_model_len == BUDGET  # whole inputs within one step
    long = " ".join(TOKENIZER_CORPUS) * 4
    with pytest.raises(PromptTooLongError):
        llm.embed(long, use_tqdm=False)
    (cut,) = llm.embed(long, PoolingParams(truncate_prompt_tokens=BUDGET), use_tqdm=False)
    assert len(cut.prompt_token_ids) == BUDGET
    with pytest.raises(InvalidRequestError, match="does not generate"):
        llm.generate("a text", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(llm.score(QUERY, TEXTS[:2], use_tqdm=False)) == 2  # an embedding model scores by cosine
    with pytest.raises(InvalidRequestError, match="'classify'"):
        llm.embed("a text", PoolingParams(task="classify"), use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages
