"""A PEFT LoRA adapter as PEFT saves it (``adapter_config.json`` and ``adapter_model.safetensors``), read and
checked against the base model: its targets among the decoder's projections (q/k/v/o, gate/up/down), its rank
within ``max_lora_rank``, every tensor's shape the base's, and the scale (``lora_alpha / r``, rsLoRA's
``lora_alpha / sqrt(r)``) folded into B. What it cannot serve (embeddings or the LM head as targets, DoRA,
modules saved whole, trained biases, per-module rank or alpha patterns) is refused by name."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from jaxllm.errors import InvalidRequestError
from jaxllm.lora.spec import LoRASpec
from jaxllm.models.lora import TARGETS

_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served on this base (the server answers 400)."""

    def __init__(self, message: str):
        super().__init__(message, "lora_request")


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    name: str
    rank: int
    # (layer, PEFT module name) -> (A [r, in] float32, B [out, r] float32 with the scale folded in)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def targets(self) -> set[str]:
        return {m for _, m in self.weights}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(name: str, path: str | Path, spec: LoRASpec) -> LoRAAdapter:
    """Reads and checks the adapter at `path` (a folder) against the base's `spec`; LoRAError if it cannot be
    served."""
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_config.json in {str(folder)!r}")
    if not weights_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {str(folder)!r}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: unreadable adapter_config.json ({e})") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise LoRAError(f"LoRA adapter {name!r}: DoRA adapters are not supported")
    if config.get("modules_to_save"):
        raise LoRAError(f"LoRA adapter {name!r}: modules saved whole are not supported: {config['modules_to_save']}")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: trained biases (bias={config['bias']!r}) are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoRAError(f"LoRA adapter {name!r}: per-module rank_pattern / alpha_pattern are not supported")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unsupported = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in TARGETS)
    if unsupported:
        raise LoRAError(f"LoRA adapter {name!r}: unsupported target modules {unsupported}; supported: "
                        f"{sorted(TARGETS)}")
    r = int(config.get("r", 0))
    if r < 1:
        raise LoRAError(f"LoRA adapter {name!r}: rank r={r}")
    if r > spec.max_rank:
        raise LoRAError(f"LoRA adapter {name!r}: rank {r} is above max_lora_rank {spec.max_rank}")
    alpha = float(config.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    try:
        tensors = load_file(str(weights_file))
    except Exception as e:  # noqa: BLE001 (a corrupt file is the adapter's fault: one clear message)
        raise LoRAError(f"LoRA adapter {name!r}: unreadable adapter_model.safetensors ({e})") from None
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _TENSOR.match(key)
        if m is None or m.group(3) not in TARGETS:
            raise LoRAError(f"LoRA adapter {name!r}: unsupported tensor {key!r}")
        layer = int(m.group(1))
        if layer >= spec.num_layers:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} in {key!r}, the base has {spec.num_layers}")
        pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = value
    missing = sorted({m for _, m in pairs} - set(spec.shapes))
    if missing:
        raise LoRAError(f"LoRA adapter {name!r}: this model has no LoRA-capable {missing}")
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{set(ab).pop()} alone")
        a, b = ab["A"].astype(np.float32), ab["B"].astype(np.float32)
        out, inp = spec.shapes[module]
        if a.shape != (r, inp) or b.shape != (out, r):
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} has A {list(a.shape)} and B "
                            f"{list(b.shape)}; this base needs [{r}, {inp}] and [{out}, {r}]")
        weights[(layer, module)] = (a, b * np.float32(scale))
    if not weights:
        raise LoRAError(f"LoRA adapter {name!r}: no LoRA weights in adapter_model.safetensors")
    return LoRAAdapter(name, r, weights)
