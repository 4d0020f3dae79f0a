"""The speculative config as vLLM takes it (a dict, or JSON from the environment and the command line), refused
with one clear line when it is wrong."""

import subprocess
import sys

import pytest

from jaxllm.config import ConfigError
from jaxllm.engine.config import EngineConfig
from jaxllm.speculative import SpeculativeConfig
from server.settings import ServerSettings


def test_a_dict_json_or_config_becomes_one_config():
    want = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_max=5, prompt_lookup_min=2)
    fields = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    assert EngineConfig(speculative_config=fields).speculative_config == want
    assert EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                           '"prompt_lookup_max": 5, "prompt_lookup_min": 2}').speculative_config == want
    assert EngineConfig(speculative_config=want).speculative_config is want
    assert EngineConfig().speculative_config is None and EngineConfig(speculative_config="").speculative_config is None
    env = {"JAXLLM_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
                                        '"prompt_lookup_min": 2}'}
    assert ServerSettings.from_env(env).engine.speculative_config == want


def test_the_batch_limit_is_a_number_none_or_auto():
    assert SpeculativeConfig("ngram").disable_by_batch_size == "auto"  # jaxllm's default: read from step times
    for value in (None, 1, 32, "auto"):
        assert SpeculativeConfig.parse({"method": "ngram", "disable_by_batch_size": value}).disable_by_batch_size \
            == value
    assert SpeculativeConfig.parse('{"method": "ngram", "disable_by_batch_size": null}').disable_by_batch_size is None


@pytest.mark.parametrize("value, message", [
    ({"method": "medusa"}, "unknown method 'medusa'; methods: draft_model, eagle3, ngram"),
    ({"method": "eagle3"}, "eagle3 needs a model: the head's folder or hub id"),
    ({"num_speculative_tokens": 2}, "a method is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 16], got 0"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max must be an integer >= "),
    ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
    ({"method": "ngram", "disable_by_batch_size": 0}, 'disable_by_batch_size must be an integer >= 1, "auto" or null'),
    ({"method": "ngram", "disable_by_batch_size": "never"}, "disable_by_batch_size must be an integer >= 1"),
    ({"method": "ngram", "disable_by_batch_size": True}, "disable_by_batch_size must be an integer >= 1"),
    ({"method": "ngram", "draft": "x"}, "unknown fields ['draft']"),
    ({"method": "ngram", "model": "x"}, "model and revision name a draft model: not used by method 'ngram'"),
    ({"method": "draft_model", "quantization": "q3"}, "quantization must be one of"),
    ("{not json", "not JSON"),
    ("[1, 2]", "expected an object of fields, got list"),
])
def test_bad_configs_are_refused_with_what_is_wrong(value, message):
    with pytest.raises(ConfigError) as e:
        EngineConfig(speculative_config=value)
    assert str(e.value).startswith("speculative_config: ") and message in str(e.value)
    assert "\n" not in str(e.value)


def test_the_serve_command_refuses_a_bad_config_in_one_line():
    run = subprocess.run([sys.executable, "-m", "jaxllm", "serve", "--speculative-config", '{"method": "eagle9"}'],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "jaxllm serve: error: speculative_config: unknown method 'eagle9'; methods: draft_model, eagle3, ngram"]
