"""The benchmark's requests: random prompts of the asked token counts (by the model's own tokenizer), within the
range ratio, distinct after a shared prefix, reproducible by seed; custom JSONL prompts and their errors."""

import json

import pytest

from jaxllm.bench.datasets import SampleRequest, custom_requests, random_requests
from jaxllm.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)  # the embedded SmolLM2's (a real BPE with merges and special tokens)


def test_random_prompts_have_the_asked_lengths(tokenizer):
    reqs = random_requests(tokenizer, 24, input_len=64, output_len=32, seed=1)
    assert len(reqs) == 24
    assert all(r.expected_output_len == 32 for r in reqs)
    for r in reqs:  # the length reported is the re-encoded one, and re-encoding lands on the target
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
    assert sum(r.prompt_len == 64 for r in reqs) >= 22, [r.prompt_len for r in reqs]
    assert all(60 <= r.prompt_len <= 68 for r in reqs)
    assert len({r.prompt for r in reqs}) == 24
    specials = [tokenizer.id_to_token(i) for i in tokenizer.backend.get_added_tokens_decoder()]
    assert not any(s in r.prompt for r in reqs for s in specials if s)


def test_range_ratio_prefix_and_seed(tokenizer):
    reqs = random_requests(tokenizer, 40, input_len=40, output_len=20, range_ratio=0.5, prefix_len=16, seed=3)
    outs = {r.expected_output_len for r in reqs}
    assert min(outs) >= 10 and max(outs) <= 30 and len(outs) > 5
    assert max(r.prompt_len for r in reqs) - min(r.prompt_len for r in reqs) > 10
    heads = {tuple(tokenizer.encode(r.prompt, add_special_tokens=False)[:12]) for r in reqs}
    assert len(heads) == 1  # the shared prefix (a few tokens of slack where its end merges with what follows)
    again = random_requests(tokenizer, 40, input_len=40, output_len=20, range_ratio=0.5, prefix_len=16, seed=3)
    other = random_requests(tokenizer, 40, input_len=40, output_len=20, range_ratio=0.5, prefix_len=16, seed=4)
    assert again == reqs
    assert not {r.prompt for r in other} & {r.prompt for r in reqs}


@pytest.mark.parametrize("kwargs", [dict(range_ratio=1.0), dict(range_ratio=-0.1), dict(input_len=0),
                                    dict(output_len=0), dict(prefix_len=-1)])
def test_random_rejects_bad_values(tokenizer, kwargs):
    with pytest.raises(ValueError):
        random_requests(tokenizer, 2, **{"input_len": 8, "output_len": 8, **kwargs})


def test_custom_jsonl(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Hello there", "", "A longer prompt, I say"]) +
                    "\n\n" + json.dumps({"prompt": "fourth"}) + "\n")
    reqs = custom_requests(path, tokenizer, 3, output_len=16)
    assert [r.prompt for r in reqs] == ["Hello there", "", "A longer prompt, I say"]
    assert reqs[0] == SampleRequest("Hello there", len(tokenizer.encode("Hello there", add_special_tokens=False)), 16)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object with a \"prompt\""):
        custom_requests(bad, tokenizer, 5, output_len=4)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        custom_requests(empty, tokenizer, 5, output_len=4)
