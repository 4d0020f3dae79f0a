"""Orbax save/restore of converted parameters, so a restart skips GGUF dequantization or safetensors
conversion. A checkpoint folder holds ``params/`` (orbax) and ``jaxllm_config.json``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxllm.config import ModelConfig, RopeConfig
from jaxllm.kernels import Kernels
from jaxllm.loading.errors import LoadError
from jaxllm.loading.weights import abstract_model
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.sharding import mesh_rules, named_sharding
from jaxllm.tokenizer.tokenizer import Tokenizer
from pallas_kernels.quantized_matmul import QuantFormat

CONFIG_FILE = "jaxllm_config.json"
QUANT_FILE = "jaxllm_quantization.json"  # the weights saved quantized and their formats (absent: all float)


def _checkpointer():
    # Imported here, not with this module: importing orbax is a visible part of every start that never uses it.
    import orbax.checkpoint as ocp

    # Uncompressed: restoring is then a plain read.
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def is_orbax_checkpoint(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and (path / "params").is_dir()


def save_checkpoint(model: LlamaForCausalLM, path: str | Path, tokenizer: Tokenizer | None = None) -> None:
    """Saves the parameters, the config and (if given) the tokenizer in Hugging Face's file layout."""
    from jaxllm.models.weight_layout import has_interleaved
    if has_interleaved(model):
        raise ValueError("this model's weights are interleaved for the CPU int8 kernel (an engine's model): save "
                         "the model as `load_model` returns it")
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    import orbax.checkpoint as ocp

    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if model.stacked:  # checkpoints keep one entry per layer, whichever way the model holds them
        stacked = params["layers"]["layer"]
        params["layers"] = {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(model.config.num_layers)}
    with _checkpointer() as ckpt:
        ckpt.save(path / "params", args=ocp.args.PyTreeSave(params), force=True)
    (path / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(model.config), indent=1))
    quant = {role: dataclasses.asdict(fmt) for role, fmt in model.quant_plan.items()}
    if quant:
        (path / QUANT_FILE).write_text(json.dumps(quant, indent=1))
    elif (path / QUANT_FILE).exists():
        (path / QUANT_FILE).unlink()
    if tokenizer is not None:
        tokenizer.backend.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": tokenizer.id_to_token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None,
            "eos_token": tokenizer.id_to_token(tokenizer.eos_token_ids[0]) if tokenizer.eos_token_ids else None,
            "chat_template": tokenizer.chat_template.source if tokenizer.chat_template else None,
        }, indent=1))


def load_checkpoint_config(path: Path) -> ModelConfig:
    def frozen(fields: dict) -> dict:  # JSON's lists back to the configs' tuples
        return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}

    raw = frozen(json.loads((path / CONFIG_FILE).read_text()))
    for name in ("rope", "local_rope"):
        if raw.get(name) is not None:
            raw[name] = RopeConfig(**frozen(raw[name]))
    return ModelConfig(**raw)


def restore_checkpoint(path: str | Path, *, dtype, kernels: Kernels, mesh: Mesh, experts_over_tp: bool = False
                       ) -> LlamaForCausalLM:
    path = Path(path).absolute()
    if not is_orbax_checkpoint(path):
        raise LoadError(f"{path}: not a jaxllm orbax checkpoint (no {CONFIG_FILE} and params/)")
    cfg = load_checkpoint_config(path)
    plan = {role: QuantFormat(**fmt) for role, fmt in json.loads((path / QUANT_FILE).read_text()).items()} \
        if (path / QUANT_FILE).is_file() else {}
    # saved layer by layer
    graphdef, state = nnx.split(abstract_model(cfg, dtype, kernels, stacked=False, quantization=plan))
    rules = mesh_rules(cfg, mesh, experts_over_tp)
    target = nnx.to_pure_dict(jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype,
                                       sharding=named_sharding(mesh, rules, v.get_metadata()["axes"])),
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    import orbax.checkpoint as ocp

    with _checkpointer() as ckpt:
        try:
            restored = ckpt.restore(path / "params", args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
        except Exception as e:
            raise LoadError(f"{path}: cannot restore parameters ({e})") from None
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
