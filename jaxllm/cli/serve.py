"""``jaxllm serve MODEL [flags]``: the OpenAI-compatible server, as ``vllm serve`` starts it.

Every flag has vLLM's name and maps onto one of the server's settings (the ``JAXLLM_*`` variable it would
otherwise be read from: a flag wins over the variable; ``--config FILE.yaml`` holds flags by their long names,
and the command line wins over it). Then, as ``gunicorn server.app:app`` does, it runs gunicorn (in this process,
through gunicorn's `BaseApplication`) with the hooks and settings of `server.gunicorn_config`: one server, two
front doors. ``--headless`` runs engine cores alone (`server.engine_core`), for API servers started elsewhere with
``--data-parallel-address``.

Before anything starts, the settings are checked and the model resolved (a hub id is fetched into the Hugging Face
cache here, once): a bad value or an unreachable model is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("jaxllm.serve")

GROUPS = {
    "model": "model: what to load, and how",
    "engine": "engine: KV cache and scheduling",
    "lora": "LoRA adapters (runtime loading: JAXLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
    "parallel": "parallelism",
    "modes": "serve modes: several API servers, headless engine cores",
    "frontend": "frontend: the HTTP server and the OpenAI API",
}


def _json_or(kind: Callable[[str], Any], key: str | None = None) -> Callable[[str], Any]:
    """Parses vLLM's JSON form of a flag's value ('{"image": 4}', '["*"]') or the plain one."""
    def parse(text: str):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return kind(text)
        if key is not None and isinstance(value, dict):
            if set(value) - {key}:
                raise argparse.ArgumentTypeError(f"only {key!r} is supported, got {sorted(value)}")
            return kind(str(value.get(key, 0)))
        return value
    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def _origins(value) -> str:
    return ",".join(value) if isinstance(value, list) else str(value)


def _bool(value) -> str:
    return "true" if value else "false"


def _lora_modules(values) -> str:
    """--lora-modules' values (name=path, or vLLM's JSON objects; a config file's list) as JAXLLM_LORA_MODULES."""
    items = values if isinstance(values, list) else [values]
    if any(isinstance(v, dict) or str(v).lstrip().startswith("{") for v in items):
        return json.dumps([v if isinstance(v, dict) else json.loads(v) if str(v).lstrip().startswith("{")
                           else dict(zip(("name", "path"), str(v).split("=", 1), strict=False)) for v in items])
    return ",".join(str(v) for v in items)


@dataclasses.dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    env: str | None  # the JAXLLM_* variable it sets (None: handled by `run` itself)
    group: str
    help: str
    kind: Callable[[str], Any] | None = str  # None: a switch (--x / --no-x)
    to_env: Callable[[Any], str] = str
    choices: tuple[str, ...] | None = None
    nargs: str | None = None  # "+": one or more values

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


FLAGS = [
    Flag(("--model",), "JAXLLM_MODEL", "model", "the model (also the positional MODEL): a folder, a GGUF file, a "
         "Hugging Face hub id org/name, or org/name:QUANT for that GGUF file of a repository"),
    Flag(("--revision",), "JAXLLM_REVISION", "model", "a hub id's branch, tag or commit (default: main)"),
    Flag(("--download-dir",), "JAXLLM_DOWNLOAD_DIR", "model", "Hugging Face cache for hub ids (default: HF_HUB_CACHE)"),
    Flag(("--served-model-name",), "JAXLLM_SERVED_MODEL_NAME", "model", "the name the API reports (default: MODEL)"),
    Flag(("--dtype",), "JAXLLM_DTYPE", "model", "weights' and activations' type",
         choices=("auto", "float32", "bfloat16", "float16")),
    Flag(("--quantization", "-q"), "JAXLLM_QUANTIZATION", "model", "auto (a GGUF file's own), int8, none"),
    Flag(("--max-model-len",), "JAXLLM_MAX_MODEL_LEN", "model", "most tokens of a sequence (prompt + output)", int),
    Flag(("--seed",), "JAXLLM_SEED", "model", "the engine's random seed", int),
    Flag(("--runner",), "JAXLLM_RUNNER", "model", "pooling: a causal model embeds too (last-token pooling); "
         "generate: refuse a model that cannot generate", choices=("auto", "generate", "pooling")),
    Flag(("--preset",), "JAXLLM_PRESET", "model", "jaxllm engine preset (jaxllm/configs/) or TOML file the flags "
         "override (default: smollm2-cpu for the embedded model, the platform's for others: cpu, gpu, tpu)"),
    Flag(("--kv-cache-dtype",), "JAXLLM_KV_CACHE_DTYPE", "engine", "auto (the model's), bfloat16, float16, "
         "float32, float8_e4m3fn, float8_e5m2"),
    Flag(("--gpu-memory-utilization",), "JAXLLM_KV_MEMORY_FRACTION", "engine", "fraction of the device memory "
         "left after the weights (CPU: of host RAM) that the KV cache takes", float),
    Flag(("--num-gpu-blocks-override",), "JAXLLM_NUM_PAGES", "engine", "KV pages, instead of sizing them", int),
    Flag(("--block-size",), "JAXLLM_PAGE_SIZE", "engine", "tokens per KV page", int),
    Flag(("--max-num-seqs",), "JAXLLM_MAX_NUM_SEQS", "engine", "most sequences in one step", int),
    Flag(("--max-num-batched-tokens",), "JAXLLM_MAX_NUM_BATCHED_TOKENS", "engine", "token budget of one step", int),
    Flag(("--enable-prefix-caching",), "JAXLLM_ENABLE_PREFIX_CACHING", "engine", "reuse KV pages of shared "
         "prefixes (default on)", None, _bool),
    Flag(("--async-scheduling",), "JAXLLM_ASYNC_SCHEDULING", "engine", "dispatch a decode step before the "
         "previous one's tokens are read back (default on)", None, _bool),
    Flag(("--speculative-config",), "JAXLLM_SPECULATIVE_CONFIG", "engine", 'speculative decoding, as JSON: '
         '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}, '
         '{"method": "draft_model", "model": "draft.gguf", "num_speculative_tokens": 7} or '
         '{"method": "eagle3", "model": "org/eagle3-head", "num_speculative_tokens": 3}'),
    Flag(("--enable-lora",), "JAXLLM_ENABLE_LORA", "lora", "serve LoRA adapters (implied by --lora-modules)", None,
         _bool),
    Flag(("--lora-modules",), "JAXLLM_LORA_MODULES", "lora", "adapters served by name: name=path ... or JSON "
         '\'{"name": ..., "path": ...}\'', str, _lora_modules, nargs="+"),
    Flag(("--max-loras",), "JAXLLM_MAX_LORAS", "lora", "most adapters in one step (device slots)", int),
    Flag(("--max-lora-rank",), "JAXLLM_MAX_LORA_RANK", "lora", "largest adapter rank served", int),
    Flag(("--max-cpu-loras",), "JAXLLM_MAX_CPU_LORAS", "lora", "adapters kept loaded on the host", int),
    Flag(("--lora-dtype",), "JAXLLM_LORA_DTYPE", "lora", "adapter tables' dtype: auto (the model's; bfloat16 over "
         "quantized weights), float32, bfloat16, float16"),
    Flag(("--limit-mm-per-prompt",), "JAXLLM_LIMIT_MM_PER_PROMPT", "engine", 'images per prompt: N or {"image": N}',
         _json_or(int, "image")),
    Flag(("--tensor-parallel-size", "-tp"), "JAXLLM_TENSOR_PARALLEL_SIZE", "parallel", "devices one model spans",
         int),
    Flag(("--expert-parallel-size", "-ep"), "JAXLLM_EXPERT_PARALLEL_SIZE", "parallel", "groups of "
         "tensor-parallel devices a mixture of experts' experts are split over", int),
    Flag(("--enable-expert-parallel",), "JAXLLM_ENABLE_EXPERT_PARALLEL", "parallel", "split a mixture of experts' "
         "experts whole over the tensor-parallel devices (attention stays split by heads)", None, _bool),
    Flag(("--data-parallel-size", "-dp"), "JAXLLM_DATA_PARALLEL_SIZE", "parallel", "engine cores, each with its own "
         "share of the devices and its own copy of the model", int),
    Flag(("--nnodes",), "JAXLLM_NUM_HOSTS", "parallel", "hosts one model spans (multi-host)", int),
    Flag(("--node-rank",), "JAXLLM_HOST_RANK", "parallel", "this host's rank (0 serves; others follow)", int),
    Flag(("--master-addr",), None, "parallel", "rank 0's address for jax.distributed (with --master-port)"),
    Flag(("--master-port",), None, "parallel", "rank 0's port for jax.distributed", int),
    Flag(("--api-server-count",), "JAXLLM_API_SERVERS", "modes", "API server processes sharing the engine "
         "core(s) (more than one: the engine runs in its own process)", int),
    Flag(("--headless",), None, "modes", "run engine cores only, for API servers started elsewhere", None),
    Flag(("--data-parallel-address",), None, "modes", "the engine cores' host: where --headless listens, or where "
         "an API server finds them (the secret: JAXLLM_ENGINE_SECRET)"),
    Flag(("--data-parallel-rpc-port",), None, "modes", "the first engine core's port (rank r: port + r; default "
         "5555)", int),
    Flag(("--host",), None, "frontend", "address to listen on (default 0.0.0.0)"),
    Flag(("--port",), None, "frontend", "port to listen on (default 8000)", int),
    Flag(("--api-key",), "JAXLLM_API_KEY", "frontend", "the key clients must send (Authorization: Bearer)"),
    Flag(("--chat-template",), "JAXLLM_CHAT_TEMPLATE", "frontend", "a jinja chat template (a file, or the template "
         "itself) replacing the model's"),
    Flag(("--enable-auto-tool-choice",), None, "frontend", "accepted as vLLM's: tool_choice auto is always on when "
         "the chat template has tools", None),
    Flag(("--tool-call-parser",), "JAXLLM_TOOL_CALL_PARSER", "frontend", "hermes, llama3_json, mistral (default: "
         "from the chat template)"),
    Flag(("--reasoning-parser",), "JAXLLM_REASONING_PARSER", "frontend", "qwen3, deepseek_r1"),
    Flag(("--allowed-origins",), "JAXLLM_ALLOWED_ORIGINS", "frontend", 'CORS origins: ["https://a.example"] or '
         "comma-separated", _json_or(str), _origins),
    Flag(("--ssl-certfile",), "JAXLLM_SSL_CERTFILE", "frontend", "TLS certificate (with --ssl-keyfile)"),
    Flag(("--ssl-keyfile",), "JAXLLM_SSL_KEYFILE", "frontend", "TLS private key"),
    Flag(("--uvicorn-log-level", "--log-level"), "JAXLLM_LOG_LEVEL", "frontend", "log level",
         choices=("critical", "error", "warning", "info", "debug", "trace")),
]
BY_DEST = {f.dest: f for f in FLAGS}


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI API (vLLM's flags)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="as --model (default: the embedded SmolLM2)")
    p.add_argument("--config", help="a YAML file of flags by their long names (the command line wins over it)")
    groups = {key: p.add_argument_group(title) for key, title in GROUPS.items()}
    for flag in FLAGS:
        g = groups[flag.group]
        if flag.kind is None:
            action = argparse.BooleanOptionalAction if flag.env else "store_true"
            g.add_argument(*flag.names, dest=flag.dest, action=action, default=None, help=flag.help)
        else:
            g.add_argument(*flag.names, dest=flag.dest, type=flag.kind, choices=flag.choices, default=None,
                           help=flag.help, nargs=flag.nargs)
    p.set_defaults(run=run)


def apply_config_file(args: argparse.Namespace) -> None:
    """Sets each flag the YAML file names and the command line did not (ValueError: a bad file)."""
    import difflib

    import yaml

    try:
        with open(args.config) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {args.config}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {args.config}: expected a mapping of flag names to values")
    for key, value in values.items():
        dest = str(key).lstrip("-").replace("-", "_")
        flag = BY_DEST.get(dest)
        if flag is None:
            close = difflib.get_close_matches(dest, list(BY_DEST), n=1)
            raise ValueError(f"--config {args.config}: unknown key {key!r}" +
                             (f" (did you mean {close[0].replace('_', '-')}?)" if close else ""))
        if getattr(args, dest) is None:
            if flag.kind is not None and not isinstance(value, (list, dict)):
                try:
                    value = flag.kind(str(value))
                except (ValueError, argparse.ArgumentTypeError) as e:
                    raise ValueError(f"--config {args.config}: {key}: {e}") from None
            setattr(args, dest, value)


def environment(args: argparse.Namespace, base: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """The environment the server runs with: `base` with each given flag's variable set; and, for --headless or an
    API server given --data-parallel-address, the engine cores' first address."""
    env = dict(base)
    for flag in FLAGS:
        value = getattr(args, flag.dest)
        if value is not None and flag.env is not None:
            env[flag.env] = flag.to_env(value)
    if args.host is not None or args.port is not None:
        host, _, port = env.get("JAXLLM_BIND", "0.0.0.0:8000").rpartition(":")
        env["JAXLLM_BIND"] = f"{args.host or host}:{args.port or port}"
    if args.chat_template is not None and not os.path.isfile(args.chat_template):  # the template itself
        with tempfile.NamedTemporaryFile("w", suffix=".jinja", delete=False) as f:
            f.write(args.chat_template)
        env["JAXLLM_CHAT_TEMPLATE"] = f.name
    if args.master_addr is not None:
        env["JAXLLM_COORDINATOR_ADDRESS"] = f"{args.master_addr}:{args.master_port or 29500}"
    address = None
    if args.headless or args.data_parallel_address is not None:
        address = f"tcp://{args.data_parallel_address or '127.0.0.1'}:{args.data_parallel_rpc_port or 5555}"
    return env, address


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def fail(message: str) -> int:
        print(f"jaxllm serve: error: {message}", file=sys.stderr)
        return 2

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            return fail(f"two models given: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    if args.config is not None:
        try:
            apply_config_file(args)
        except ValueError as e:
            return fail(str(e))
    env, address = environment(args, dict(os.environ))
    if address is not None and not env.get("JAXLLM_ENGINE_SECRET"):
        return fail("set JAXLLM_ENGINE_SECRET: the engine cores and the API servers share it")
    if args.data_parallel_address is not None and not args.headless:
        from server.engine_core import rank_addresses

        env["JAXLLM_ENGINE_ADDRESS"] = ",".join(rank_addresses(address, args.data_parallel_size or 1))
    from jaxllm.config import ConfigError
    from jaxllm.loading.errors import LoadError
    from jaxllm.loading.resolve import resolve_model
    from server.settings import ServerSettings

    try:
        settings = ServerSettings.from_env(env)
    except (ValueError, ConfigError, OSError) as e:
        return fail(str(e))
    engine_here = args.headless or not env.get("JAXLLM_ENGINE_ADDRESS")
    if engine_here:  # fetch a hub id once, before any worker or core starts, and say where it came from
        try:
            resolved = resolve_model(settings.engine.model, revision=settings.engine.revision,
                                     download_dir=settings.engine.download_dir)
        except LoadError as e:
            return fail(str(e))
        logger.info("model %s: %s (%s)", resolved.name, resolved.path, resolved.source)
    os.environ.clear()
    os.environ.update(env)
    if args.headless:
        from server import engine_core

        return engine_core.main(["--address", address, "--data-parallel-size", str(args.data_parallel_size or 1)])
    from jaxllm.cli.gunicorn_app import ServeApplication

    ServeApplication().run()
    return 0
