"""An EAGLE-3 head from a folder or hub id (config.json and safetensors, as vLLM and sglang load them), placed on the
target's mesh. Tensor names as those checkpoints ship them: ``fc``, ``midlayer.*`` (or ``layers.0.*``, with or
without a ``model.`` prefix), ``norm``, ``lm_head``, ``d2t`` and optionally ``embed_tokens`` (``t2d`` is not used).
A folder with only ``pytorch_model.bin`` is refused: convert it to safetensors (the hub's own weights format)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxllm.config import ConfigError
from jaxllm.loading.errors import LoadError
from jaxllm.loading.fused import fuse
from jaxllm.loading.hf import hf_tensors, read_config_json
from jaxllm.loading.resolve import resolve_model
from jaxllm.loading.weights import place
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.sharding import mesh_rules, named_sharding
from jaxllm.speculative.eagle3_head import Eagle3Config, Eagle3Head

FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
IGNORED = {"t2d"}  # the target -> draft vocabulary mask: drafting only maps draft ids to the target's


def head_path(name: str) -> tuple[tuple[str, ...], tuple[str, int] | None] | None:
    """A checkpoint tensor's name -> (the head's parameter path, (fused parameter, part) or None); None: unused."""
    parts = name.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    if parts[:2] == ["layers", "0"]:
        parts = ["midlayer", *parts[2:]]
    if parts[0] in IGNORED:
        return None
    if parts == ["d2t"]:
        return ("d2t",), None
    if parts[0] == "embed_tokens":
        return ("embed_tokens", "embedding"), None
    if len(parts) >= 2 and parts[-2] in FUSED:
        into, part = FUSED[parts[-2]]
        return (*parts[:-2], into, parts[-1]), (into, part)
    return tuple(parts), None


def load_eagle3_head(name: str, target: LlamaForCausalLM, *, mesh: jax.sharding.Mesh, revision: str | None = None,
                     download_dir: str | None = None) -> Eagle3Head:
    """The head `name` for `target` (its dtype and kernels; its embedding when the head ships none). Raises
    ConfigError / LoadError with one line."""
    folder = resolve_model(name, revision=revision, download_dir=download_dir).path
    if not folder.is_dir():
        raise LoadError(f"{name}: an EAGLE-3 head is a folder with config.json and safetensors weights")
    raw = read_config_json(folder, "an EAGLE-3 head folder")
    try:
        cfg = Eagle3Config.from_hf(raw, target.config)
    except ConfigError as e:
        raise ConfigError(f"speculative_config: {name}: {e}") from None
    t = target.config
    if cfg.layer.vocab_size != t.vocab_size or cfg.target_hidden_size != t.hidden_size:
        raise ConfigError(f"speculative_config: the EAGLE-3 head {name} is for a target of {cfg.layer.vocab_size} "
                          f"tokens and hidden size {cfg.target_hidden_size}, not this one's ({t.vocab_size}, "
                          f"{t.hidden_size})")
    if not list(folder.glob("*.safetensors")) and (folder / "pytorch_model.bin").is_file():
        raise LoadError(f"{name}: only pytorch_model.bin; convert it to safetensors")
    tensors = {n: load for n, load, _ in hf_tensors(folder)}
    shared = None if any(head_path(n) == (("embed_tokens", "embedding"), None) for n in tensors) else \
        target.embed_tokens
    head = Eagle3Head(cfg, dtype=target.dtype, kernels=target.kernels, rngs=None, embed_tokens=shared)
    graphdef, state = nnx.split(head)
    variables = {tuple(str(p) for p in path): var for path, var in nnx.to_flat_state(state)}
    if shared is not None:  # the target's arrays, placed already
        variables = {p: v for p, v in variables.items() if p[0] != "embed_tokens"}
    rules = {**mesh_rules(cfg.layer, mesh), "vocab": None}
    parts: dict[tuple[str, ...], dict[int, np.ndarray]] = {}
    values: dict[tuple[str, ...], np.ndarray] = {}
    for n, load in tensors.items():
        mapped = head_path(n)
        if mapped is None:
            continue
        p, fused = mapped
        if p not in variables:
            raise LoadError(f"{name}: tensor {n!r} is not part of an EAGLE-3 head")
        if fused is None:
            values[p] = np.asarray(load())
        else:
            got = parts.setdefault(p, {})
            got[fused[1]] = np.asarray(load())
            if len(got) == (3 if fused[0] == "qkv_proj" else 2):
                values[p] = fuse(fused[0], [got[i] for i in range(len(got))], cfg.layer)
    if missing := sorted(".".join(p) for p in variables if p not in values):
        raise LoadError(f"{name}: the checkpoint is missing {len(missing)} tensor(s) of an EAGLE-3 head, e.g. "
                        f"{missing[:3]}")
    for p, var in variables.items():
        value, expected = values[p], var.get_value()
        if tuple(value.shape) != tuple(expected.shape):
            raise LoadError(f"{name}: tensor {'.'.join(p)} has shape {tuple(value.shape)}, but the config implies "
                            f"{tuple(expected.shape)}")
        sharding = named_sharding(mesh, rules, var.get_metadata()["axes"])
        var.set_value(place(np.ascontiguousarray(value, dtype=expected.dtype), sharding))
    return nnx.merge(graphdef, state)
