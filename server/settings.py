"""Server settings from the environment (gunicorn passes host/port itself):

JAXLLM_PRESET (engine preset in jaxllm/configs/ or TOML path; default: smollm2-cpu for the embedded model,
the platform's for others: cpu, gpu, tpu), JAXLLM_MODEL (a folder, a GGUF
file, or a hub id org/name or org/name:QUANT), JAXLLM_REVISION, JAXLLM_DOWNLOAD_DIR (hub ids; HF_HOME, HF_HUB_CACHE,
HF_HUB_OFFLINE, HF_TOKEN, HF_ENDPOINT as huggingface_hub reads them),
JAXLLM_SERVED_MODEL_NAME, JAXLLM_API_KEY, JAXLLM_MAX_MODEL_LEN, JAXLLM_NUM_PAGES, JAXLLM_KV_MEMORY_FRACTION,
JAXLLM_KV_CACHE_DTYPE, JAXLLM_TENSOR_PARALLEL_SIZE, JAXLLM_EXPERT_PARALLEL_SIZE, JAXLLM_MAX_NUM_SEQS,
JAXLLM_MAX_NUM_BATCHED_TOKENS, JAXLLM_MAX_WAITING_REQUESTS, JAXLLM_COMPILATION_CACHE_DIR, JAXLLM_DTYPE,
JAXLLM_ATTN_IMPL, JAXLLM_MATMUL_IMPL,
JAXLLM_QUANTIZATION (auto: a GGUF file's own; int8; none), JAXLLM_ASYNC_SCHEDULING (default true),
JAXLLM_NUM_HOSTS, JAXLLM_HOST_RANK, JAXLLM_COORDINATOR_ADDRESS (multi-host: one model over several hosts),
JAXLLM_MAX_BODY_BYTES (default 10 MiB), JAXLLM_DRAIN_TIMEOUT (seconds, default 30), JAXLLM_MAX_N
(most choices per request, default 16), JAXLLM_ALLOWED_ORIGINS (comma-separated origins allowed by CORS, or *;
default: CORS off), JAXLLM_CHAT_TEMPLATE (a jinja chat template file replacing the model's, as vLLM's
--chat-template), JAXLLM_TOOL_CALL_PARSER (hermes, llama3_json, mistral; default: from the chat template),
JAXLLM_REASONING_PARSER (qwen3, deepseek_r1: <think> blocks go to reasoning_content; default: off).
LoRA adapters (vLLM's --lora-modules; see server/lora_modules.py): JAXLLM_LORA_MODULES ("name=path,name2=path2" or
vLLM's JSON objects), JAXLLM_ENABLE_LORA (implied by modules or runtime updating), JAXLLM_MAX_LORAS,
JAXLLM_MAX_LORA_RANK, JAXLLM_MAX_CPU_LORAS, JAXLLM_ALLOW_RUNTIME_LORA_UPDATING (default false: POST
/v1/load_lora_adapter and /v1/unload_lora_adapter answer 400), JAXLLM_LORA_ROOTS (comma-separated folders that runtime
loads must lie in; empty: any).
Vision-language models: JAXLLM_LIMIT_MM_PER_PROMPT (images per prompt, default 4), JAXLLM_ENCODER_BUDGET (image tokens
encoded per step, default max_num_batched_tokens), JAXLLM_ENCODER_CACHE_TOKENS, JAXLLM_MM_MAX_PIXELS;
JAXLLM_ALLOW_REMOTE_IMAGES (fetch http(s) image_url at all; default false: data: URLs only),
JAXLLM_ALLOWED_MEDIA_DOMAINS (comma-separated hosts, subdomains included, that remote images may come from; empty:
any), JAXLLM_MAX_IMAGE_BYTES (default 20 MiB), JAXLLM_MAX_IMAGE_PIXELS (decoded size, default 8192 x 8192),
JAXLLM_IMAGE_FETCH_TIMEOUT (seconds, default 10).
TLS is gunicorn's (gunicorn.conf.py): JAXLLM_SSL_CERTFILE and JAXLLM_SSL_KEYFILE.
Serve modes (see README): JAXLLM_ENGINE_ADDRESS (a ZeroMQ address, e.g. tcp://10.0.0.5:5555 or ipc:///run/core:
use the engine-core process there instead of an engine in this process) with JAXLLM_ENGINE_SECRET (the secret
shared with it; comma-separated addresses: one engine core per data-parallel rank); in gunicorn.conf.py,
JAXLLM_API_SERVERS (N API worker processes sharing engine-core processes) and JAXLLM_DATA_PARALLEL_SIZE (D of them).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from jaxllm.engine.config import EngineConfig, default_preset
from jaxllm.environment import Environment
from jaxllm.multimodal.image_input import ImagePolicy
from jaxllm.reasoning import REASONING_PARSERS
from jaxllm.tools.parsers import TOOL_PARSERS
from server.lora_modules import LoRAModule, parse_lora_modules


def _flag(value: str) -> bool:
    if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(f"expected true or false, got {value!r}")
    return value.lower() in ("1", "true", "yes")


_ENGINE_ENV = {
    "model": str, "revision": str, "download_dir": str,
    "served_model_name": str, "max_model_len": int, "num_pages": int, "kv_memory_fraction": float,
    "kv_cache_dtype": str, "tensor_parallel_size": int, "expert_parallel_size": int, "max_num_seqs": int,
    "max_num_batched_tokens": int, "max_waiting_requests": int,
    "compilation_cache_dir": str, "dtype": str, "attn_impl": str, "matmul_impl": str, "max_n": int,
    "quantization": str, "num_hosts": int, "host_rank": int, "coordinator_address": str,
    "runner": str, "pooling": str, "normalize_embeddings": _flag, "score_template": str,
    "classifier_tokens": lambda v: tuple(t for t in v.split(",") if t),
    "async_scheduling": _flag, "enable_prefix_caching": _flag, "seed": int, "page_size": int,
    "limit_mm_per_prompt": int, "encoder_budget": int, "encoder_cache_tokens": int, "mm_max_pixels": int,
    "speculative_config": str, "enable_lora": _flag, "max_loras": int, "max_lora_rank": int, "max_cpu_loras": int,
    "lora_dtype": str, "enable_expert_parallel": _flag,
}


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    engine: EngineConfig
    api_key: str | None = None
    max_body_bytes: int = 10 * 2**20
    drain_timeout_s: float = 30.0
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: off
    chat_template: str | None = None  # a template's source, replacing the model's
    tool_call_parser: str | None = None  # None: chosen from the chat template
    reasoning_parser: str | None = None  # None: no reasoning_content
    engine_address: str | None = None  # an engine-core process to use; None: the engine runs in this process
    engine_secret: str | None = None  # shared with that engine core
    startup_timeout_s: float = 600.0  # how long to wait for the engine core's handshake
    image_policy: ImagePolicy = ImagePolicy()  # which image_url parts are loaded, and their limits
    lora_modules: tuple[LoRAModule, ...] = ()  # adapters served by name from the start
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_roots: tuple[str, ...] = ()  # folders runtime loads must lie in (empty: any)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ServerSettings:
        env = dict(os.environ if env is None else env)
        process = Environment.read(env)  # the process settings: `jaxllm.environment`
        overrides = {}
        for name, kind in _ENGINE_ENV.items():
            value = env.get(f"JAXLLM_{name.upper()}")
            if value not in (None, ""):
                overrides[name] = kind(value)
        modules = parse_lora_modules(env.get("JAXLLM_LORA_MODULES", ""))
        runtime_lora = _flag(env.get("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING", "false"))
        if modules or runtime_lora:
            if overrides.get("enable_lora") is False:
                raise ValueError("JAXLLM_ENABLE_LORA=false, but LoRA modules or runtime LoRA updating are set")
            overrides["enable_lora"] = True
        if runtime_lora and process.api_servers > 1:
            raise ValueError("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING needs one API server (JAXLLM_API_SERVERS=1): each "
                             "server keeps its own list of adapters")
        preset = env.get("JAXLLM_PRESET") or default_preset(overrides.get("model"))
        engine = EngineConfig.from_preset(preset, **overrides)
        template_path = env.get("JAXLLM_CHAT_TEMPLATE") or None
        parser = env.get("JAXLLM_TOOL_CALL_PARSER") or None
        if parser is not None and parser not in TOOL_PARSERS:
            raise ValueError(f"JAXLLM_TOOL_CALL_PARSER={parser!r}: known parsers are {sorted(TOOL_PARSERS)}")
        reasoning = env.get("JAXLLM_REASONING_PARSER") or None
        if reasoning is not None and reasoning not in REASONING_PARSERS:
            raise ValueError(f"JAXLLM_REASONING_PARSER={reasoning!r}: known parsers are {sorted(REASONING_PARSERS)}")
        return cls(engine=engine, api_key=env.get("JAXLLM_API_KEY") or None,
                   max_body_bytes=int(env.get("JAXLLM_MAX_BODY_BYTES", 10 * 2**20)),
                   drain_timeout_s=process.drain_timeout_s,
                   allowed_origins=tuple(o.strip() for o in env.get("JAXLLM_ALLOWED_ORIGINS", "").split(",")
                                         if o.strip()),
                   chat_template=Path(template_path).read_text() if template_path else None,
                   tool_call_parser=parser, reasoning_parser=reasoning,
                   engine_address=process.engine_address, engine_secret=process.engine_secret,
                   startup_timeout_s=float(process.worker_timeout_s),
                   image_policy=_image_policy(env), lora_modules=modules,
                   allow_runtime_lora_updating=runtime_lora,
                   lora_roots=tuple(r.strip() for r in env.get("JAXLLM_LORA_ROOTS", "").split(",") if r.strip()))


def _image_policy(env: dict[str, str]) -> ImagePolicy:
    default = ImagePolicy()
    hosts = env.get("JAXLLM_ALLOWED_MEDIA_DOMAINS", "")
    return ImagePolicy(max_bytes=int(env.get("JAXLLM_MAX_IMAGE_BYTES", default.max_bytes)),
                       max_pixels=int(env.get("JAXLLM_MAX_IMAGE_PIXELS", default.max_pixels)),
                       allow_remote=_flag(env.get("JAXLLM_ALLOW_REMOTE_IMAGES", "false")),
                       allowed_hosts=tuple(h.strip().lower() for h in hosts.split(",") if h.strip()),
                       timeout_s=float(env.get("JAXLLM_IMAGE_FETCH_TIMEOUT", default.timeout_s)))
