"""A test-only model family, added as this one file plus one registry line (`registry.register(SPEC)`; the tests
that use it register it for their own duration): a Qwen2-shaped decoder whose MLP is GeGLU (tanh GELU) and whose
layers alternate between a sliding window and the whole context (the config's `layer_types`, as transformers'
Qwen2 reads it). Everything else (loading, fusions, the engine, the kernels) comes from the spec's defaults."""

from jaxllm.models.family import FamilySpec, llama_config

ARCHITECTURE = "JaxllmWindowedGeluForCausalLM"


def read_config(hf, spec):
    window = int(hf["sliding_window"])
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in hf["layer_types"])
    return llama_config(hf, spec, sliding_window=None, layer_windows=windows)


SPEC = FamilySpec(ARCHITECTURE, attention_bias_default=True, o_bias_follows_attention_bias=False,
                  config_reader=read_config)
