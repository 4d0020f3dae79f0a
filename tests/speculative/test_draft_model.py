"""The draft_model method on tiny random Llamas: a one-layer draft cut from the target (its own cache geometry,
drafts the target keeps and refuses), the output plain decoding's token for token, greedy and seeded, with
prompts chunked by a small step budget, prefix-cache hits, n > 1, preemption and aborts; nothing compiles after
warm-up and every page is free afterwards. A draft whose tokenizer or vocabulary differs is refused, as are
draft-model fields for another method."""

import shutil

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError
from jaxllm.loading.errors import LoadError
from tests.engine.test_speculative import assert_plain_outputs, run_with_aborts

OPTIONS = dict(dtype="float32", attn_impl="auto", max_num_seqs=16, max_num_batched_tokens=64, num_pages=256,
               max_model_len=256, token_buckets=(16, 64))
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 90, 7)]  # 90: prefilled in two chunks


def one_layer_draft(target, folder):
    """The target's embeddings, first layer and head as a model of its own (what a small draft of the same family
    is: the same vocabulary, fewer layers)."""
    fields = target.config.to_dict()
    layer_types = {"layer_types": fields["layer_types"][:1]} if fields.get("layer_types") else {}
    config = type(target.config)(**{**fields, "num_hidden_layers": 1, **layer_types})
    draft = type(target)(config)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if ".layers.1." not in k})
    draft.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tiny_folder, tmp_path_factory):
    import transformers

    target = transformers.LlamaForCausalLM.from_pretrained(tiny_folder)
    draft = one_layer_draft(target, tmp_path_factory.mktemp("draft") / "draft")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_folder / name, draft / name)
    return tiny_folder, draft


@pytest.fixture(scope="module")
def engines(folders, compile_cache_dir):
    target, draft = folders
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "disable_by_batch_size": None}
    return (LLM(str(target), compilation_cache_dir=compile_cache_dir, speculative_config=spec, **OPTIONS),
            LLM(str(target), compilation_cache_dir=compile_cache_dir, **OPTIONS))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0.8, top_k=20, seed=9, max_tokens=30, ignore_eos=True, n=2),
], ids=["greedy", "seeded", "top-k-n2"])
def test_outputs_are_plain_decodings_token_for_token(engines, params):
    assert_plain_outputs(*engines, PROMPTS + PROMPTS[1:2], params)  # a prefix-cache hit


def test_no_compiles_after_warmup_and_every_page_free_after_aborts(engines):
    engine = engines[0].engine
    prompts = [list(range(7, 7 + 10 * i + 3)) for i in range(6)]
    run_with_aborts(engine, prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), steps=6)
    engine.step()  # an idle step: the sequences that ended are forgotten
    assert engine.drafter.proposer.held == {}


def test_preempted_drafting_sequences_end_as_plain_ones(folders, engines, compile_cache_dir):
    target, draft = folders
    small = LLM(str(target), compilation_cache_dir=compile_cache_dir, **{**OPTIONS, "num_pages": 24},
                speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                                   "disable_by_batch_size": None})
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(9 + i, 49 + i))} for i in range(4)]
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.engine.scheduler.num_preemptions > 0 and small.spec_decode_stats.num_accepted_tokens > 0
    assert got == [o.outputs[0].token_ids for o in engines[1].generate(prompts, params, use_tqdm=False)]
    bm = small.engine.block_manager
    assert bm.num_free_pages == bm.num_pages


@pytest.mark.slow  # two more engines (~30 s)
@pytest.mark.skipif(len(__import__("jax").devices()) < 2, reason="needs --xla_force_host_platform_device_count=2")
def test_a_draft_split_over_two_devices_with_its_target(tiny_model_dir, tmp_path, compile_cache_dir):
    """Tensor parallel 2: the draft's weights and cache split as the target's (heads over the devices)."""
    target, hf_model = tiny_model_dir("qwen2_tp")
    draft = one_layer_draft(hf_model, tmp_path / "draft")
    options = dict(OPTIONS, compilation_cache_dir=compile_cache_dir)
    spec = LLM(str(target), tensor_parallel_size=2, **options,
               speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                                   "disable_by_batch_size": None})
    plain = LLM(str(target), **options)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert spec.spec_decode_stats.num_accepted_tokens > 0
    cache = spec.engine.drafter.proposer.runner.caches[0]
    assert len(cache.sharding.device_set) == 2 and cache.sharding.shard_shape(cache.shape)[0] == cache.shape[0] // 2


def test_drafts_stop_at_max_tokens_and_the_model_length(engines):
    spec, plain = engines
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 5)]
    long = {"prompt_token_ids": list(range(3, 3 + 250))}  # 6 tokens of room in max_model_len 256
    prompts = [PROMPTS[0]] * 3 + [long]
    params.append(SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))  # up to the model length
    got = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert [len(c.token_ids) for c in got] == [1, 2, 5, 6] and got[3].finish_reason == "length"
    assert [c.token_ids for c in got] == [o.outputs[0].token_ids
                                          for o in plain.generate(prompts, params, use_tqdm=False)]


def test_the_draft_budget_weighs_rows_by_the_steps_timed_at_warmup(folders, engines, compile_cache_dir):
    """`draft_budget="step_cost"`: every bucket timed at warm-up, then by the steps run."""
    plain = engines[1]
    spec = LLM(str(folders[0]), compilation_cache_dir=compile_cache_dir, **OPTIONS,
               speculative_config={"method": "draft_model", "model": str(folders[1]), "num_speculative_tokens": 3,
                                   "draft_budget": "step_cost"})
    assert engines[0].engine.drafter.budget is None  # the default, "all": nothing timed
    assert all(build.run_s == 0 for build in engines[0].engine.startup.buckets)
    budget = spec.engine.drafter.budget
    buckets = spec.engine.runner.buckets
    assert budget is not None and set(budget.bucket_seconds) == set(buckets)
    assert all(seconds > 0 for seconds in budget.bucket_seconds.values())
    assert all(build.run_s == 0 for build in plain.engine.startup.buckets)  # no speculation: nothing timed twice
    before = dict(budget.bucket_seconds)
    spec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    changed = {b for b, seconds in budget.bucket_seconds.items() if seconds != before[b]}
    assert changed and changed <= set(buckets)  # the steps run since moved their buckets' estimates


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused(folders, tmp_path, compile_cache_dir):
    target, draft = folders
    other_tokens = tmp_path / "draft"
    shutil.copytree(draft, other_tokens)
    import json

    tokenizer = json.loads((other_tokens / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # two ids that mean each other's text
    (other_tokens / "tokenizer.json").write_text(json.dumps(tokenizer))
    options = dict(OPTIONS, compilation_cache_dir=compile_cache_dir)
    with pytest.raises(ConfigError, match="another tokenizer"):
        LLM(str(target), speculative_config={"method": "draft_model", "model": str(other_tokens)}, **options)
    import transformers

    config = transformers.LlamaConfig.from_pretrained(draft)
    config.vocab_size = 1000
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "smaller")
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(str(target), speculative_config={"method": "draft_model", "model": str(tmp_path / "smaller")}, **options)
    with pytest.raises(LoadError, match="no such file"):
        LLM(str(target), speculative_config={"method": "draft_model", "model": str(tmp_path / "nowhere")}, **options)
    with pytest.raises(ConfigError, match="not used by method 'ngram'"):
        LLM(str(target), speculative_config={"method": "ngram", "model": str(draft)}, **options)
