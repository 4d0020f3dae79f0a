"""From named checkpoint tensors to a sharded model, a few tensors at a time.

Checkpoint tensors use Hugging Face names (GGUF names are translated to them first). Each is converted
on the host, checked against the model's expected shape, cast, and placed directly onto its devices with
its target sharding: the host holds at most a few converted tensors (`PREFETCH`) and the parts of the fused
parameters not yet complete (q/k/v, gate/up: see `fused`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import re
from collections.abc import Callable, Iterable, Iterator

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxllm.config import ModelConfig
from jaxllm.loading.errors import LoadError
from jaxllm.loading.fused import NUM_PARTS, PARTS, fuse, part_shapes
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.sharding import logical_rules, named_sharding

# Tensors some checkpoints carry that the model recomputes.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_name_to_path(name: str) -> tuple[tuple[str | int, ...], int | None] | None:
    """'model.layers.3.self_attn.k_proj.weight' -> (('layers', 3, 'self_attn', 'qkv_proj', 'weight'), 1): the
    model parameter and, for a tensor the model keeps fused, which part it is (None otherwise). None: not a
    model tensor. Linear weights keep the checkpoints' [out, in] layout."""
    parts = name.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    path: list[str | int] = [int(p) if p.isdigit() else p for p in parts]
    if not path or path[-1] not in ("weight", "bias"):
        return None
    module = path[-2] if len(path) > 1 else ""
    if module == "embed_tokens" and path[-1] == "weight":
        return tuple(path[:-1]) + ("embedding",), None
    if module in PARTS:
        fused, part = PARTS[module]
        return tuple(path[:-2]) + (fused, path[-1]), part
    return tuple(path), None


def abstract_model(cfg: ModelConfig, dtype, attn_impl: str) -> LlamaForCausalLM:
    return LlamaForCausalLM(cfg, dtype=dtype, attn_impl=attn_impl, rngs=None)


def place(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """Copies only each device's shard of a host array onto that device."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


PREFETCH = 4  # tensors converted ahead of the one being placed


def _prefetched(tensors: Iterable[tuple[str, Callable[[], np.ndarray], str]]
                ) -> Iterator[tuple[str, concurrent.futures.Future, str]]:
    """The tensors with their conversion (dequantizing, reading; numpy releases the GIL) started a few ahead on
    two threads, so it overlaps placing the previous ones. The host holds at most PREFETCH + 1 converted
    tensors."""
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxllm-load") as pool:
        ahead: collections.deque = collections.deque()
        for name, load, source in tensors:
            ahead.append((name, pool.submit(load), source))
            if len(ahead) > PREFETCH:
                yield ahead.popleft()
        while ahead:
            yield ahead.popleft()


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
    pending: dict[tuple, dict[int, np.ndarray]] = {}  # fused parameters still waiting for some of their parts

    def put(path, var, array):
        sharding = named_sharding(mesh, rules, var.get_metadata()["axes"])
        var.set_value(place(np.ascontiguousarray(array, dtype=var.get_value().dtype), sharding))
        loaded.add(path)

    for name, load, source in _prefetched(tensors):
        mapped = hf_name_to_path(name)
        if mapped is None or IGNORED.match(name):
            continue
        path, part = mapped
        if cfg.tie_word_embeddings and path == ("lm_head", "weight"):
            continue  # tied checkpoints sometimes ship a copy of the embedding
        var = variables.get(path)
        if var is None:
            raise LoadError(f"{source}: tensor {name!r} does not belong to a {cfg.architecture} with this config")
        array = load.result()
        shape = tuple(var.get_value().shape)
        expected = shape if part is None else part_shapes(path[-2], cfg, shape[1:])[part]
        if tuple(array.shape) != expected:
            raise LoadError(f"{source}: tensor {name!r} has shape {tuple(array.shape)}, but the config implies "
                            f"{expected}")
        if part is None:
            put(path, var, array)
            continue
        parts = pending.setdefault(path, {})
        parts[part] = array
        if len(parts) == NUM_PARTS[path[-2]]:
            put(path, var, fuse(path[-2], [parts[i] for i in range(len(parts))], cfg))
            del pending[path]
    missing = [".".join(map(str, p)) for p in variables if p not in loaded]
    if missing:
        raise LoadError(f"checkpoint is missing {len(missing)} tensor(s) the config needs, e.g. {missing[:3]}")
    return nnx.merge(graphdef, state)
