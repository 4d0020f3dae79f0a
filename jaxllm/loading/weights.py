"""From named checkpoint tensors to a sharded model, a few tensors at a time.

Checkpoint tensors use Hugging Face names (GGUF names are translated to them first). Each is converted
on the host, checked against the model's expected shape, cast, and placed directly onto its devices with
its target sharding: the host holds at most a few converted tensors (`PREFETCH`), the parts of the fused
parameters not yet complete (q/k/v, gate/up: see `fused`) and the layers of the one stacked parameter being
assembled (the model's layers are stacked: `jaxllm.models.stacked_layers`; tensors are read in that order).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxllm.config import ModelConfig
from jaxllm.kernels import Kernels
from jaxllm.loading.errors import LoadError
from jaxllm.loading.fused import NUM_PARTS, fuse, part_shapes, split
from jaxllm.loading.quantize import HostQuantized, convert
from jaxllm.models.family import LLAMA_FUSED
from jaxllm.models.llama import LlamaForCausalLM, QuantPlan
from jaxllm.models.registry import architecture_spec
from jaxllm.sharding import mesh_rules, named_sharding
from pallas_kernels.quantized_matmul import QuantizedWeight

# The last component of a model tensor's name: a module's parameter (attention's `sinks`: GPT-OSS)
PARAMETERS = ("weight", "bias", "sinks")
# Tensors some checkpoints carry that the model recomputes.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_name_to_path(name: str, fused: dict = LLAMA_FUSED) -> tuple[tuple[str | int, ...], int | None] | None:
    """'model.layers.3.self_attn.k_proj.weight' -> (('layers', 3, 'self_attn', 'qkv_proj', 'weight'), 1): the
    model parameter and, for a tensor the model keeps fused, which part it is (None otherwise). None: not a
    model tensor. Linear weights keep the checkpoints' [out, in] layout. fused: the family's (`FamilySpec.fused`)."""
    parts = name.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    path: list[str | int] = [int(p) if p.isdigit() else p for p in parts]
    if not path or path[-1] not in PARAMETERS:
        return None
    module = path[-2] if len(path) > 1 else ""
    if module == "embed_tokens" and path[-1] == "weight":
        return tuple(path[:-1]) + ("embedding",), None
    if module in fused:
        into, part = fused[module]
        return tuple(path[:-2]) + (into, path[-1]), part
    return tuple(path), None


def abstract_model(cfg: ModelConfig, dtype, kernels: Kernels, *, stacked: bool = True,
                   quantization: QuantPlan | None = None) -> LlamaForCausalLM:
    """The model's shapes (no arrays), its layers stacked as the loaders return them (or separate: the layout of
    an orbax checkpoint)."""
    model = architecture_spec(cfg.architecture).model_class()(cfg, dtype=dtype, kernels=kernels, rngs=None,
                                                              quantization=quantization)
    if stacked:
        model.stack_layers()  # abstract: only shapes move
    return model


def place(array: np.ndarray, sharding: jax.sharding.Sharding, shape: tuple[int, ...] | None = None,
          region: tuple[slice, ...] | None = None) -> jax.Array:
    """Copies only each device's shard of a host array onto that device. With `shape` and `region`, the host
    array is only the `region` of a global array of `shape` (what this process's devices hold)."""
    if region is None:
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    def shard(index):
        return array[tuple(slice(i.start - r.start, i.stop - r.start) for i, r in
                           zip(_bounds(index, shape), region, strict=True))]
    return jax.make_array_from_callback(shape, sharding, shard)


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def local_region(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> tuple[slice, ...]:
    """The part of a global array of `shape` that this process's devices hold (their shards' bounding box): on one
    host everything; on several, each host's share of the sharded axes."""
    indices = [_bounds(i, shape) for i in sharding.addressable_devices_indices_map(shape).values()]
    return tuple(slice(min(i[a].start for i in indices), max(i[a].stop for i in indices)) for a in range(len(shape)))


def _extent(region: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(r.stop - r.start for r in region)


def _window(region: tuple[slice, ...], var_shape: tuple[int, ...], tensor_shape: tuple[int, ...]
            ) -> tuple[slice, ...] | None:
    """The slice of a checkpoint tensor that fills `region` of its variable (None: all of it). A fused part
    (q of qkv, gate of gate_up) is `tensor_shape` long where the variable is `var_shape`: the fused layouts group
    rows by shard (KV head, MLP row), so a region of whole shards takes the same fraction of every part."""
    if all(r.start == 0 and r.stop == n for r, n in zip(region, var_shape, strict=True)):
        return None
    return tuple(slice(r.start * t // v, r.stop * t // v)
                 for r, v, t in zip(region, var_shape, tensor_shape, strict=True))


def _nbytes(value) -> int:
    if isinstance(value, HostQuantized):
        return sum(a.nbytes for a in value.weight if a is not None)
    return value.nbytes


PREFETCH = 4  # tensors converted ahead of the one being placed


def _prefetched(tensors: Iterable[tuple[str, Callable[[], np.ndarray], Any]]
                ) -> Iterator[tuple[str, concurrent.futures.Future, Any]]:
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


def _layer_slot(path: tuple) -> tuple[tuple, tuple[int, ...] | None]:
    """('layers', 3, 'mlp', ...) -> (('layers', 'layer', 'mlp', ...), (3,)): the stacked variable and the slot the
    tensor fills, its layer, and its expert for an expert's weight (('layers', 3, 'mlp', 'experts', 5,
    'down_proj', 'weight') -> slot (3, 5) of a [layers, experts, ...] variable); other paths are their own
    variable (slot None)."""
    if len(path) > 1 and path[0] == "layers" and isinstance(path[1], int):
        rest = path[2:]
        at = rest.index("experts") + 1 if "experts" in rest else len(rest)  # where an expert's index would be
        if at < len(rest) and isinstance(rest[at], int):
            return ("layers", "layer", *rest[:at], *rest[at + 1:]), (path[1], rest[at])
        return ("layers", "layer", *rest), (path[1],)
    return path, None


def _rows_axis(path: tuple, ndim: int) -> int:
    """The out axis of a weight or bias of `ndim` axes (1 for a weight holding all of a layer's experts)."""
    return ndim - (2 if path[-1] == "weight" else 1)


def _role(path: tuple) -> str | None:
    """The quantizable weight a variable path holds (its packed values), e.g. 'qkv_proj'."""
    if path[-1] == "embedding":
        return "embed_tokens"
    if path[-1] != "weight" or len(path) < 2:
        return None
    return f"experts.{path[-2]}" if "experts" in path[:-2] else str(path[-2])


def _expand(path: tuple, value) -> list[tuple[tuple, np.ndarray]]:
    """A prepared tensor -> the variables it fills: a float array its own; quantized weights their values, scale
    and offset (``weight``, ``weight_scale``, ``weight_offset``)."""
    if not isinstance(value, QuantizedWeight):
        return [(path, value)]
    out = [(path, value.data), ((*path[:-1], f"{path[-1]}_scale"), value.scale)]
    if value.offset is not None:
        out.append(((*path[:-1], f"{path[-1]}_offset"), value.offset))
    return out


def _variables(path: tuple, fmt) -> list[tuple]:
    """The variables a weight of format `fmt` (None: float) fills, as `_expand` names them."""
    if fmt is None:
        return [path]
    suffixes = ("", "_scale", "_offset") if fmt.affine else ("", "_scale")
    return [(*path[:-1], f"{path[-1]}{suffix}") for suffix in suffixes]


class ReadStats:
    """What a load read from the checkpoint: bytes of the tensors (or tensor slices) its sources returned."""

    def __init__(self):
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, value) -> None:
        with self._lock:
            self.bytes += _nbytes(value)


def assemble_model(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, Callable[..., np.ndarray | HostQuantized], str]],
    *,
    dtype,
    kernels: Kernels,
    mesh: Mesh,
    quantization: QuantPlan | None = None,
    read_stats: ReadStats | None = None,
    experts_over_tp: bool = False,
) -> LlamaForCausalLM:
    """tensors: (hf_name, load() -> host array or `HostQuantized`, source file for messages); a load with a
    ``windowed`` attribute takes an optional tuple of slices and reads only that part of its tensor. The layers'
    tensors are read one stacked parameter at a time (all layers of one weight, then the next) into a host array
    of the stacked shape, placed once it is full: the host holds one stacked parameter and the devices never a
    second copy. Over several hosts (a mesh with devices of other processes), each host holds, and where the
    source allows reads, only the region its own devices hold. quantization: the weights kept quantized
    (`jaxllm.loading.quantize`): each tensor of such a weight is converted to its format on the loader threads (a
    GGUF block repacked, a float tensor made int8; read whole: a quantization's blocks and per-row scales span
    the input axis); every other tensor arrives as float. read_stats: counts the bytes read. experts_over_tp: a
    mixture of experts' experts placed whole over the ``tp`` devices (`jaxllm.sharding`)."""
    plan = dict(quantization or {})
    stats = read_stats or ReadStats()
    spec = architecture_spec(cfg.architecture)
    graphdef, state = nnx.split(abstract_model(cfg, dtype, kernels, quantization=plan))
    variables = {path: var for path, var in nnx.to_flat_state(state)}
    order = {path: i for i, path in enumerate(variables)}
    rules = mesh_rules(cfg, mesh, experts_over_tp)
    shardings = {path: named_sharding(mesh, rules, var.get_metadata()["axes"]) for path, var in variables.items()}
    regions = {path: local_region(tuple(var.get_value().shape), shardings[path]) for path, var in variables.items()}

    def region_of(path, layer):
        """The variable's local region without its slot's axes (a stacked variable's layers, and experts, are all
        local)."""
        return regions[path][0 if layer is None else len(layer):]

    def slot_rank(path) -> int:
        """A stacked variable's slot axes: its layer, and its expert for the experts' weights."""
        return 2 if "experts" in path else 1

    def slots(path) -> int:
        """How many slots a stacked variable has: layers, times experts for the experts' weights."""
        return cfg.num_layers * (cfg.num_experts if "experts" in path else 1)
    entries = []  # (variable path, slot, part, name, load, source, expected shape)
    if spec.adapt_tensors is not None:
        tensors = spec.adapt_tensors(tensors, cfg)
    for name, load, source in split(tensors, spec.split, cfg):
        name = spec.hf_name(name)
        mapped = hf_name_to_path(name, spec.fused)
        if mapped is None or IGNORED.match(name):
            continue
        path, part = mapped
        if cfg.tie_word_embeddings and path == ("lm_head", "weight"):
            continue  # tied checkpoints sometimes ship a copy of the embedding
        var_path, layer = _layer_slot(path)
        var = variables.get(var_path)
        if var is None or (layer is not None and (len(layer) > slot_rank(var_path) or
                                                  layer[0] >= cfg.num_layers or layer[1:] >= (cfg.num_experts,))):
            raise LoadError(f"{source}: tensor {name!r} does not belong to a {cfg.architecture} with this config")
        shape = tuple(var.get_value().shape)[0 if layer is None else len(layer):]
        fmt = plan.get(_role(var_path))
        if fmt is not None:  # the packed values' shape -> the weight's [..., out, in]
            shape = (*shape[:-1], shape[-1] * (2 if fmt.bits == 4 else 1))
        expected = shape if part is None else part_shapes(var_path[-2], cfg, shape,
                                                          _rows_axis(var_path, len(shape)))[part]
        window = None
        if fmt is None and getattr(load, "windowed", False):  # read only what this host's devices hold
            window = _window(region_of(var_path, layer), shape, expected)
            if window is not None:
                expected = _extent(window)
                load = functools.partial(load, window)
        entries.append((var_path, layer, part, name, load, source, expected))
    entries.sort(key=lambda e: (order[e[0]], () if e[1] is None else e[1], e[2] or 0))

    loaded: set[tuple] = set()
    pending: dict[tuple, dict[int, np.ndarray]] = {}  # fused parameters still waiting for some of their parts
    stacks: dict[tuple, np.ndarray] = {}  # stacked parameters being filled on the host, [layers, ...]
    filled: dict[tuple, set[int]] = {}  # their layers filled so far

    def local(p, array, layer=None):
        """`array` (all of a variable's tensor, or already its local region) -> its local region."""
        region = region_of(p, layer)
        if tuple(array.shape) == _extent(region):
            return array
        return array[tuple(slice(r.start, r.stop) for r in region)]

    def put(path, value):
        for p, array in _expand(path, value):
            var = variables[p]
            shape = tuple(var.get_value().shape)
            host = np.ascontiguousarray(local(p, array), dtype=var.get_value().dtype)
            var.set_value(place(host, shardings[p], shape, regions[p]))
            loaded.add(p)

    def check(name, source, array, expected):
        if tuple(array.shape) != expected:
            raise LoadError(f"{source}: tensor {name!r} has shape {tuple(array.shape)}, but the config implies "
                            f"{expected}")

    def prepare(path, value):
        """A checked tensor in its parameter's form: quantized in the plan's format, or float."""
        try:
            return convert(value, plan.get(_role(path)))
        except ValueError as e:
            raise LoadError(f"{'.'.join(map(str, path))}: {e}") from None

    def stack_of(path) -> np.ndarray:
        if path not in stacks:  # this host's region of every layer
            stacks[path], filled[path] = np.empty(_extent(regions[path]), variables[path].get_value().dtype), set()
        return stacks[path]

    def fill_stack(path, layer, value):
        for p, array in _expand(path, value):
            stack_of(p)[layer] = local(p, array, layer)

    def read(load):
        value = load()
        stats.add(value)
        return value

    def into_stack(load, path, layer, name, source, expected):
        """On a loader thread: read, check, convert and copy (casting) into the layer's slot; numpy copies
        without the GIL."""
        array = read(load)
        check(name, source, array, expected)
        fill_stack(path, layer, prepare(path, array))

    def jobs():
        for path, layer, part, name, load, source, expected in entries:
            if layer is not None and part is None:
                for p in _variables(path, plan.get(_role(path))):
                    stack_of(p)  # allocated here, on this thread, before a loader thread fills a slot
                load = functools.partial(into_stack, load, path, layer, name, source, expected)
            else:
                load = functools.partial(read, load)
            yield name, load, (path, layer, part, source, expected)

    def layer_done(path, layer):
        """`layer`'s slot filled: one expert's, or all of its experts' from one tensor (a GGUF file's)."""
        filled[path].update([layer] if len(layer) == slot_rank(path) else
                            [(*layer, j) for j in range(cfg.num_experts)])
        if len(filled[path]) == slots(path):
            for p in _variables(path, plan.get(_role(path))):
                put(p, stacks.pop(p))

    for name, future, (path, layer, part, source, expected) in _prefetched(jobs()):
        array = future.result()
        if layer is not None and part is None:
            layer_done(path, layer)  # already in its slot
            continue
        check(name, source, array, expected)
        array = prepare(path, array)
        if part is None:
            put(path, array)
            continue
        parts = pending.setdefault((path, layer), {})
        parts[part] = array
        if len(parts) == NUM_PARTS[path[-2]]:
            ordered = [parts[i] for i in range(len(parts))]
            if isinstance(ordered[0], QuantizedWeight):  # each array fused along its rows
                axis = _rows_axis(path, len(expected))  # every array's rows: data's, the scales', the offsets'
                fused = QuantizedWeight(*(None if f[0] is None else fuse(path[-2], list(f), cfg, axis)
                                          for f in zip(*ordered, strict=True)))
            else:
                fused = fuse(path[-2], ordered, cfg, _rows_axis(path, len(expected)))
            del pending[(path, layer)]
            if layer is None:
                put(path, fused)
            else:
                fill_stack(path, layer, fused)
                layer_done(path, layer)
    missing = []
    for path in variables:
        if path in loaded:
            continue
        if path[:2] == ("layers", "layer"):
            got = filled.get(path, set())
            if "experts" in path:
                at = path.index("experts") + 1
                missing += [".".join(map(str, ("layers", i, *path[2:at], j, *path[at:])))
                            for i in range(cfg.num_layers) for j in range(cfg.num_experts) if (i, j) not in got]
            else:
                missing += [".".join(map(str, ("layers", i, *path[2:]))) for i in range(cfg.num_layers)
                            if (i,) not in got]
        else:
            missing.append(".".join(map(str, path)))
    if missing:
        raise LoadError(f"checkpoint is missing {len(missing)} tensor(s) the config needs, e.g. {missing[:3]}")
    return nnx.merge(graphdef, state)
