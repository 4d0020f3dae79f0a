"""Loading a model and its tokenizer from a Hugging Face folder, a GGUF file, a jaxllm orbax checkpoint,
or, with no path, the embedded SmolLM2."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import logging
from pathlib import Path

import jax
from jax.sharding import Mesh

from jaxllm.config import ConfigError, ModelConfig
from jaxllm.dtypes import resolve_dtype, resolve_kv_cache_dtype
from jaxllm.kernels import choose_kernels
from jaxllm.loading.checkpoint import is_orbax_checkpoint, load_checkpoint_config, restore_checkpoint
from jaxllm.loading.encoder import is_encoder_folder, load_encoder
from jaxllm.loading.errors import LoadError
from jaxllm.loading.gguf import gguf_config, gguf_quant_plan, gguf_tensors
from jaxllm.loading.gguf_file import GGUFFile
from jaxllm.loading.hf import hf_tensors, load_hf_config
from jaxllm.loading.quantize import QUANTIZATIONS, int8_plan, plan_label
from jaxllm.loading.qwen_vl import is_vl_folder, load_qwen_vl, vl_eos_token_ids
from jaxllm.loading.resolve import resolve_model
from jaxllm.loading.weights import ReadStats, assemble_model
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.multimodal.image_processor import ImageProcessorConfig
from jaxllm.pooling_params import Pooling
from jaxllm.sharding import check_tensor_parallel, make_mesh
from jaxllm.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from jaxllm.tokenizer.hf_tokenizer import tokenizer_from_hf_folder
from jaxllm.tokenizer.tokenizer import Tokenizer

__all__ = ["LoadError", "LoadedModel", "load_model", "load_tokenizer", "resolve_model", "weight_bytes"]

logger = logging.getLogger("jaxllm.loading")


@dataclasses.dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    config: ModelConfig
    mesh: Mesh
    name: str
    bytes_read: int = 0  # of the checkpoint, by this process (over several hosts: its devices' share)
    pooling: Pooling | None = None  # a sentence-transformers folder's pooling (the model then embeds)
    image_processor: ImageProcessorConfig | None = None  # a vision-language model's preprocessing


def load_tokenizer(path: str | Path | None, *, revision: str | None = None,
                   download_dir: str | Path | None = None) -> Tokenizer | None:
    """The tokenizer of a GGUF file or HF folder (for an orbax checkpoint: of the folder it was saved beside,
    if it has tokenizer files); `path` as `resolve_model` takes it (a hub id too)."""
    p = resolve_model(path, revision=revision, download_dir=download_dir).path
    if p.is_file():
        g = GGUFFile(p)
        return tokenizer_from_gguf(g.metadata, str(p))
    if (p / "tokenizer.json").is_file():
        eos = load_checkpoint_config(p).eos_token_ids if is_orbax_checkpoint(p) else \
            vl_eos_token_ids(p) if is_vl_folder(p) else load_hf_config(p).eos_token_ids
        return tokenizer_from_hf_folder(p, eos)
    return None


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of the model's parameters (all devices' shards counted once)."""
    from flax import nnx
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _release_host_memory() -> None:
    """Returns the loader's freed host buffers to the OS: glibc keeps freed heap memory (converted tensors,
    stacks already placed) in its arenas, where it would count as this process's memory for as long as it runs."""
    gc.collect()  # loader buffers caught in reference cycles (a failed tensor's traceback) go first
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _check_quantization(quantization: str | None) -> str:
    q = "none" if quantization is None else quantization
    if q not in QUANTIZATIONS:
        raise LoadError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    return q


def load_model(path: str | Path | None = None, *, dtype: str | None = "auto", tensor_parallel_size: int = 1,
               attn_impl: str = "auto", matmul_impl: str = "auto", mesh: Mesh | None = None,
               load_tokenizer_too: bool = True, kv_cache_dtype: str | None = None,
               quantization: str | None = "auto", revision: str | None = None,
               download_dir: str | Path | None = None, expert_parallel_size: int = 1,
               enable_expert_parallel: bool = False) -> LoadedModel:
    """path: a folder, a GGUF file, a hub id (`resolve_model`; revision and download_dir are for hub ids), or None
    for the embedded model. quantization: "auto" (a GGUF file's weights stay in their own quantization, anything
    else as stored), "gguf" (the same, for GGUF files only), "int8" (per-channel int8 of every linear weight and
    the embedding, made at load), "none" (float weights of `dtype`). expert_parallel_size: a mixture of experts'
    experts over so many groups of `tensor_parallel_size` devices; enable_expert_parallel: whole experts over the
    tensor-parallel devices themselves, as vLLM's flag (`jaxllm.sharding`)."""
    quantization = _check_quantization(quantization)
    resolved = resolve_model(path, revision=revision, download_dir=download_dir)
    p = resolved.path
    dt = resolve_dtype(dtype)
    mesh = mesh or make_mesh(tensor_parallel_size, expert_parallel_size=expert_parallel_size)
    tp, ep = mesh.shape["tp"], dict(mesh.shape).get("ep", 1)
    kernels = choose_kernels(attn_impl, matmul_impl, platform=next(iter(mesh.devices.flat)).platform, dtype=dt,
                             kv_dtype=resolve_kv_cache_dtype(kv_cache_dtype, dt), mesh=mesh)
    tokenizer = None
    read = ReadStats()
    if quantization == "gguf" and not p.is_file():
        raise LoadError(f"{p}: quantization='gguf' needs a GGUF file")
    if p.is_file():
        g = GGUFFile(p)
        cfg = gguf_config(g)
        check_tensor_parallel(cfg, tp, ep, enable_expert_parallel)
        plan = gguf_quant_plan(g) if quantization in ("auto", "gguf") else \
            int8_plan(cfg.tie_word_embeddings) if quantization == "int8" else {}
        model = assemble_model(cfg, gguf_tensors(g, cfg, quantized=quantization in ("auto", "gguf")), dtype=dt,
                               kernels=kernels, mesh=mesh, quantization=plan, read_stats=read,
                               experts_over_tp=enable_expert_parallel)
        if load_tokenizer_too:
            tokenizer = tokenizer_from_gguf(g.metadata, str(p))
    elif is_orbax_checkpoint(p):
        if quantization != "auto":
            raise LoadError(f"{p}: an orbax checkpoint is restored as it was saved (weights quantized or not), not "
                            f"with quantization={quantization!r}")
        model = restore_checkpoint(p, dtype=dt, kernels=kernels, mesh=mesh, experts_over_tp=enable_expert_parallel)
        cfg = model.config
    elif is_encoder_folder(p):
        if mesh.size > 1 or quantization not in ("auto", "none"):
            raise LoadError(f"{p}: encoders run on one device with float weights")
        model, tokenizer = load_encoder(p, dt)
        cfg, plan = model.config, {}
    elif is_vl_folder(p):
        if quantization not in ("auto", "none"):
            raise LoadError(f"{p}: vision-language models load with float weights")
        model = load_qwen_vl(p, dtype=dt, kernels=kernels, mesh=mesh, read_stats=read)
        model.arrange_layers()
        cfg, plan = model.config, {}
    else:
        cfg = load_hf_config(p)
        check_tensor_parallel(cfg, tp, ep, enable_expert_parallel)
        plan = int8_plan(cfg.tie_word_embeddings) if quantization == "int8" else {}
        model = assemble_model(cfg, hf_tensors(p), dtype=dt, kernels=kernels, mesh=mesh, quantization=plan,
                               read_stats=read, experts_over_tp=enable_expert_parallel)
    if enable_expert_parallel and not getattr(cfg, "num_experts", 0):  # (an encoder's or a VL model's config)
        raise ConfigError("enable_expert_parallel needs a mixture-of-experts model")
    if isinstance(model, LlamaForCausalLM):
        # GGUF and HF loads arrive stacked, an orbax restore layer by layer: as the layer loop runs them from here
        model.arrange_layers()
    if load_tokenizer_too and tokenizer is None and p.is_dir() and (p / "tokenizer.json").is_file():
        tokenizer = tokenizer_from_hf_folder(p, cfg.eos_token_ids)
    name = resolved.name
    from flax import nnx
    jax.block_until_ready(nnx.state(model, nnx.Param))  # transfers done: their host buffers can be released
    _release_host_memory()
    logger.info("loaded %s: weights %s, %.1f MB resident (all devices); this process read %d bytes of the "
                "checkpoint", name, plan_label(model.quant_plan), weight_bytes(model) / 1e6, read.bytes)
    try:
        pooling = Pooling.from_sentence_transformers(p) if p.is_dir() else None
    except (OSError, ValueError) as e:
        raise LoadError(f"{p}: {e}") from None
    image_processor = None
    if model.multimodal:
        try:
            raw = json.loads((p / "preprocessor_config.json").read_text())
            image_processor = ImageProcessorConfig.from_hf(raw)
        except (OSError, ValueError, TypeError) as e:
            raise LoadError(f"{p}/preprocessor_config.json: {e}") from None
    return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, mesh=mesh, name=name, bytes_read=read.bytes,
                       pooling=pooling, image_processor=image_processor)
