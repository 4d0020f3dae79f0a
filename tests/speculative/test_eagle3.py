"""The eagle3 method on a tiny random Llama with tiny random EAGLE-3 heads saved as vLLM and sglang load them: every
draft the engine proposes is the one a reference head written here in torch computes from transformers' hidden
states of the target (so the features, the rows' offsets, the head's KV and its decode loop are right); the output
is plain decoding's token for token, greedy and seeded, with drafts kept and refused; nothing compiles after
warm-up and every page is free afterwards; bad heads are refused with one line."""

import json
import math

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError
from jaxllm.loading.errors import LoadError
from jaxllm.speculative.eagle3_head import Eagle3Config
from tests.engine.test_speculative import assert_plain_outputs, run_with_aborts
from tests.tiny_models import build_tiny_eagle3_head

OPTIONS = dict(dtype="float32", attn_impl="auto", max_num_seqs=16, max_num_batched_tokens=64, num_pages=256,
               max_model_len=256, token_buckets=(16, 64))
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 90, 7)]  # 90: prefilled in two chunks
AUX = [0, 1]  # the tiny target has two layers (a real head's default is layers 2, L/2 and L-3)
# A head whose draft vocabulary is two target tokens (d2t maps draft id d to d + d2t[d]), drafting for requests
# whose logit_bias makes the target sample mostly those: drafts kept and refused.
PAIR = (7, 9)
PAIR_BIAS = {PAIR[0]: 8.0, PAIR[1]: 8.0}


def _spec(head, k=3):
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k, "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def target_config(tiny_folder):
    return json.loads((tiny_folder / "config.json").read_text())


@pytest.fixture(scope="module")
def heads(target_config, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    random = build_tiny_eagle3_head(root / "random", target_config, aux_layers=AUX, seed=1)
    pair = build_tiny_eagle3_head(root / "pair", target_config, aux_layers=AUX, seed=2, draft_vocab=2,
                                  d2t=[PAIR[0], PAIR[1] - 1])
    return {"random": (root / "random", random), "pair": (root / "pair", pair)}


@pytest.fixture(scope="module")
def engines(tiny_folder, heads, compile_cache_dir):
    return (LLM(str(tiny_folder), compilation_cache_dir=compile_cache_dir, speculative_config=_spec(heads["pair"][0]),
                **OPTIONS),
            LLM(str(tiny_folder), compilation_cache_dir=compile_cache_dir, **OPTIONS))


class ReferenceHead:
    """EAGLE-3's draft head as its paper and vLLM define it, in torch, over whole sequences (no cache)."""

    def __init__(self, tensors: dict, config: dict, target):
        import torch

        self.t = {k.removeprefix("midlayer.").removeprefix("model.layers.0."): v.double() for k, v in tensors.items()}
        self.embed = self.t.get("embed_tokens.weight", target.model.embed_tokens.weight.detach().double())
        self.heads, self.kv = config["num_attention_heads"], config["num_key_value_heads"]
        self.d = config["hidden_size"] // self.heads
        self.eps, self.theta = config["rms_norm_eps"], config.get("rope_theta", 10000.0)
        self.target, self.torch = target, torch

    def norm(self, x, name):
        return x * self.torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.t[name]

    def rope(self, x, positions):  # x [n, heads, d], Llama's rotate-half
        torch, half = self.torch, self.d // 2
        inv = 1.0 / self.theta ** (torch.arange(half, dtype=torch.float64) * 2 / self.d)
        angles = positions[:, None].double() * inv[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def layer(self, ids, hidden):
        """ids [n], hidden [n, E] (rows 0..n-1 at positions 0..n-1) -> (normed, prenorm) [n, E]."""
        torch, t, n = self.torch, self.t, len(ids)
        x = torch.cat([self.norm(self.embed[ids], "input_layernorm.weight"),
                       self.norm(hidden, "hidden_norm.weight")], -1)
        pos = torch.arange(n)
        q = self.rope((x @ t["self_attn.q_proj.weight"].T).view(n, self.heads, self.d), pos)
        k = self.rope((x @ t["self_attn.k_proj.weight"].T).view(n, self.kv, self.d), pos)
        v = (x @ t["self_attn.v_proj.weight"].T).view(n, self.kv, self.d)
        k, v = (a.repeat_interleave(self.heads // self.kv, dim=1) for a in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1) @ t["self_attn.o_proj.weight"].T
        h = attn + hidden
        m = self.norm(h, "post_attention_layernorm.weight")
        mlp = (torch.nn.functional.silu(m @ t["mlp.gate_proj.weight"].T) * (m @ t["mlp.up_proj.weight"].T)) @ \
            t["mlp.down_proj.weight"].T
        out = mlp + h
        return self.norm(out, "norm.weight"), out

    def drafts(self, tokens: list[int], m: int) -> list[int]:
        """The m drafts after `tokens` (the target computed all but the last)."""
        torch, t = self.torch, self.t
        with torch.no_grad():
            states = self.target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
            features = torch.cat([states[i][0].double() for i in AUX], -1)  # [n - 1, 2E]: the inputs of AUX
            hidden = features @ t["fc.weight"].T
            ids, out = list(tokens[1:]), []
            for _ in range(m):
                normed, prenorm = self.layer(torch.tensor(ids), hidden)
                d = int((normed[-1] @ t["lm_head.weight"].T).argmax())
                out.append(d + int(t["d2t"][d]))
                ids.append(out[-1])
                hidden = torch.cat([hidden, prenorm[-1:]])
        return out


def _record_drafts(llm) -> list[tuple[list[int], list[int]]]:
    """Each drafting sequence's tokens and drafts, as the engine's proposer fills them (appended as it runs)."""
    proposer, records = llm.engine.drafter.proposer, []
    fill = proposer.fill

    def recording(step):
        fill(step)
        records.extend((list(seq.token_ids), list(d)) for seq, d in zip(step.seqs, step.drafts, strict=True) if d)
    proposer.fill = recording
    return records


@pytest.mark.parametrize("layout", ["shared-embeddings", "own-embeddings"])
def test_every_draft_is_the_reference_heads(tiny_folder, target_config, tmp_path, compile_cache_dir, layout):
    """Greedy requests, prompts chunked by the step budget and a prefix-cache hit: every draft the engine proposed
    equals the torch head's on transformers' hidden states. The second layout names the layer ``model.layers.0``
    and ships its own embeddings."""
    import transformers

    own = layout == "own-embeddings"
    # a draft vocabulary of 600 of the target's 1024 tokens
    kept = np.sort(np.random.default_rng(0).choice(target_config["vocab_size"], 600, replace=False))
    tensors = build_tiny_eagle3_head(tmp_path / "head", target_config, aux_layers=AUX, seed=3, own_embeddings=own,
                                     prefix="model.layers.0." if own else "midlayer.", draft_vocab=600,
                                     d2t=kept - np.arange(600))
    llm = LLM(str(tiny_folder), compilation_cache_dir=compile_cache_dir, speculative_config=_spec(tmp_path / "head"),
              **OPTIONS)
    records = _record_drafts(llm)
    llm.generate(PROMPTS + PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    reference = ReferenceHead(tensors, target_config,
                              transformers.LlamaForCausalLM.from_pretrained(tiny_folder).double().eval())
    assert len(records) > 20
    assert [d for _, d in records] == [reference.drafts(tokens, len(d)) for tokens, d in records]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias=PAIR_BIAS),
    SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True, logprobs=1, logit_bias=PAIR_BIAS),
    SamplingParams(temperature=0.8, top_k=20, seed=9, max_tokens=30, ignore_eos=True, n=2, logit_bias=PAIR_BIAS),
], ids=["greedy", "seeded", "top-k-n2"])
def test_outputs_are_plain_decodings_token_for_token(engines, params):
    assert_plain_outputs(*engines, PROMPTS + PROMPTS[1:2], params)  # a prefix-cache hit


def test_no_compiles_after_warmup_and_every_page_free_after_aborts(engines):
    engine = engines[0].engine
    prompts = [list(range(7, 7 + 10 * i + 3)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logit_bias=PAIR_BIAS)
    run_with_aborts(engine, prompts, params, steps=6)
    engine.step()  # an idle step: the sequences that ended are forgotten
    assert engine.drafter.proposer.held == {}


def test_preempted_drafting_sequences_end_as_plain_ones(tiny_folder, heads, engines, compile_cache_dir):
    small = LLM(str(tiny_folder), compilation_cache_dir=compile_cache_dir, **{**OPTIONS, "num_pages": 24},
                speculative_config=_spec(heads["pair"][0]))
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, logit_bias=PAIR_BIAS)
    prompts = [{"prompt_token_ids": list(range(9 + i, 49 + i))} for i in range(4)]
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.engine.scheduler.num_preemptions > 0 and small.spec_decode_stats.num_accepted_tokens > 0
    assert got == [o.outputs[0].token_ids for o in engines[1].generate(prompts, params, use_tqdm=False)]
    bm = small.engine.block_manager
    assert bm.num_free_pages == bm.num_pages


def test_the_default_target_layers_are_vllms():
    from jaxllm.config import ModelConfig

    target = ModelConfig("LlamaForCausalLM", 1000, 64, 128, 32, 4, 2, 16)
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "num_hidden_layers": 1,
           "draft_vocab_size": 100}
    cfg = Eagle3Config.from_hf(raw, target)
    assert (cfg.aux_layers, cfg.feature_size, cfg.draft_vocab_size) == ((2, 16, 29), 3 * 64, 100)
    with pytest.raises(ConfigError, match="not layers of the target"):
        Eagle3Config.from_hf({**raw, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 40]}}, target)


def test_bad_heads_are_refused_with_one_line(tiny_folder, target_config, heads, tmp_path, compile_cache_dir):
    import shutil

    from safetensors.numpy import load_file, save_file

    options = dict(OPTIONS, compilation_cache_dir=compile_cache_dir)

    def start(head):
        LLM(str(tiny_folder), speculative_config=_spec(head), **options)

    with pytest.raises(ConfigError, match="eagle3 needs a model"):
        LLM(str(tiny_folder), speculative_config={"method": "eagle3"}, **options)
    with pytest.raises(ConfigError, match="not an EAGLE-3 head"):
        start(tiny_folder)  # a plain model
    wide = tmp_path / "wide"  # a head for a wider model
    build_tiny_eagle3_head(wide, {**target_config, "hidden_size": 128}, aux_layers=AUX)
    with pytest.raises(LoadError, match=r"fc.weight has shape \(128, 256\), but the config implies \(128, 128\)"):
        start(wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(config | {"target_hidden_size": 128}))
    with pytest.raises(ConfigError, match="hidden size 128, not this one's"):
        start(wide)
    three = tmp_path / "three"
    build_tiny_eagle3_head(three, target_config, aux_layers=[0, 1, 2])
    with pytest.raises(ConfigError, match="not layers of the target"):
        start(three)
    missing = tmp_path / "missing"
    shutil.copytree(heads["random"][0], missing)
    weights = load_file(missing / "model.safetensors")
    del weights["midlayer.hidden_norm.weight"]
    save_file(weights, missing / "model.safetensors")
    with pytest.raises(LoadError, match="missing 1 tensor"):
        start(missing)
    binary = tmp_path / "binary"
    binary.mkdir()
    shutil.copy(heads["random"][0] / "config.json", binary)
    (binary / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(LoadError, match="convert it to safetensors"):
        start(binary)


@pytest.mark.slow  # two more engines (~30 s)
@pytest.mark.skipif(len(__import__("jax").devices()) < 2, reason="needs --xla_force_host_platform_device_count=2")
def test_a_head_split_over_two_devices_with_its_target(tiny_model_dir, tmp_path, compile_cache_dir):
    """Tensor parallel 2: the head's weights and cache split by KV heads as the target's, the feature cache
    replicated (the residual stream is); drafts kept, the output plain decoding's."""
    target, _ = tiny_model_dir("qwen2_tp")
    config = json.loads((target / "config.json").read_text())
    build_tiny_eagle3_head(tmp_path / "head", config, aux_layers=AUX, seed=2, draft_vocab=2,
                           d2t=[PAIR[0], PAIR[1] - 1])
    options = dict(OPTIONS, compilation_cache_dir=compile_cache_dir)
    spec = LLM(str(target), tensor_parallel_size=2, speculative_config=_spec(tmp_path / "head"), **options)
    plain = LLM(str(target), **options)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logit_bias=PAIR_BIAS)
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert spec.spec_decode_stats.num_accepted_tokens > 0
    cache = spec.engine.drafter.proposer.runner.caches[0]
    assert len(cache.sharding.device_set) == 2 and cache.sharding.shard_shape(cache.shape)[0] == cache.shape[0] // 2
    features = spec.engine.runner.features
    assert len(features.sharding.device_set) == 2 and features.sharding.is_fully_replicated
