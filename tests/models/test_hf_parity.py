"""jaxllm logits equal transformers' for tiny random models of every supported architecture, both through
the dense (no cache) path and through the paged KV cache (chunked prefill, then one token at a time)."""

import numpy as np
import pytest

from jaxllm.loading import load_model
from tests.matrix import sampled
from tests.paged_driver import PagedRunner
from tests.tiny_models import PARITY_CASES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
LENGTHS = [11, 5, 16]  # different lengths in one batch; 16 > mistral's sliding window of 6


def _hf_logits(hf_model, sequences):
    import torch

    width = max(map(len, sequences))
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    with torch.no_grad():
        out = hf_model(input_ids=ids, attention_mask=mask).logits.numpy()
    return [out[i, :len(s)] for i, s in enumerate(sequences)]


def _sequences(vocab):
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, n).tolist() for n in LENGTHS]


@pytest.mark.parametrize("case", sampled(PARITY_CASES,
                                         lambda c: c in ("llama", "qwen3", "gemma2", "mixtral", "gpt_oss")))
def test_dense_forward_matches_transformers(case, tiny_model_dir):
    import jax.numpy as jnp

    folder, hf_model = tiny_model_dir(case)
    lm = load_model(folder, dtype="float32", attn_impl="reference")
    seqs = _sequences(lm.config.vocab_size)
    expected = _hf_logits(hf_model, seqs)
    width = max(LENGTHS)
    ids = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    got = np.asarray(lm.model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(got[i, :len(s)], expected[i], atol=1e-4, rtol=0)
    assert np.abs(expected[0]).max() > 0.1  # the comparison is not between near-zero logits


@pytest.mark.parametrize(("case", "attn_impl", "page_size"), sampled(
    [(c, "reference", 4) for c in PARITY_CASES] +
    [("mistral", "pallas_tpu", 8), ("qwen2", "pallas_gpu", 16), ("mistral", "cpu", 4), ("qwen3", "cpu", 8),
     ("phi3", "cpu", 4), ("gemma2", "cpu", 4), ("gemma3", "cpu", 8), ("gemma2", "pallas_gpu", 16),
     ("gemma2", "pallas_tpu", 8), ("qwen3_moe", "cpu", 4), ("gpt_oss", "cpu", 4), ("gpt_oss", "pallas_gpu", 16),
     ("gpt_oss", "pallas_tpu", 8)],
    lambda p: p in (("llama", "reference", 4), ("mistral", "cpu", 4), ("gemma3", "cpu", 8), ("qwen3_moe", "cpu", 4),
                    ("gpt_oss", "cpu", 4))))
def test_paged_prefill_then_decode_matches_transformers(case, attn_impl, page_size, tiny_model_dir):
    folder, hf_model = tiny_model_dir(case)
    lm = load_model(folder, dtype="float32", attn_impl=attn_impl)
    seqs = _sequences(lm.config.vocab_size)
    expected = _hf_logits(hf_model, seqs)
    runner = PagedRunner(lm.model, num_pages=16, page_size=page_size)
    got: dict[int, list] = {i: [] for i in range(len(seqs))}
    prompt = {i: s[: len(s) // 2 + 1] for i, s in enumerate(seqs)}
    # Prefill in chunks of 3 tokens, all sequences in one ragged batch per step.
    done = dict.fromkeys(prompt, 0)
    while any(done[i] < len(prompt[i]) for i in prompt):
        chunk = {i: prompt[i][done[i]:done[i] + 3] for i in prompt if done[i] < len(prompt[i])}
        for i, logits in runner.step(chunk, all_logits=True).items():
            got[i].append(logits)
            done[i] += len(chunk[i])
    # Then decode one token per step.
    while any(done[i] < len(seqs[i]) for i in prompt):
        chunk = {i: [seqs[i][done[i]]] for i in prompt if done[i] < len(seqs[i])}
        for i, logits in runner.step(chunk).items():
            got[i].append(logits)
            done[i] += 1
    for i in prompt:
        np.testing.assert_allclose(np.concatenate(got[i]), expected[i], atol=1e-4, rtol=0)
