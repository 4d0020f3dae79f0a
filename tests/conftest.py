"""Shared fixtures. Four host devices are requested before JAX initialises so sharding tests can run;
every other test uses the first device only."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CPU quantized matmul's float path: tests that compare logits and greedy tokens with transformers check the
# model and its loading, not int8 activations, whose numbers differ by design (as llama.cpp's do). The integer
# paths have their own tests (tests/pallas_kernels/quantized_matmul/test_int8.py,
# tests/models/test_int8_activations.py), which name the path they run.
os.environ.setdefault("JAXLLM_CPU_INT8_ISA", "none")

import gc  # noqa: E402

import pytest  # noqa: E402

from tests.tiny_models import build_tiny_hf_model  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
    """After each test module, the executables nothing holds any more are freed. Every XLA:CPU executable maps its
    code and data (three mappings per object file), and JAX's caches keep every one they compiled: eager calls of
    a model (the parity tests) compile one per operation and shape (19,300 mappings after
    tests/models/test_hf_parity.py alone, 1,250 once cleared). A suite's worth passes the kernel's limit of 65,530
    mappings per process (`vm.max_map_count`), and the next compile dies inside XLA (an abort or a segmentation
    fault in the persistent cache's write of an executable, at ~80% of the suite). Engines hold their own
    executables: clearing the caches frees none of theirs."""
    yield
    import jax

    gc.collect()
    jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """case name -> folder with a tiny random HF model (config.json + safetensors)."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, object] = {}

    def get(case: str):
        if case not in cache:
            cache[case] = build_tiny_hf_model(case, root / case)
        return cache[case]

    return get


@pytest.fixture(scope="session")
def tiny_folder(tiny_model_dir, tmp_path_factory):
    """The tiny random Llama with a tiny BPE tokenizer and ChatML template: a server on it starts in seconds."""
    import shutil

    from tests.tiny_models import add_tiny_tokenizer

    folder, _ = tiny_model_dir("llama")
    with_tokenizer = tmp_path_factory.mktemp("tiny_llama_tokenizer") / "llama"
    shutil.copytree(folder, with_tokenizer)  # other tests use the tiny model without a tokenizer
    add_tiny_tokenizer(with_tokenizer)
    return with_tokenizer


@pytest.fixture(scope="session")
def tiny_embedding_dir(tmp_path_factory):
    """pooling ("last", "mean", "cls") -> a tiny random Qwen3 saved as a sentence-transformers model (its pooling
    config, a Normalize module, a tiny tokenizer with a pad token), like Qwen3-Embedding."""
    from tests.tiny_models import add_sentence_transformers_files, add_tiny_tokenizer

    cache: dict[str, object] = {}

    def get(pooling: str):
        if pooling not in cache:
            folder = tmp_path_factory.mktemp(f"tiny_embedding_{pooling}")
            build_tiny_hf_model("qwen3", folder)
            add_tiny_tokenizer(folder)
            add_sentence_transformers_files(folder, pooling)
            cache[pooling] = folder
        return cache[pooling]

    return get


@pytest.fixture(scope="session")
def tiny_encoder_dir(tmp_path_factory):
    """(family "bert" / "xlm-roberta", pooling "mean" / "cls" or "classifier") -> a tiny random encoder folder: a
    sentence-transformers embedding model, or a cross-encoder (a sequence-classification head, one label)."""
    from tests.tiny_models import add_sentence_transformers_files, build_tiny_encoder

    cache: dict[tuple[str, str], object] = {}

    def get(family: str, kind: str):
        if (family, kind) not in cache:
            folder = tmp_path_factory.mktemp(f"tiny_{family}_{kind}")
            build_tiny_encoder(folder, family, classifier=kind == "classifier")
            if kind != "classifier":
                add_sentence_transformers_files(folder, kind, pad_token="[PAD]" if family == "bert" else "<pad>")
            cache[family, kind] = folder
        return cache[family, kind]

    return get


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL folder with a tokenizer (image tokens 1000..1003, Qwen-VL's chat template) and a
    small preprocessor pixel budget, and the transformers model it was saved from: (folder, hf_model)."""
    from tests.tiny_models import build_tiny_qwen2_5_vl

    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_vl"))


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(tmp_path_factory):
    """As `tiny_vl_dir`, a tiny random Qwen3-VL (interleaved M-RoPE, DeepStack)."""
    from tests.tiny_models import build_tiny_qwen2_5_vl

    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_qwen3_vl"), family="qwen3_vl")


@pytest.fixture(scope="session")
def smollm2_path():
    from jaxllm.loading.embedded import embedded_model_path

    return embedded_model_path()



@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory):
    """One JAX persistent compilation cache for the session: engines with equal shapes compile once."""
    return str(tmp_path_factory.mktemp("xla_cache"))


# One engine configuration for the in-process engine tests and the test server (tests/server/conftest.py):
# equal shapes, so the buckets compiled once load from the session's persistent cache afterwards.
# Float weights (quantization="none") and a float32 KV cache (the server's preset narrows it): the transformers
# parity tests compare with the dequantized model.
ENGINE_OPTIONS = dict(dtype="float32", quantization="none", kv_cache_dtype="float32", attn_impl="reference",
                      max_num_seqs=64, max_num_batched_tokens=128, num_pages=768, max_model_len=1024)


@pytest.fixture(scope="session")
def smollm2_llm(compile_cache_dir):
    """One engine on the embedded SmolLM2 for the whole session (float32, 8 buckets up to 128 tokens)."""
    from jaxllm import LLM

    return LLM(compilation_cache_dir=compile_cache_dir, **ENGINE_OPTIONS)


@pytest.fixture(scope="session")
def smollm2_llm_default_kernels(compile_cache_dir):
    """The same engine with the default kernel choice (auto: the CPU attention and matmul kernels here), which
    is what users run."""
    from jaxllm import LLM

    return LLM(compilation_cache_dir=compile_cache_dir, **{**ENGINE_OPTIONS, "attn_impl": "auto"})


@pytest.fixture(params=["reference", "auto"])
def any_smollm2_llm(request):
    """Runs a test on both kernel choices."""
    name = "smollm2_llm" if request.param == "reference" else "smollm2_llm_default_kernels"
    return request.getfixturevalue(name)


@pytest.fixture(scope="session")
def smollm2_quantized_llm(compile_cache_dir):
    """The same engine serving the embedded GGUF as it ships (Q4_1 layers, Q8_0 embedding), default kernels."""
    from jaxllm import LLM

    return LLM(compilation_cache_dir=compile_cache_dir, **{**ENGINE_OPTIONS, "attn_impl": "auto",
                                                          "quantization": "auto"})
