"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): adapters added and removed while serving, only
with JAXLLM_ALLOW_RUNTIME_LORA_UPDATING=true. An adapter is read and checked (off the hub thread) before its name
is served; a refused one leaves nothing behind."""

from __future__ import annotations

import logging

from flask import Blueprint, Response

from server.bridge import offload
from server.errors import APIError
from server.lora_modules import LoRAModuleError
from server.openai_routes import state
from server.parsing import parse
from server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

bp = Blueprint("lora", __name__)
logger = logging.getLogger("jaxllm.server")
CHECK_COST_CHARS = 1 << 20  # reading an adapter's files is long work: always off the hub thread


def _registry():
    st = state()
    if not st.settings.allow_runtime_lora_updating:
        raise APIError(400, "loading and unloading LoRA adapters at run time is off "
                       "(JAXLLM_ALLOW_RUNTIME_LORA_UPDATING=true turns it on)", code="lora_updating_disabled")
    return st.loras


def _text(message: str) -> Response:
    return Response(message, mimetype="text/plain")


@bp.post("/v1/load_lora_adapter")
def load_lora_adapter():
    registry = _registry()
    req = parse(LoadLoRAAdapterRequest)
    replaced = req.load_inplace and registry.get(req.lora_name) is not None
    try:
        if replaced:  # checked as new under a free name first: a refused replacement keeps the old adapter
            request = offload(CHECK_COST_CHARS, registry.prepare, req.lora_name, req.lora_path, True, True)
            registry.remove(req.lora_name)
        else:
            request = offload(CHECK_COST_CHARS, registry.prepare, req.lora_name, req.lora_path, True)
        registry.add(request)
    except LoRAModuleError as e:
        raise APIError(e.status, str(e), param=e.param) from None
    logger.info("LoRA adapter %s loaded (id %d)", request.lora_name, request.lora_int_id)
    return _text(f"Success: LoRA adapter '{req.lora_name}' {'replaced' if replaced else 'added'} successfully.")


@bp.post("/v1/unload_lora_adapter")
def unload_lora_adapter():
    registry = _registry()
    req = parse(UnloadLoRAAdapterRequest)
    known = registry.get(req.lora_name)
    if known is not None and req.lora_int_id not in (None, known.lora_int_id):
        raise APIError(404, f"the LoRA adapter {req.lora_name!r} has id {known.lora_int_id}, not "
                       f"{req.lora_int_id}", param="lora_int_id")
    try:
        registry.remove(req.lora_name)
    except LoRAModuleError as e:
        raise APIError(e.status, str(e), param=e.param) from None
    logger.info("LoRA adapter %s unloaded", req.lora_name)
    return _text(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
