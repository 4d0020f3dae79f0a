"""The real embedded SmolLM2 GGUF: same logits and greedy tokens as transformers loading the same file."""

import numpy as np
import pytest

from jaxllm.loading import load_model
from tests.paged_driver import PagedRunner, greedy_generate

MESSAGES = [{"role": "user", "content": "Give me three tips for staying focused while studying."}]


@pytest.fixture(scope="module")
def jax_smollm2():
    return load_model(None, dtype="float32", attn_impl="reference")


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def test_config_read_from_metadata(jax_smollm2):
    cfg = jax_smollm2.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0 and cfg.eos_token_ids == (2,)


def test_logits_match_transformers(jax_smollm2, hf_smollm2):
    import jax.numpy as jnp
    import torch

    ids = jax_smollm2.tokenizer.apply_chat_template(MESSAGES, tokenize=True)
    got = np.asarray(jax_smollm2.model(jnp.asarray([ids])))[0]
    with torch.no_grad():
        expected = hf_smollm2(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)


def test_32_greedy_tokens_match_transformers(jax_smollm2, hf_smollm2):
    import torch

    ids = jax_smollm2.tokenizer.apply_chat_template(MESSAGES, tokenize=True)
    runner = PagedRunner(jax_smollm2.model, num_pages=8, page_size=16)
    (got,) = greedy_generate(runner, [ids], 32)
    with torch.no_grad():
        # An explicit mask: generate() would otherwise mask the prompt's <|im_end|>, which is also the pad id.
        prompt = torch.tensor([ids])
        out = hf_smollm2.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                  max_new_tokens=32, min_new_tokens=32)
    assert got == out[0, len(ids):].tolist()
    assert "focus" in jax_smollm2.tokenizer.decode(got).lower() or len(set(got)) > 10
