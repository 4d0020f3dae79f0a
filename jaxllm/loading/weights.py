"""From named checkpoint tensors to a sharded model, one tensor at a time.

Checkpoint tensors use Hugging Face names (GGUF names are translated to them first). Each is converted
on the host, checked against the model's expected shape, cast, and placed directly onto its devices with
its target sharding: the host never holds more than one converted tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxllm.config import ModelConfig
from jaxllm.loading.errors import LoadError
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.sharding import logical_rules, named_sharding

# Tensors some checkpoints carry that the model recomputes.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_name_to_path(name: str) -> tuple[str | int, ...] | None:
    """'model.layers.3.self_attn.q_proj.weight' -> ('layers', 3, 'self_attn', 'q_proj', 'weight');
    None: not a model tensor. Linear weights keep the checkpoints' [out, in] layout."""
    parts = name.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    path: list[str | int] = [int(p) if p.isdigit() else p for p in parts]
    if not path or path[-1] not in ("weight", "bias"):
        return None
    module = path[-2] if len(path) > 1 else ""
    if module == "embed_tokens" and path[-1] == "weight":
        return tuple(path[:-1]) + ("embedding",)
    return tuple(path)


def abstract_model(cfg: ModelConfig, dtype, attn_impl: str) -> LlamaForCausalLM:
    return LlamaForCausalLM(cfg, dtype=dtype, attn_impl=attn_impl, rngs=None)


def place(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """Copies only each device's shard of a host array onto that device."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def assemble_model(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, Callable[[], np.ndarray], str]],
    *,
    dtype,
    attn_impl: str,
    mesh: Mesh,
) -> LlamaForCausalLM:
    """tensors: (hf_name, load() -> host array, source file for messages)."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype, attn_impl))
    variables = {path: var for path, var in nnx.to_flat_state(state)}
    rules = logical_rules(cfg, mesh.shape["tp"])
    loaded: set[tuple] = set()
    for name, load, source in tensors:
        path = hf_name_to_path(name)
        if path is None or IGNORED.match(name):
            continue
        if cfg.tie_word_embeddings and path == ("lm_head", "weight"):
            continue  # tied checkpoints sometimes ship a copy of the embedding
        var = variables.get(path)
        if var is None:
            raise LoadError(f"{source}: tensor {name!r} does not belong to a {cfg.architecture} with this config")
        array = load()
        expected = var.get_value().shape
        if tuple(array.shape) != tuple(expected):
            raise LoadError(f"{source}: tensor {name!r} has shape {tuple(array.shape)}, but the config implies "
                            f"{tuple(expected)}")
        sharding = named_sharding(mesh, rules, var.get_metadata()["axes"])
        var.set_value(place(np.ascontiguousarray(array, dtype=var.get_value().dtype), sharding))
        loaded.add(path)
    missing = [".".join(map(str, p)) for p in variables if p not in loaded]
    if missing:
        raise LoadError(f"checkpoint is missing {len(missing)} tensor(s) the config needs, e.g. {missing[:3]}")
    return nnx.merge(graphdef, state)
