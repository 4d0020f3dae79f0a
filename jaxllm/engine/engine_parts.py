"""What an engine is made of, resolved in one place from its config (and a model passed in): the model and its
tokenizer, the tasks it serves, its request limits, the KV cache's plan, a vision-language model's encoder parts
and the executable cache. `LLMEngine` builds its core from these plain parts; nothing else decides them."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax

from jaxllm.config import ConfigError
from jaxllm.engine import multihost
from jaxllm.engine.config import EngineConfig
from jaxllm.engine.encoder_cache import EncoderCache
from jaxllm.engine.encoder_runner import EncoderRunner, default_encoder_buckets
from jaxllm.engine.executable_cache import ExecutableCache
from jaxllm.engine.kv_plan import KVPlan, plan_kv_cache
from jaxllm.loading import LoadedModel, load_model
from jaxllm.models.protocol import Model, MultimodalModel
from jaxllm.models.weight_layout import interleave_weights, wants_interleaved
from jaxllm.multimodal.image_processor import ImageProcessorConfig
from jaxllm.multimodal.inputs import MultiModalSpec
from jaxllm.pooling_params import CLASSIFY, EMBED, GENERATE, Pooling
from jaxllm.sampling_params import RequestLimits
from jaxllm.sharding import make_mesh
from jaxllm.speculative import SpeculativeConfig
from jaxllm.speculative.methods import MODEL_METHODS
from jaxllm.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("jaxllm.engine")


@dataclasses.dataclass
class EncoderParts:
    """A vision-language model's: what requests may send, the image encoder and the cache of its outputs."""
    spec: MultiModalSpec
    runner: EncoderRunner
    cache: EncoderCache


@dataclasses.dataclass
class EngineParts:
    model: Model
    tokenizer: Tokenizer | None
    mesh: jax.sharding.Mesh
    model_name: str  # as the API names it
    eos_token_ids: tuple[int, ...]
    tasks: tuple[str, ...]  # GENERATE / EMBED / CLASSIFY
    pooling: Pooling | None  # how embeddings are pooled (EMBED)
    limits: RequestLimits
    kv: KVPlan
    encoder: EncoderParts | None
    executable_cache: ExecutableCache | None
    load_s: float
    checkpoint_bytes_read: int
    speculative: SpeculativeConfig | None = None  # the method that proposes drafts (`jaxllm.speculative`)
    draft: Model | None = None  # its draft model (draft_model) or head (eagle3), on the target's mesh
    lora: bool = False  # the model has LoRA adapter tables (`jaxllm.models.lora`)
    features: tuple[int, ...] = ()  # the target layers whose inputs each step keeps for the draft (eagle3)


def enable_compilation_cache(path: str | None) -> None:
    """JAX's persistent compilation cache, for every compile (by default it skips ones under a second)."""
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def resolve_engine_parts(config: EngineConfig, *, model: Model | None = None, tokenizer: Tokenizer | None = None,
                         loaded: LoadedModel | None = None, warmup: bool = True) -> EngineParts:
    """Joins a multi-host job first (before any backend starts), then loads (unless a model or a load is given)."""
    multihost.initialize(config.num_hosts, config.host_rank, config.coordinator_address)
    # (Paths and names may differ between hosts; what shapes the compiled steps may not.)
    shared = dataclasses.replace(config, host_rank=0, model=None, compilation_cache_dir=None, served_model_name=None)
    multihost.check_same_everywhere("engine config", repr((shared, warmup, model is None)).encode())
    enable_compilation_cache(config.compilation_cache_dir)
    start = time.perf_counter()
    from_config = model is None and loaded is None  # the target is config.model (not passed in)
    executable_cache = _executable_cache(config) if from_config else None
    if from_config:
        loaded = load_model(config.model, dtype=config.dtype, tensor_parallel_size=config.tensor_parallel_size,
                            expert_parallel_size=config.expert_parallel_size,
                            enable_expert_parallel=config.enable_expert_parallel,
                            attn_impl=config.attn_impl, matmul_impl=config.matmul_impl,
                            kv_cache_dtype=config.kv_cache_dtype, quantization=config.quantization,
                            revision=config.revision, download_dir=config.download_dir)
    load_s = time.perf_counter() - start
    if loaded is not None:
        model, tokenizer, mesh, name = loaded.model, tokenizer or loaded.tokenizer, loaded.mesh, loaded.name
    else:
        mesh, name = make_mesh(config.tensor_parallel_size,
                               expert_parallel_size=config.expert_parallel_size), "custom-model"
    if from_config and wants_interleaved(model):
        interleave_weights(model)  # the CPU int8 kernel's layout (a model passed in, a caller's, keeps its own)
    if model.kernels.layer_loop == "unrolled":
        model.arrange_layers()  # separate layers on GPU, as loads are (a model passed in that a caller edits
        # as separate layers on CPU is left as it is)
    cfg = model.config
    if config.enable_lora:
        _enable_lora(config, model)
    eos = tuple(cfg.eos_token_ids) or (tokenizer.eos_token_ids if tokenizer else ())
    if config.classifier_tokens:
        model.set_classifier_tokens(_classifier_ids(model, tokenizer, config.classifier_tokens))
    tasks, pooling = _tasks(config, model, loaded, name)
    speculative = _speculative(config, model, tasks)
    draft = None
    if speculative is not None and speculative.method == "eagle3":
        draft = _eagle3_head(config, speculative, model, mesh)
    elif speculative is not None and speculative.method in MODEL_METHODS:
        draft = _draft_model(config, speculative, model, tokenizer, mesh, from_config)
    features = draft.eagle.aux_layers if speculative is not None and speculative.method == "eagle3" else ()
    kv = plan_kv_cache(config, model, draft, feature_size=len(features) * cfg.hidden_size)
    for m in [model] + ([draft] if draft is not None else []):
        if hasattr(m, "set_context_length"):
            m.set_context_length(kv.max_model_len)  # before any step is traced (LongRoPE's factor set)
    encoder = _encoder_parts(config, model, loaded) if model.multimodal else None
    limits = RequestLimits(vocab_size=cfg.vocab_size, max_model_len=kv.max_model_len, max_n=config.max_n,
                           hidden_size=cfg.hidden_size, tasks=tasks)
    return EngineParts(model, tokenizer, mesh, config.served_model_name or name, eos, tasks, pooling, limits, kv,
                       encoder, executable_cache, load_s, loaded.bytes_read if loaded is not None else 0,
                       speculative, draft, config.enable_lora, features)


def _enable_lora(config: EngineConfig, model: Model) -> None:
    from jaxllm.models import lora

    if model.multimodal or not model.causal or not hasattr(model, "unstack_layers"):
        raise ConfigError("enable_lora: LoRA adapters run on text decoder models (Llama-family layers)")
    lora.enable(model, config.max_loras, config.max_lora_rank, config.lora_dtype)
    if jax.default_backend() == "cpu":  # now, not when first traced: a step loaded from the executable cache is
        from pallas_kernels.lora_delta import cpu, cpu_fused  # never traced, and its custom calls need the targets

        cpu.register()
        if model.kernels.matmul == "cpu" and model.kernels.int8_isa is not None:
            cpu_fused.register_all(model.kernels.int8_isa)


def _speculative(config: EngineConfig, model: Model, tasks: tuple[str, ...]) -> SpeculativeConfig | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if GENERATE not in tasks:
        raise ConfigError("speculative_config: the model does not generate (speculation drafts generated tokens)")
    if model.multimodal:
        raise ConfigError("speculative_config: not supported for vision-language models (their M-RoPE positions "
                          "of drafted tokens are not built)")
    if config.num_hosts > 1:
        raise ConfigError("speculative_config: not supported across hosts yet")
    return spec


def _draft_model(config: EngineConfig, spec: SpeculativeConfig, model: Model, tokenizer: Tokenizer | None,
                 mesh: jax.sharding.Mesh, from_config: bool) -> Model:
    """The draft model, loaded as the target was (its dtype, kernels and mesh) from `spec.model` (default: the
    target's checkpoint, when the target was loaded from config.model) with `spec.quantization`; its vocabulary
    must be the target's, token for token."""
    if spec.model is None and not from_config:
        raise ConfigError("speculative_config: draft_model needs a model when the target was passed in")
    same = spec.model is None
    draft = load_model(config.model if same else spec.model, dtype=config.dtype, mesh=mesh,
                       attn_impl=config.attn_impl, matmul_impl=config.matmul_impl,
                       kv_cache_dtype=config.kv_cache_dtype, quantization=spec.quantization,
                       revision=config.revision if same else spec.revision, download_dir=config.download_dir)
    m = draft.model
    if not m.causal or m.multimodal or not hasattr(m, "forward_paged"):
        raise ConfigError(f"speculative_config: the draft model {draft.name} is not a text decoder")
    if m.config.vocab_size != model.config.vocab_size:
        raise ConfigError(f"speculative_config: the draft model's vocabulary ({m.config.vocab_size} tokens) is not "
                          f"the target's ({model.config.vocab_size})")
    if tokenizer is not None and draft.tokenizer is not None and \
            draft.tokenizer.backend.get_vocab() != tokenizer.backend.get_vocab():
        raise ConfigError(f"speculative_config: the draft model {draft.name} has another tokenizer than the target "
                          "(the same token ids must mean the same text)")
    if m.kernels.layer_loop == "unrolled":
        m.arrange_layers()
    logger.info("draft model %s loaded (quantization %s)", draft.name, spec.quantization)
    return m


def _eagle3_head(config: EngineConfig, spec: SpeculativeConfig, model: Model, mesh: jax.sharding.Mesh) -> Model:
    """The EAGLE-3 head `spec.model` for `model`, whose steps will keep the features it reads."""
    from jaxllm.models.llama import LlamaForCausalLM
    from jaxllm.speculative.eagle3_loading import load_eagle3_head

    if not isinstance(model, LlamaForCausalLM):
        raise ConfigError("speculative_config: eagle3 drafts for text decoders of the Llama-shaped families")
    head = load_eagle3_head(spec.model, model, mesh=mesh, revision=spec.revision, download_dir=config.download_dir)
    logger.info("EAGLE-3 head %s loaded (target layers %s)", spec.model, list(head.eagle.aux_layers))
    return head


def _executable_cache(config: EngineConfig) -> ExecutableCache | None:
    """Executables are cached only for models an engine loads itself (an edited model can differ in ways no cache
    key sees: see executable_cache), and not for multi-host jobs (an executable spanning processes is rebuilt,
    not deserialized)."""
    if not config.compilation_cache_dir or config.num_hosts != 1:
        return None
    try:
        return ExecutableCache(os.path.join(os.path.expanduser(config.compilation_cache_dir), "executables"))
    except OSError as e:
        logger.warning("executable cache off: %s", e)
        return None


def _tasks(config: EngineConfig, model: Model, loaded: LoadedModel | None,
           name: str) -> tuple[tuple[str, ...], Pooling | None]:
    """Embedding: with the pooling the config names, else the one a sentence-transformers folder declares (an
    encoder without either: its [CLS] token, normalized); classifying: with a cross-encoder's head or a reranker's
    label tokens."""
    classifies = model.classifies
    pooling = Pooling(config.pooling, config.normalize_embeddings) if config.pooling else \
        (loaded.pooling if loaded is not None else None)
    if pooling is None and not model.causal and not classifies:
        pooling = Pooling("cls", True)
    if pooling is None and config.runner == "pooling" and not classifies:
        pooling = Pooling("last", config.normalize_embeddings)  # vLLM's default for a causal model
    if config.runner == "generate" and not model.causal:
        raise ConfigError(f"runner='generate': {name} is an encoder, it cannot generate (runner='pooling')")
    tasks = ((GENERATE,) if model.causal else ()) + ((EMBED,) if pooling is not None else ()) + \
        ((CLASSIFY,) if classifies else ())
    return tasks, pooling


def _classifier_ids(model: Model, tokenizer: Tokenizer | None, tokens: tuple[str, ...]) -> tuple[int, ...]:
    if not model.causal or tokenizer is None:
        raise ConfigError("classifier_tokens: a decoder with a tokenizer reads its labels from token logits")
    ids = []
    for t in tokens:
        found = tokenizer.backend.token_to_id(t)
        encoded = tokenizer.encode(t, add_special_tokens=False)
        if found is None and len(encoded) != 1:
            raise ConfigError(f"classifier_tokens: {t!r} is not one token of this tokenizer ({encoded})")
        ids.append(found if found is not None else encoded[0])
    return tuple(ids)


def _encoder_parts(config: EngineConfig, model: MultimodalModel, loaded: LoadedModel | None) -> EncoderParts:
    c = config
    if c.num_hosts > 1:
        raise ConfigError("vision-language models run on one host")
    processor = (loaded.image_processor if loaded is not None else None) or ImageProcessorConfig()
    budget = c.encoder_budget or c.max_num_batched_tokens
    pixels = budget * processor.factor ** 2  # an image's tokens are its pixels / factor**2
    cap = min(pixels, c.mm_max_pixels or pixels)
    processor = dataclasses.replace(processor, max_pixels=min(processor.max_pixels, cap),
                                    min_pixels=min(processor.min_pixels, cap))
    vl = model.vl_config
    spec = MultiModalSpec(processor, vl.image_token_id, vl.vision_start_token_id, vl.vision_end_token_id,
                          max_images=c.limit_mm_per_prompt, max_image_tokens=budget)
    runner = EncoderRunner(model.visual, default_encoder_buckets(budget, min(64, budget)))
    return EncoderParts(spec, runner, EncoderCache(c.encoder_cache_tokens or 4 * budget))
