"""Multi-LoRA through the engine (`LLM(enable_lora=True)`), against transformers + peft with the adapters unmerged:
greedy tokens of one adapter and of one call mixing the base model and two adapters per prompt; adapters swapped
in and out of one device slot without a compile; prefix-cache pages never shared between adapters or with the
base model (a forced hash collision included)."""

import copy
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, LoRARequest, SamplingParams
from jaxllm.engine import block_manager, compile_monitor
from jaxllm.errors import InvalidRequestError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
N = 8


def _make_adapter(hf_model, folder, targets, r, seed, use_rslora=False):
    import peft
    import torch

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, use_rslora=use_rslora,
                             init_lora_weights=False)  # random A and B: an adapter that changes the output
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)  # large enough to move greedy tokens
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory, compile_cache_dir):
    folder, hf_model = tiny_model_dir("qwen2")  # q/k/v biases: the adapter adds to a biased projection
    root = tmp_path_factory.mktemp("adapters")
    everything = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    a = _make_adapter(hf_model, root / "a", everything, 16, 1)
    b = _make_adapter(hf_model, root / "b", ["q_proj", "v_proj", "down_proj"], 8, 2, use_rslora=True)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, num_pages=128,
              max_model_len=64, page_size=4, compilation_cache_dir=compile_cache_dir, enable_lora=True,
              max_loras=2, max_lora_rank=16)
    return llm, hf_model, {"a": (LoRARequest("a", 1, str(root / "a")), a), "b": (LoRARequest("b", 2, str(root / "b")),
                                                                            b)}, root


def _hf_greedy(model, prompt):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False, min_new_tokens=N,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _prompts(seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, n).tolist() for n in (9, 14, 6, 11)]


def _run(llm, prompts, lora):
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)
    return [o.outputs[0].token_ids for o in outs]


def test_one_adapter_and_a_mixed_batch_equal_peft(setup):
    llm, hf_model, adapters, _ = setup
    prompts = _prompts()
    req_a, peft_a = adapters["a"]
    want_a = [_hf_greedy(peft_a, p) for p in prompts]
    want_base = [_hf_greedy(hf_model, p) for p in prompts]
    assert want_a != want_base  # the adapter matters
    assert _run(llm, prompts, req_a) == want_a
    mix = [None, req_a, adapters["b"][0], req_a]  # base / a / b / a in one call
    models = [hf_model, peft_a, adapters["b"][1], peft_a]
    assert _run(llm, prompts, mix) == [_hf_greedy(m, p) for m, p in zip(models, prompts, strict=True)]
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages and all(u == 0 for u in llm.engine.loras.users)


LORA_PROGRAM = """
import sys
from jaxllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, num_pages=64, max_model_len=64,
          page_size=4, compilation_cache_dir=sys.argv[2], enable_lora=True, max_loras=1, max_lora_rank=16)
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
print(llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids)
"""


def test_a_new_process_loads_a_lora_engines_steps_from_the_executable_cache(tiny_model_dir, tmp_path):
    """The adapter kernel's custom-call target is registered when the engine starts, not when a step is traced:
    a step loaded from the executable cache is never traced, and without the target it could not be loaded."""
    folder, _ = tiny_model_dir("qwen2")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    runs = [subprocess.run([sys.executable, "-c", LORA_PROGRAM, str(folder), str(tmp_path)], capture_output=True,
                           text=True, env=env, timeout=600) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.startswith("[")
    assert any((tmp_path / "executables").iterdir())
    assert "unreadable" not in runs[1].stderr, runs[1].stderr[-3000:]


def test_more_adapters_than_slots_wait_and_swapping_never_compiles(setup, tiny_model_dir, compile_cache_dir):
    _, hf_model, adapters, _ = setup
    folder, _ = tiny_model_dir("qwen2")
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, num_pages=128,
              max_model_len=64, page_size=4, compilation_cache_dir=compile_cache_dir, enable_lora=True,
              max_loras=1, max_lora_rank=16)
    prompts = _prompts(5)
    _run(llm, prompts[:1], None)  # every bucket built and run once
    before = compile_monitor.snapshot()
    mix = [adapters["a"][0], adapters["b"][0], None, adapters["b"][0]]  # two adapters, one slot: one waits
    got = _run(llm, prompts, mix)
    assert compile_monitor.snapshot()["compiles"] == before["compiles"]
    models = [adapters["a"][1], adapters["b"][1], hf_model, adapters["b"][1]]
    assert got == [_hf_greedy(m, p) for m, p in zip(models, prompts, strict=True)]


def test_prefix_pages_are_never_shared_across_adapters(setup, monkeypatch):
    llm, hf_model, adapters, _ = setup
    prompt = _prompts(7)[1]  # 14 tokens: three full pages of 4
    req_a = adapters["a"][0]
    want_base, want_a = _hf_greedy(hf_model, prompt), _hf_greedy(adapters["a"][1], prompt)
    assert _run(llm, [prompt], req_a) == [want_a]
    assert _run(llm, [prompt], None) == [want_base]  # the adapter's pages are cached, and not reused here
    # every page hash the same: only the pages' recorded keys (salt, adapter, tokens, parent) keep them apart
    monkeypatch.setattr(block_manager, "page_hash", lambda prev, tokens, images=b"": b"x" * 32)
    assert _run(llm, [prompt], req_a) == [want_a]
    assert _run(llm, [prompt], None) == [want_base]
    assert _run(llm, [prompt], adapters["b"][0]) == [_hf_greedy(adapters["b"][1], prompt)]


def _adapter_files(src, dst, **config_changes):
    import json
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(("change", "message"), [
    ({"r": 32}, "rank 32 is above max_lora_rank 16"),
    ({"use_dora": True}, "DoRA adapters are not supported"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, r"unsupported target modules \['embed_tokens'\]"),
    ({"modules_to_save": ["lm_head"]}, "modules saved whole are not supported"),
    ({"r": 4}, r"has A \[16, \d+\] and B \[\d+, 16\]; this base needs \[4, "),  # shapes that do not fit
])
def test_adapters_that_cannot_be_served_are_refused_and_nothing_is_added(setup, tmp_path, change, message):
    llm, _, adapters, root = setup
    bad = _adapter_files(root / "a", tmp_path / "bad", **change)
    before = dict(llm.engine.requests)
    with pytest.raises(InvalidRequestError, match=message) as e:
        _run(llm, _prompts()[:2], [None, LoRARequest("bad", 99, str(bad))])
    assert e.value.param == "lora_request"
    assert llm.engine.requests == before  # the valid prompt was not added either


def test_missing_files_and_an_engine_without_lora_are_clear_errors(setup, tmp_path, tiny_model_dir,
                                                                  compile_cache_dir):
    llm, _, _, _ = setup
    with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
        _run(llm, _prompts()[:1], LoRARequest("gone", 7, str(tmp_path / "nowhere")))
    folder, _ = tiny_model_dir("qwen2")
    plain = LLM(str(folder), dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, num_pages=32,
                max_model_len=64, page_size=4, compilation_cache_dir=compile_cache_dir)
    with pytest.raises(InvalidRequestError, match="serves no LoRA adapters"):
        _run(plain, _prompts()[:1], LoRARequest("a", 1, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("a", 0, str(tmp_path))


def test_the_base_model_through_a_lora_engine_is_the_plain_engines_bit_for_bit(setup, tiny_model_dir,
                                                                                compile_cache_dir):
    """A request without an adapter (slot -1) gets exact zeros added: its tokens and logprobs are the plain
    engine's, alone and beside adapter requests."""
    llm, _, adapters, _ = setup
    folder, _ = tiny_model_dir("qwen2")
    plain = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, num_pages=128,
                max_model_len=64, page_size=4, compilation_cache_dir=compile_cache_dir)
    prompts = _prompts(11)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=2)

    def run(engine, lora):
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)
        return [(o.outputs[0].token_ids, [sorted((k, v.logprob) for k, v in d.items()) for d in o.outputs[0].logprobs])
                for o in outs]

    want = run(plain, None)
    assert run(llm, None) == want
    mixed = run(llm, [None, adapters["a"][0], None, adapters["b"][0]])
    assert [mixed[0], mixed[2]] == [want[0], want[2]]


@pytest.mark.slow
@pytest.mark.skipif(len(__import__("jax").devices()) < 2, reason="needs --xla_force_host_platform_device_count=2")
def test_tensor_parallel_adapters_equal_peft(tiny_model_dir, tmp_path, compile_cache_dir):
    """Tables split as their layers' weights (A by the input, B by the output): column- and row-parallel layers,
    fused q/k/v and gate/up, on 2 devices."""
    folder, hf_model = tiny_model_dir("qwen2_tp")
    everything = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    a = _make_adapter(hf_model, tmp_path / "a", everything, 8, 4)
    b = _make_adapter(hf_model, tmp_path / "b", ["k_proj", "o_proj", "up_proj", "down_proj"], 4, 5)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, num_pages=64, max_model_len=64,
              page_size=4, compilation_cache_dir=compile_cache_dir, enable_lora=True, max_loras=2, max_lora_rank=8,
              tensor_parallel_size=2)
    specs = {(linear, which): tuple(llm.engine.runner.params[i].sharding.spec)
             for i, _, linear, which in llm.engine.loras.tables.entries}
    assert "tp" in specs["self_attn.qkv_proj", "b"][-1] and "tp" in specs["mlp.down_proj", "a"][-1]  # B [.., R, out]
    prompts = _prompts(13)
    mix = [LoRARequest("a", 1, str(tmp_path / "a")), None, LoRARequest("b", 2, str(tmp_path / "b")),
           LoRARequest("a", 1, str(tmp_path / "a"))]
    models = [a, hf_model, b, a]
    assert _run(llm, prompts, mix) == [_hf_greedy(m, p) for m, p in zip(models, prompts, strict=True)]


@pytest.mark.slow
def test_an_adapter_over_a_quantized_gguf_base(tiny_model_dir, tmp_path, compile_cache_dir):
    """The base's Q8_0 weights stay quantized; the adapter's tables are bfloat16 (`lora_dtype` "auto" over quantized
    weights) and its term is added in float32: greedy tokens within the quantization's rounding of transformers +
    peft over the float base."""
    from gguf import GGMLQuantizationType

    from tests.gguf_writer import write_llama_gguf
    from tests.quantized_greedy import assert_greedy_within

    _, hf_model = tiny_model_dir("llama")
    path = write_llama_gguf(hf_model, tmp_path / "tiny-q8_0.gguf", GGMLQuantizationType.Q8_0)
    peft_model = _make_adapter(hf_model, tmp_path / "a", ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"], 8, 6)
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=16, num_pages=64, max_model_len=64, page_size=4,
              compilation_cache_dir=compile_cache_dir, enable_lora=True, max_loras=1, max_lora_rank=8)
    runner = llm.engine.runner
    assert any(p.dtype == np.int8 for p in runner.params)  # served quantized
    tables = [p.dtype for p, path in zip(runner.params, runner.param_paths, strict=True) if ".lora_" in path]
    assert tables and set(tables) == {jnp.dtype(jnp.bfloat16)}
    prompts = _prompts(17)
    assert [_hf_greedy(peft_model, p) for p in prompts] != [_hf_greedy(hf_model, p) for p in prompts]
    assert_greedy_within(llm, peft_model, prompts, lora_request=LoRARequest("a", 1, str(tmp_path / "a")))


def test_an_adapter_over_a_quantized_base_on_the_int8_path_is_one_call_a_layer(tiny_model_dir, tmp_path,
                                                                              compile_cache_dir, monkeypatch):
    """On the host's int8 path (what `LLM()` runs on such a CPU) each quantized layer's matmul and adapter term are
    one custom call (`pallas_kernels.lora_delta.cpu_fused`) in decode steps, the two kernels apart in longer ones:
    greedy tokens within the quantization's rounding of transformers + peft over the float base."""
    from gguf import GGMLQuantizationType

    from pallas_kernels.lora_delta import cpu_fused
    from pallas_kernels.quantized_matmul import isa
    from tests.gguf_writer import write_llama_gguf
    from tests.quantized_greedy import assert_greedy_within

    if not isa.available() or isa.available() == ("amx",):
        pytest.skip(f"no int8 lane path on this CPU ({isa.describe()})")
    path_isa = next(p for p in isa.available() if p != "amx")
    monkeypatch.setenv(isa.ENV, path_isa)
    _, hf_model = tiny_model_dir("llama")
    path = write_llama_gguf(hf_model, tmp_path / "tiny-q8_0.gguf", GGMLQuantizationType.Q8_0)
    peft_model = _make_adapter(hf_model, tmp_path / "a", ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], 8,
                               7)
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=80, num_pages=64, max_model_len=64, page_size=4,
              compilation_cache_dir=compile_cache_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    runner = llm.engine.runner
    assert llm.engine.model.kernels.int8_isa == path_isa
    decode = runner.build(runner.bucket_for(1, 1)).as_text()
    prefill = runner.build(runner.bucket_for(80, 1)).as_text()
    fused = [cpu_fused.target(path_isa, x16) for x16 in (False, True)]
    assert sum(decode.count(f'"{t}"') for t in fused) >= 4  # the four quantized layers of a decoder layer
    assert not any(t in prefill for t in fused) and "jaxllm_cpu_lora_delta" in prefill
    prompts = _prompts(19)
    assert_greedy_within(llm, peft_model, prompts, lora_request=LoRARequest("a", 1, str(tmp_path / "a")))
