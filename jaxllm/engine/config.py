"""Engine configuration: a frozen dataclass that validates itself, loadable from a TOML preset in
`jaxllm/configs/` (package data, so a wheel carries them) and overridable by keyword (CLI flags, environment
variables)."""

from __future__ import annotations

import dataclasses
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from jaxllm.config import ConfigError
from jaxllm.dtypes import KV_CACHE_DTYPES, LORA_DTYPES
from jaxllm.loading.quantize import QUANTIZATIONS
from jaxllm.pooling_params import POOLING_METHODS
from jaxllm.speculative.config import SpeculativeConfig

RUNNERS = ("auto", "generate", "pooling")


def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files("jaxllm.configs").iterdir()
                  if p.name.endswith(".toml"))


def default_preset(model: object | None, platform: str | None = None) -> str:
    """The preset an entry point (`LLM`, the server, `jaxllm generate`) starts a model from when none is named,
    the same for all of them: the embedded model's own (`model` None), else its platform's (default: jax's
    backend)."""
    if model is None:
        from jaxllm.loading.embedded import EMBEDDED_PRESET
        return EMBEDDED_PRESET
    from jaxllm.kernels import normalize_platform
    try:  # the presets are named after the platforms (cpu, gpu, tpu)
        return normalize_platform(platform or _platform())
    except ValueError:  # a platform without a preset of its own
        return "cpu"


def _platform() -> str:
    """The platform JAX will run on, without starting its backend (a server's master process forks workers after
    reading its settings, and a multi-host engine must call `jax.distributed.initialize` first): JAX_PLATFORMS'
    first entry, else the accelerator plugin installed, else cpu."""
    import importlib.util

    import jax
    named = (jax.config.jax_platforms or "").split(",")[0].strip()
    if named:
        return named
    if any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin")):
        return "gpu"
    return "tpu" if importlib.util.find_spec("libtpu") else "cpu"


def read_preset(name_or_path: str) -> tuple[str, str]:
    """(where it came from, TOML text) of a preset by name (e.g. "smollm2-cpu") or of a TOML file path."""
    path = Path(name_or_path)
    if path.is_file():
        return str(path), path.read_text()
    preset = resources.files("jaxllm.configs").joinpath(f"{name_or_path}.toml")
    if not preset.is_file():
        raise ConfigError(f"no engine preset {name_or_path!r}; presets: {', '.join(preset_names())}")
    return f"preset {name_or_path}", preset.read_text()


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder, GGUF file, orbax checkpoint, hub id (org/name[:QUANT]); None: embedded
    revision: str | None = None  # of a hub id: a branch, tag or commit (default: main)
    download_dir: str | None = None  # the Hugging Face cache for hub ids (default: huggingface_hub's, HF_HUB_CACHE)
    served_model_name: str | None = None
    dtype: str = "auto"
    tensor_parallel_size: int = 1  # may span hosts (num_hosts > 1): the mesh holds every host's devices
    # A mixture of experts' experts split over this many groups of tensor_parallel_size devices (the rest of the
    # model the same on every group): tensor_parallel_size x expert_parallel_size devices in all
    expert_parallel_size: int = 1
    # vLLM's --enable-expert-parallel: whole experts split over the tensor-parallel devices themselves (and over
    # the expert_parallel_size groups), attention still split by heads (`jaxllm.sharding`)
    enable_expert_parallel: bool = False
    # Multi-host (one model over several hosts' devices; see jaxllm.engine.multihost): every host runs with the same
    # config except host_rank; rank 0 schedules and serves, the others follow its steps.
    num_hosts: int = 1
    host_rank: int = 0
    coordinator_address: str | None = None  # rank 0's host:port for jax.distributed (port + 1: the step channel)
    attn_impl: str = "auto"
    matmul_impl: str = "auto"
    # auto (a GGUF file's own quantization; other checkpoints as stored), gguf, int8 (made at load), none (float)
    quantization: str = "auto"
    # KV cache
    kv_cache_dtype: str = "auto"  # the model's dtype, or bfloat16, float16, float32, float8_e4m3fn, float8_e5m2
    page_size: int = 16
    num_pages: int | None = None  # explicit page count; else sized from kv_memory_fraction
    kv_memory_fraction: float = 0.2  # of total host RAM (CPU) or of device memory left after weights
    max_model_len: int | None = None  # default: the model's context length, capped by the KV cache
    # Scheduling
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # token budget of one step
    token_buckets: tuple[int, ...] | None = None  # default: powers of two up to max_num_batched_tokens
    enable_prefix_caching: bool = True
    max_waiting_requests: int = 1024
    max_n: int = 16  # most choices (n) one request may ask for
    # Decode steps run one ahead: the next step is dispatched before this one's tokens are read back, so the host's
    # per-step work (outputs, stop checks, the next step's inputs) overlaps the device's (see LLMEngine.step).
    async_scheduling: bool = True
    # Speculative decoding (`jaxllm.speculative`): a SpeculativeConfig, a dict of its fields as vLLM takes it
    # ({"method": "ngram", "num_speculative_tokens": 4}), or their JSON; None: off.
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters (vLLM's names): requests name one with a LoRARequest; at most max_loras distinct adapters run in
    # a step (more wait), each of rank max_lora_rank or less; max_cpu_loras kept loaded on the host (default
    # max_loras). lora_dtype: the adapter tables' dtype; "auto": the model's, and bfloat16 in a layer whose weight
    # is kept quantized (`jaxllm.models.lora.table_dtype`)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    # vLLM's runner: "pooling" makes a causal model embed (last-token pooling unless `pooling` or its folder says
    # otherwise) as well as generate; "generate" refuses a model that cannot; "auto": what the model does.
    runner: str = "auto"
    # Embeddings: how hidden states are pooled (last, mean, cls); None: as a sentence-transformers folder says
    # (modules.json), else the model does not embed. normalize_embeddings: the default of a request's `normalize`.
    pooling: str | None = None
    normalize_embeddings: bool = True
    # A decoder as a reranker (Qwen3-Reranker): the tokens whose last-token logits are its labels' scores, e.g.
    # ("no", "yes"), and the text a (query, document) pair becomes, with "{query}" and "{document}" in it.
    classifier_tokens: tuple[str, ...] | None = None
    score_template: str | None = None
    # Vision-language models: images per prompt at most (vLLM's limit_mm_per_prompt for images); image tokens the
    # encoder runs per step (default: max_num_batched_tokens), which is also the most one image may take (the
    # preprocessor's pixel budget is lowered to fit); the encoder cache's capacity in image tokens (default: 4x
    # the encoder budget); an upper bound on the preprocessor's max_pixels.
    limit_mm_per_prompt: int = 4
    encoder_budget: int | None = None
    encoder_cache_tokens: int | None = None
    mm_max_pixels: int | None = None
    # Compilation
    compilation_cache_dir: str | None = "~/.cache/jaxllm/xla"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.token_buckets is not None:
            object.__setattr__(self, "token_buckets", tuple(sorted(set(self.token_buckets))))
        if self.classifier_tokens is not None:
            object.__setattr__(self, "classifier_tokens", tuple(self.classifier_tokens))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        checks = [
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (self.expert_parallel_size >= 1, "expert_parallel_size must be >= 1"),
            (self.num_hosts >= 1, "num_hosts must be >= 1"),
            (0 <= self.host_rank < self.num_hosts, "host_rank must be in [0, num_hosts)"),
            (self.num_hosts == 1 or bool(self.coordinator_address),
             "num_hosts > 1 needs coordinator_address (rank 0's host:port)"),
            (self.quantization in QUANTIZATIONS, f"quantization must be one of {', '.join(QUANTIZATIONS)}"),
            (self.kv_cache_dtype in ("auto", *KV_CACHE_DTYPES),
             f"kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_DTYPES)}"),
            (self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0, "page_size must be a power of two"),
            (self.num_pages is None or self.num_pages >= 2, "num_pages must be >= 2"),
            (0 < self.kv_memory_fraction < 1, "kv_memory_fraction must be in (0, 1)"),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= self.max_num_seqs,
             "max_num_batched_tokens must be >= max_num_seqs (every running sequence decodes each step)"),
            (self.token_buckets is None or self.token_buckets[-1] >= self.max_num_batched_tokens,
             "the largest token bucket must hold max_num_batched_tokens"),
            (self.max_waiting_requests >= 1, "max_waiting_requests must be >= 1"),
            (self.max_n >= 1, "max_n must be >= 1"),
            (self.max_loras >= 1, "max_loras must be >= 1"),
            (self.max_lora_rank >= 1, "max_lora_rank must be >= 1"),
            (self.lora_dtype in ("auto", *LORA_DTYPES), f"lora_dtype must be auto or one of {', '.join(LORA_DTYPES)}"),
            (self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
             "max_cpu_loras must be >= max_loras"),
            (not self.enable_lora or self.expert_parallel_size == 1,
             "LoRA adapters do not run with expert parallelism (expert_parallel_size 1)"),
            (self.runner in RUNNERS, f"runner must be one of {', '.join(RUNNERS)}"),
            (self.pooling in (None, *POOLING_METHODS), f"pooling must be one of {', '.join(POOLING_METHODS)}"),
            (self.classifier_tokens is None or len(self.classifier_tokens) >= 1, "classifier_tokens must not be empty"),
            (self.limit_mm_per_prompt >= 0, "limit_mm_per_prompt must be >= 0"),
            (self.encoder_budget is None or self.encoder_budget >= 1, "encoder_budget must be >= 1"),
            (self.encoder_cache_tokens is None or self.encoder_cache_tokens >= (self.encoder_budget or 1),
             "encoder_cache_tokens must hold at least one step's encoder budget"),
            (self.mm_max_pixels is None or self.mm_max_pixels >= 1, "mm_max_pixels must be >= 1"),
            (self.score_template is None or "{query}" in self.score_template and "{document}" in self.score_template,
             "score_template must contain {query} and {document}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"engine config: {message}")

    def buckets(self) -> list[tuple[int, int]]:
        """(tokens, sequences) shapes compiled at start-up: every step is padded up to one of them."""
        budget = self.max_num_batched_tokens
        if self.token_buckets:  # up to the first that holds the budget: a step never fills those above it
            tokens = tuple(t for t in self.token_buckets if t < budget) + (
                next(t for t in self.token_buckets if t >= budget),)
        else:
            tokens = tuple(1 << i for i in range(budget.bit_length()) if 1 << i < budget) + (budget,)
        return [(t, min(t, self.max_num_seqs)) for t in tokens]

    @classmethod
    def from_preset(cls, name_or_path: str, **overrides: Any) -> EngineConfig:
        """A preset from jaxllm/configs/ (by name, e.g. "smollm2-cpu") or a TOML file path, then overrides."""
        source, text = read_preset(name_or_path)
        raw = tomllib.loads(text).get("engine", {})
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - fields
        if unknown:
            raise ConfigError(f"{source}: unknown engine options {sorted(unknown)}")
        if "token_buckets" in raw:
            raw["token_buckets"] = tuple(raw["token_buckets"])
        return cls(**{**raw, **{k: v for k, v in overrides.items() if v is not None}})
