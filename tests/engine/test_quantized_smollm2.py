"""The embedded SmolLM2 served quantized (its GGUF's Q4_1 and Q8_0 kept as they are) against the same model
dequantized to float32; per-channel int8 made at load against float32; batch invariance and no recompilation
with quantized weights."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.loading import weight_bytes
from tests.engine import test_engine_smollm2 as base

pytestmark = pytest.mark.slow  # SmolLM2 engines per quantization

TEXT = ("The water cycle describes how water moves between the oceans, the air and the land. Heat from the sun "
        "evaporates water from seas and lakes; the vapour rises, cools and condenses into clouds. When droplets "
        "grow heavy enough they fall as rain or snow, which feeds rivers, soaks into the ground as groundwater, "
        "or collects in glaciers before it returns, sooner or later, to the sea.")


def _greedy(llm, prompts, tokens=64):
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


@pytest.fixture(scope="module")
def prompts(smollm2_llm):
    return [base.chat_ids(smollm2_llm, q) for q in base.QUESTIONS]


@pytest.fixture(scope="module")
def float_greedy(smollm2_llm, prompts):
    return _greedy(smollm2_llm, prompts)


def test_weights_stay_quantized(smollm2_quantized_llm, smollm2_path):
    model = smollm2_quantized_llm.engine.model
    plan = model.quant_plan
    assert {fmt.name for fmt in plan.values()} == {"q4_1", "q8_0"} and plan["embed_tokens"].name == "q8_0"
    from jaxllm.loading.gguf_file import GGUFFile
    file_bytes = sum(t.nbytes for t in GGUFFile(smollm2_path).tensors.values())
    assert weight_bytes(model) <= 1.01 * file_bytes  # the blocks as the file holds them, nothing expanded


def test_logits_match_the_dequantized_model(smollm2_quantized_llm, smollm2_llm, prompts):
    for p in prompts[:4]:
        ids = jnp.asarray([p])
        q = np.asarray(smollm2_quantized_llm.engine.model(ids))
        f = np.asarray(smollm2_llm.engine.model(ids))
        assert np.max(np.abs(q - f)) <= 1e-3 * np.max(np.abs(f))


def test_greedy_outputs_match_the_dequantized_model(smollm2_quantized_llm, prompts, float_greedy, capsys):
    same = sum(a == b for a, b in zip(_greedy(smollm2_quantized_llm, prompts), float_greedy, strict=True))
    with capsys.disabled():
        print(f"\nQ4_1 served quantized vs dequantized to float32: {same}/16 prompts identical over 64 tokens")
    assert same >= 15, f"{same}/16 prompts identical over 64 tokens"


def test_batch_invariance_quantized(smollm2_quantized_llm):
    base.test_batch_invariance_greedy_and_seeded(smollm2_quantized_llm)


def test_no_recompilation_after_warmup_quantized(smollm2_quantized_llm):
    base.test_no_recompilation_after_warmup(smollm2_quantized_llm)


def _perplexity(model, ids) -> float:
    logits = np.asarray(model(jnp.asarray([ids])), np.float64)[0, :-1]
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return math.exp(-np.mean(logp[np.arange(len(ids) - 1), ids[1:]]))


def test_int8_keeps_perplexity_and_greedy_outputs(compile_cache_dir, smollm2_llm, prompts, float_greedy, capsys):
    from jaxllm import LLM
    from tests.conftest import ENGINE_OPTIONS

    # Fewer buckets than the shared engines (its int8 steps compile anew): 16 sequences, 64-token steps.
    llm = LLM(compilation_cache_dir=compile_cache_dir, **{**ENGINE_OPTIONS, "attn_impl": "auto",
                                                          "quantization": "int8", "max_num_seqs": 16,
                                                          "max_num_batched_tokens": 64})
    model = llm.engine.model
    assert {fmt.name for fmt in model.quant_plan.values()} == {"int8"}
    assert weight_bytes(model) < 0.3 * weight_bytes(smollm2_llm.engine.model)
    ids = smollm2_llm.get_tokenizer().encode(TEXT)
    ppl_int8, ppl_f32 = _perplexity(model, ids), _perplexity(smollm2_llm.engine.model, ids)
    outs = _greedy(llm, prompts)
    same = sum(a == b for a, b in zip(outs, float_greedy, strict=True))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
              for a, b in zip(outs, float_greedy, strict=True)]
    with capsys.disabled():
        print(f"\nint8 vs float32: perplexity {ppl_int8:.4f} vs {ppl_f32:.4f}; greedy: {same}/16 prompts identical "
              f"over 64 tokens, first difference after {sorted(prefix)} tokens")
    assert abs(ppl_int8 - ppl_f32) <= 0.01 * ppl_f32
    # A 135M model's greedy path flips on small logit changes, then diverges (how many prompts survive all 64
    # tokens depends on the step shapes: 2/16 with 128-token steps, 0/16 with 64): most agree for a while.
    assert np.median(prefix) >= 8
