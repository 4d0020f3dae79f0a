"""GPT-OSS GGUF files as llama.cpp's converter writes them ("gpt-oss": experts split per projection with their
biases, sinks, the second norm under its llama.cpp name, the window and YaRN in the metadata), float32 or with
MXFP4 experts (the released files' type): the logits of the transformers model with the same weights. The model
is the tiny GPT-OSS with llama.cpp's fixed SwiGLU limit (7.0; the files carry none) and YaRN's correction range
rounded outward (llama.cpp's), its range (beta_fast, beta_slow) other than the defaults, as the file says."""

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from jaxllm import LLM, SamplingParams
from jaxllm.loading import LoadError, load_model
from jaxllm.loading.gguf import gguf_config
from jaxllm.loading.gguf_file import GGUFFile
from tests.gguf_writer import write_gpt_oss_gguf
from tests.models.test_hf_parity import _hf_logits
from tests.tiny_models import ARCHITECTURE_CASES, build_tiny_hf_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PROMPTS = [[5, 900, 17, 33, 250, 4, 4, 61, 700, 12, 9], [44, 3, 1000, 8, 76, 19, 500]]  # longer than the window (6)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    rope = {**ARCHITECTURE_CASES["gpt_oss"][1]["rope_parameters"], "truncate": True, "beta_fast": 16.0,
            "beta_slow": 2.0}  # (YaRN's correction range from the file's metadata, not the defaults)
    _, model = build_tiny_hf_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss_llamacpp"),
                                   {"swiglu_limit": 7.0, "rope_parameters": rope})
    return model


def _logits(lm, sequences=PROMPTS):
    return [np.asarray(lm.model(jnp.asarray([s])))[0] for s in sequences]


def test_a_float32_file_matches_transformers(hf_model, tmp_path):
    path = write_gpt_oss_gguf(hf_model, tmp_path / "gpt-oss.gguf")
    lm = load_model(path, dtype="float32", attn_impl="reference")
    cfg = lm.config
    assert cfg.architecture == "GptOssForCausalLM" and cfg.attention_sinks and cfg.moe_bias
    assert cfg.layer_windows == (6, 0, 6) and (cfg.swiglu_limit, cfg.swiglu_alpha) == (7.0, 1.702)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (8, 3, True)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.truncate and (cfg.rope.beta_fast, cfg.rope.beta_slow) == (16, 2)
    for got, want in zip(_logits(lm), _hf_logits(hf_model, PROMPTS), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_mxfp4_experts_load_as_their_decoded_weights(hf_model, tmp_path):
    """The experts' MXFP4 blocks decode to what gguf-py decodes (bit for bit), and the model gives the logits of
    the transformers model whose experts hold those decoded weights."""
    import copy

    import torch

    path = write_gpt_oss_gguf(hf_model, tmp_path / "gpt-oss-mxfp4.gguf", T.MXFP4)
    g = GGUFFile(path)
    info = g.tensors["blk.0.ffn_down_exps.weight"]
    assert info.qtype == T.MXFP4
    raw = np.asarray(g._data[info.offset:info.offset + info.nbytes])
    reference = quants.dequantize(raw.reshape(*info.shape[:-1], -1), T.MXFP4)
    np.testing.assert_array_equal(g.load("blk.0.ffn_down_exps.weight").view(np.uint32), reference.view(np.uint32))
    decoded = copy.deepcopy(hf_model)
    with torch.no_grad():
        for i, layer in enumerate(decoded.model.layers):
            gate, up = (torch.from_numpy(g.load(f"blk.{i}.ffn_{p}_exps.weight")) for p in ("gate", "up"))
            gate_up = torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1, gate.shape[2])  # [E, 2 * mlp, in]
            layer.mlp.experts.gate_up_proj.copy_(gate_up.transpose(1, 2))
            layer.mlp.experts.down_proj.copy_(torch.from_numpy(g.load(f"blk.{i}.ffn_down_exps.weight")).transpose(1, 2))
    assert not np.allclose(_hf_logits(decoded, PROMPTS)[0], _hf_logits(hf_model, PROMPTS)[0], atol=1e-3)
    lm = load_model(path, dtype="float32", attn_impl="reference")
    for got, want in zip(_logits(lm), _hf_logits(decoded, PROMPTS), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_an_engine_on_an_mxfp4_file_generates_the_dense_forwards_greedy_tokens(hf_model, tmp_path):
    path = write_gpt_oss_gguf(hf_model, tmp_path / "gpt-oss-mxfp4.gguf", T.MXFP4)
    lm = load_model(path, dtype="float32", attn_impl="reference")
    llm = LLM(str(path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, num_pages=64, max_model_len=64,
              page_size=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens = list(prompt)
        for _ in range(6):  # the dense forward's greedy chain over the same weights
            tokens.append(int(np.asarray(lm.model(jnp.asarray([tokens])))[0, -1].argmax()))
        assert list(out.outputs[0].token_ids) == tokens[len(prompt):]


def test_a_file_without_its_window_is_refused(hf_model, tmp_path):
    g = GGUFFile(write_gpt_oss_gguf(hf_model, tmp_path / "gpt-oss.gguf"))
    del g.metadata["gpt-oss.attention.sliding_window"]
    with pytest.raises(LoadError, match=r"gpt-oss\.gguf: metadata gpt-oss\.attention\.sliding_window is missing"):
        gguf_config(g)
