"""Pairs for scoring (1:N, N:N, refusals) and scores of an embedding model (the cosine of its vectors)."""

import numpy as np
import pytest

from jaxllm import LLM
from jaxllm.errors import InvalidRequestError
from jaxllm.scoring import MAX_PAIRS, pairs, ranked
from tests.tiny_models import TOKENIZER_CORPUS


def test_pairs_are_one_to_n_or_element_wise():
    assert pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pairs(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    assert pairs("q", "a") == [("q", "a")]
    for bad, match in [((["q", "r"], ["a", "b", "c"]), "give one"), (([], ["a"]), "empty"), (("q", []), "empty"),
                       (("q", ["a", " "]), "whitespace"), (("q", ["a"] * (MAX_PAIRS + 1)), "at most"),
                       (("\ud800", "a"), "Unicode")]:
        with pytest.raises(InvalidRequestError, match=match):
            pairs(*bad)


def test_ranked_is_best_first_with_stable_ties():
    assert ranked([0.1, 0.9, 0.5, 0.9], None) == [(1, 0.9), (3, 0.9), (2, 0.5), (0, 0.1)]
    assert ranked([0.1, 0.9, 0.5], 2) == [(1, 0.9), (2, 0.5)]


@pytest.mark.slow
def test_an_embedding_model_scores_by_cosine(tiny_embedding_dir, compile_cache_dir):
    from sentence_transformers import SentenceTransformer

    folder = tiny_embedding_dir("mean")
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=64, max_num_seqs=8, num_pages=256,
              max_model_len=256, compilation_cache_dir=compile_cache_dir)
    query, docs = TOKENIZER_CORPUS[2], TOKENIZER_CORPUS
    vectors = SentenceTransformer(str(folder), device="cpu").encode([query] + docs, convert_to_numpy=True)
    want = [float(np.dot(vectors[0], v) / np.linalg.norm(vectors[0]) / np.linalg.norm(v)) for v in vectors[1:]]
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert got[2] == pytest.approx(1.0, abs=1e-5)  # the query itself
    assert llm.rerank(query, docs, top_n=1, use_tqdm=False)[0].index == 2


TEMPLATE = "<|im_start|>user\nQuery: {query}\nDocument: {document}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_a_decoder_reranker_scores_with_its_label_tokens(tiny_embedding_dir, compile_cache_dir):
    """Qwen3-Reranker style: the score is softmax over the logits of ("no", "yes")-like tokens at the last token
    of the templated pair, as transformers computes it."""
    import torch
    import transformers

    folder = tiny_embedding_dir("last")
    from jaxllm.tokenizer.hf_tokenizer import tokenizer_from_hf_folder

    tok = tokenizer_from_hf_folder(folder)
    labels = (tok.backend.id_to_token(400), tok.backend.id_to_token(401))
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=64, max_num_seqs=8, num_pages=256,
              max_model_len=256, compilation_cache_dir=compile_cache_dir, classifier_tokens=labels,
              score_template=TEMPLATE)
    assert "classify" in llm.engine.limits.tasks and "generate" in llm.engine.limits.tasks
    query, docs = TOKENIZER_CORPUS[2], TOKENIZER_CORPUS
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want = []
    for d in docs:
        ids = tok.encode(TEMPLATE.replace("{query}", query).replace("{document}", d))
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1, [400, 401]].double()
        want.append(float(torch.softmax(logits, 0)[1]))
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(Exception, match="not one token"):
        LLM(str(folder), dtype="float32", max_num_batched_tokens=64, max_num_seqs=8, num_pages=256,
            max_model_len=256, compilation_cache_dir=compile_cache_dir, classifier_tokens=("no such token!",))
