"""Speculative decoding behind the API, with two API workers sharing an engine-core process (the engine's counters
cross ZeroMQ as they do in every serve mode): a streamed answer equals the same request answered whole, vLLM's
spec-decode counters reach /metrics, and every page is free afterwards."""

import json
import time

import pytest
import requests

from tests.engine.test_speculative import OPTIONS, SPEC
from tests.server.conftest import API_KEY, Server

pytestmark = pytest.mark.slow  # a server of its own (~1 min)


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory, compile_cache_dir):
    env = {f"JAXLLM_{k.upper()}": str(v) for k, v in OPTIONS.items()}
    env |= {"JAXLLM_SPECULATIVE_CONFIG": json.dumps(SPEC), "JAXLLM_API_KEY": API_KEY, "JAXLLM_API_SERVERS": "2",
            "JAXLLM_COMPILATION_CACHE_DIR": compile_cache_dir}
    srv = Server({}, tmp_path_factory.mktemp("spec_server") / "server.log", engine_env=env)
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


def test_streamed_and_whole_answers_agree_and_counters_reach_metrics(spec_server):
    import openai

    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    sentence = "The river carries the boats to the sea."
    messages = [{"role": "system", "content": "You repeat text exactly."},
                {"role": "user", "content": f"Repeat this sentence three times: {sentence}"}]
    ask = dict(model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=64)
    whole = client.chat.completions.create(**ask)
    chunks = client.chat.completions.create(**ask, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and sentence in streamed
    idle, _, m = spec_server.wait_idle(time.monotonic(), 30)
    assert idle  # every page free
    assert m["jaxllm_spec_decode_num_drafts_total"] > 0
    assert m["jaxllm_spec_decode_num_draft_tokens_total"] >= m["jaxllm_spec_decode_num_accepted_tokens_total"] > 0
    text = requests.get(spec_server.url + "/metrics", timeout=5).text
    per_pos = {line.split('position="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("jaxllm_spec_decode_num_accepted_tokens_per_pos_total{")}
    assert sorted(per_pos) == ["0", "1", "2", "3"]
    assert sum(per_pos.values()) == m["jaxllm_spec_decode_num_accepted_tokens_total"]
    # steps dispatched on a guess (too short an answer here to be guessed on: tests/engine/test_speculative.py)
    assert m["jaxllm_spec_decode_num_guessed_steps_total"] >= m["jaxllm_spec_decode_num_guessed_steps_held_total"] >= 0


def test_a_draft_model_drafts_in_the_engine_core_process(tiny_folder, tmp_path, compile_cache_dir):
    """draft_model through JAXLLM_SPECULATIVE_CONFIG in the engine-core serve mode (the draft loaded by the core):
    the server's greedy completion is the plain offline engine's, and drafts were kept."""
    import transformers

    from jaxllm import LLM, SamplingParams
    from tests.speculative.test_draft_model import OPTIONS as DRAFT_OPTIONS
    from tests.speculative.test_draft_model import one_layer_draft

    draft = one_layer_draft(transformers.LlamaForCausalLM.from_pretrained(tiny_folder), tmp_path / "draft")
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "disable_by_batch_size": None}
    options = {k: v for k, v in DRAFT_OPTIONS.items() if k != "token_buckets"}
    env = {f"JAXLLM_{k.upper()}": str(v) for k, v in options.items()} | {
        "JAXLLM_MODEL": str(tiny_folder), "JAXLLM_SPECULATIVE_CONFIG": json.dumps(spec),
        "JAXLLM_API_KEY": API_KEY, "JAXLLM_API_SERVERS": "2", "JAXLLM_COMPILATION_CACHE_DIR": compile_cache_dir}
    srv = Server({}, tmp_path / "server.log", engine_env=env)
    try:
        prompt = "The quick brown fox jumps over the lazy dog. Count slowly: one, two, three"
        got = requests.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                            json={"model": "llama", "prompt": prompt, "max_tokens": 40, "temperature": 0,
                                  "ignore_eos": True}).json()
        plain = LLM(str(tiny_folder), compilation_cache_dir=compile_cache_dir, **options)
        want = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
        assert got["choices"][0]["text"] == want
        idle, _, m = srv.wait_idle(time.monotonic(), 30)
        assert idle and m["jaxllm_spec_decode_num_accepted_tokens_total"] > 0
    finally:
        assert srv.stop() == 0, srv.log.read_text()[-3000:]
