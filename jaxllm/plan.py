"""Capacity plan for a preset on an accelerator: weights per device, KV bytes per token, pages that fit, maximum
concurrency at max_model_len, and the decode roofline (HBM bytes a step must read / peak bandwidth).

    jaxllm plan [MODEL] [--preset llama-3.1-8b-h100] [--device h100] [--tp N] [--context 1024]
    jaxllm plan Qwen/Qwen2.5-7B-Instruct --device v6e --tp 4     # a hub id: only its config.json is fetched

MODEL: a Hugging Face folder, a GGUF file, a hub id (org/name; org/name:QUANT fetches that GGUF file), or a model
whose config ships in jaxllm/configs/models/ (meta-llama/Llama-3.1-8B-Instruct); default: the preset's model.

The numbers follow the engine's own rules: parameters counted from the model's abstract shapes, split as the
sharding rules split them; the KV budget as `LLMEngine` takes it on an accelerator (a fraction of the device
memory the allocator allows, after the weights); pages of `page_size` tokens. The roofline counts only HBM
reads (every weight once a step, and each sequence's KV context), so it is an upper bound on decode speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from importlib import resources
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.dtypes import resolve_dtype, resolve_kv_cache_dtype
from jaxllm.engine.config import EngineConfig
from jaxllm.kernels import Kernels
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.sharding import TP_AXIS, check_tensor_parallel, logical_rules


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    hbm_bytes: int  # what the device reports as its memory
    hbm_bytes_per_s: float  # peak bandwidth
    bf16_flops: float  # peak dense bfloat16 FLOP/s
    allocator_fraction: float  # of hbm_bytes that JAX's allocator may use by default


GIB = 2**30
# Public spec sheets (SXM parts for NVIDIA). JAX preallocates 75% of a GPU's memory unless
# XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise; a TPU's HBM is the allocator's.
DEVICES = {
    "h100": Device("H100 SXM 80GB", 80 * GIB, 3.35e12, 989e12, 0.75),
    "h200": Device("H200 SXM 141GB", 141 * GIB, 4.8e12, 989e12, 0.75),
    "v5e": Device("TPU v5e", 16 * GIB, 819e9, 197e12, 1.0),
    "v6e": Device("TPU v6e", 32 * GIB, 1640e9, 918e12, 1.0),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    device: Device
    tp: int
    weight_bytes: int  # all devices
    weight_bytes_per_device: int
    kv_bytes_per_token: int  # all layers, K and V, all devices
    kv_bytes_per_token_per_device: int
    num_pages: int
    page_size: int
    max_model_len: int
    max_concurrency: float  # sequences of max_model_len tokens that fit at once
    context: int  # tokens of context per sequence assumed for the roofline
    decode_tok_s: dict[int, float]  # batch -> roofline tokens/s (all sequences together)
    expert_bytes_per_device: int = 0  # a mixture of experts': all resident; a step reads the experts it routes to


def bundled_model_config(served_model_name: str) -> ModelConfig | None:
    """The config shipped in jaxllm/configs/models/ for e.g. "meta-llama/Llama-3.1-8B-Instruct"."""
    name = served_model_name.rsplit("/", 1)[-1].lower() + ".json"
    file = resources.files("jaxllm.configs").joinpath("models", name)
    return ModelConfig.from_hf(json.loads(file.read_text())) if file.is_file() else None


def model_config(engine: EngineConfig) -> ModelConfig:
    """The config of the engine's model (`engine.model` as `jaxllm plan MODEL` takes it), else of its served name's
    bundled config. Raises LoadError (one line) when there is neither."""
    from jaxllm.loading import LoadError
    from jaxllm.loading.gguf import gguf_config
    from jaxllm.loading.gguf_file import GGUFFile
    from jaxllm.loading.hf import load_hf_config
    from jaxllm.loading.resolve import looks_like_hub_id, resolve_config, resolve_model

    name = engine.model
    if name and (cfg := bundled_model_config(name)) is not None and not Path(name).exists():
        return cfg
    if name and (Path(name).exists() or looks_like_hub_id(name)):
        if ":" in name or Path(name).is_file():  # a GGUF file: its metadata holds the config
            return gguf_config(GGUFFile(resolve_model(name, revision=engine.revision,
                                                      download_dir=engine.download_dir).path))
        folder = Path(name) if Path(name).exists() else resolve_config(name, revision=engine.revision,
                                                                       download_dir=engine.download_dir)
        return load_hf_config(folder)
    cfg = bundled_model_config(engine.served_model_name or "")
    if cfg is None:
        raise LoadError(f"{name or engine.served_model_name!r}: no such folder or file, not a hub id, and no config "
                        "bundled for it")
    return cfg


def make_plan(cfg: ModelConfig, engine: EngineConfig, device: Device, tp: int, context: int) -> Plan:
    check_tensor_parallel(cfg, tp, experts_over_tp=engine.enable_expert_parallel)
    dtype = resolve_dtype(engine.dtype if engine.dtype != "auto" else "bfloat16")
    itemsize = jnp.dtype(dtype).itemsize
    kernels = Kernels("reference", "reference", "gpu")  # shapes only: the kernel choice does not matter
    model = LlamaForCausalLM(cfg, dtype=dtype, kernels=kernels, rngs=None)
    model.stack_layers()
    rules = logical_rules(cfg, tp, experts_over_tp=engine.enable_expert_parallel)  # (experts split by tp either way:
    # by rows, or whole with enable_expert_parallel)
    total = per_device = experts = 0
    for _, var in nnx.to_flat_state(nnx.state(model)):
        size = int(np.prod(var.get_value().shape)) * itemsize
        split = any(rules.get(a) == TP_AXIS for a in var.get_metadata()["axes"] if a)
        total += size
        per_device += size // tp if split else size
        if "expert" in var.get_metadata()["axes"]:
            experts += size // tp if split else size
    kv_itemsize = jnp.dtype(resolve_kv_cache_dtype(engine.kv_cache_dtype, dtype)).itemsize
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_itemsize
    kv_token_device = kv_token // tp
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", device.allocator_fraction)) \
        if device.allocator_fraction < 1 else 1.0
    budget = int((device.hbm_bytes * fraction - per_device) * engine.kv_memory_fraction)
    num_pages = max(0, budget // (kv_token_device * engine.page_size))
    max_len = min(engine.max_model_len or cfg.max_position_embeddings, num_pages * engine.page_size)
    decode = {}
    for batch in sorted({1, engine.max_num_seqs}):
        fits = min(batch, num_pages * engine.page_size // max(1, context))  # sequences whose context fits
        step_bytes = per_device - experts + experts * _experts_read(cfg, fits) + fits * context * kv_token_device
        decode[fits] = fits * device.hbm_bytes_per_s / step_bytes
    return Plan(device, tp, total, per_device, kv_token, kv_token_device, num_pages, engine.page_size, max_len,
                num_pages * engine.page_size / max_len if max_len else 0.0, context, decode, experts)


def _experts_read(cfg: ModelConfig, batch: int) -> float:
    """The share of a layer's experts a decode step of `batch` tokens reads, routing uniform: 1 - (1 - k / E) ** batch
    (k / E for one token: its active parameters)."""
    if not cfg.num_experts:
        return 1.0
    return 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** batch


def render(plan: Plan, cfg: ModelConfig) -> str:
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    lines = [
        f"{cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads / "
        f"{cfg.num_kv_heads} KV heads x {cfg.head_dim}, vocab {cfg.vocab_size}",
        f"device: {plan.device.name} x {plan.tp} (HBM {gib(plan.device.hbm_bytes)}, "
        f"{plan.device.hbm_bytes_per_s / 1e12:.2f} TB/s)",
        f"weights: {gib(plan.weight_bytes)} in all, {gib(plan.weight_bytes_per_device)} per device" + (
            f" (experts {gib(plan.expert_bytes_per_device)} per device, all resident; a token reads "
            f"{cfg.num_experts_per_tok} of {cfg.num_experts} per layer)" if plan.expert_bytes_per_device else ""),
        f"KV cache: {plan.kv_bytes_per_token / 1024:.0f} KiB per token in all, "
        f"{plan.kv_bytes_per_token_per_device / 1024:.0f} KiB per device",
        f"pages that fit: {plan.num_pages} x {plan.page_size} tokens = {plan.num_pages * plan.page_size} tokens "
        f"({gib(plan.num_pages * plan.page_size * plan.kv_bytes_per_token_per_device)} per device)",
        f"max_model_len {plan.max_model_len}: maximum concurrency {plan.max_concurrency:.1f} sequences",
    ]
    for batch, tok_s in plan.decode_tok_s.items():
        lines.append(f"decode roofline, batch {batch} at {plan.context} tokens of context: {tok_s:,.0f} tok/s "
                     f"({tok_s / batch:,.1f} tok/s per sequence)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxllm plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", metavar="MODEL", help="default: the preset's model")
    p.add_argument("--model", dest="model_flag", metavar="MODEL", help="the same as the positional MODEL")
    p.add_argument("--revision", help="a hub id's branch, tag or commit")
    p.add_argument("--preset", default="llama-3.1-8b-h100")
    p.add_argument("--device", choices=sorted(DEVICES), help="default: from the preset's name, else h100")
    p.add_argument("--tp", type=int, help="tensor parallel size (default: the preset's)")
    p.add_argument("--context", type=int, default=1024, help="tokens of context per sequence for the roofline")
    p.add_argument("--kv-cache-dtype", help="default: the preset's (auto: the model's dtype)")
    p.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="a mixture of experts' experts whole over the --tp devices")
    args = p.parse_args(argv)
    from jaxllm.config import ConfigError
    from jaxllm.loading import LoadError

    try:
        engine = EngineConfig.from_preset(args.preset, model=args.model or args.model_flag, revision=args.revision,
                                          kv_cache_dtype=args.kv_cache_dtype,
                                          enable_expert_parallel=args.enable_expert_parallel)
        cfg = model_config(engine)
        device = args.device or next((d for d in DEVICES if d in args.preset), "h100")
        plan = make_plan(cfg, engine, DEVICES[device], args.tp or engine.tensor_parallel_size, args.context)
    except (LoadError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(plan, cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
