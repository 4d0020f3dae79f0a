"""The LoRA adapters a server serves by name (vLLM's ``--lora-modules``): a request whose ``model`` is an adapter's
name runs with that adapter. Adapters come from ``JAXLLM_LORA_MODULES`` at start-up and, only with
``JAXLLM_ALLOW_RUNTIME_LORA_UPDATING=true``, from ``POST /v1/load_lora_adapter`` (and go with
``/v1/unload_lora_adapter``).

Every adapter is read and checked against the base model (`Frontend.check_lora`: its files, targets, rank and
shapes) before its name is served, so a bad one is refused with a clear message and nothing is registered; the
engine reads it again when a request first uses it. A path loaded at run time must lie inside one of
``JAXLLM_LORA_ROOTS`` when roots are configured (symbolic links resolved first: no escape by ``..`` or a link).
Each adapter gets a fresh ``lora_int_id`` (never reused), so an adapter reloaded under its old name from another
path is a different adapter to the engine: its own slot, its own prefix-cache pages."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterator

from jaxllm.lora.request import LoRARequest

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")  # an adapter's name: a model id, safe in logs and labels


class LoRAModuleError(ValueError):
    """A module that cannot be registered (the server answers `status`, naming `param`; at start-up the server
    does not start)."""

    def __init__(self, message: str, param: str = "lora_path", status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclasses.dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(text: str) -> tuple[LoRAModule, ...]:
    """``name=path,name2=path2``, or vLLM's JSON form: one object or a list of objects with ``name``, ``path`` and
    optionally ``base_model_name``. ValueError: a malformed value."""
    text = text.strip()
    if not text:
        return ()
    if text[0] in "[{":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"LoRA modules: not valid JSON ({e})") from None
        items = value if isinstance(value, list) else [value]
        modules = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or \
                    not isinstance(item.get("path"), str) or set(item) - {"name", "path", "base_model_name"}:
                raise ValueError(f"LoRA modules: expected objects with a name, a path and optionally a "
                                 f"base_model_name, got {item!r}")
            modules.append(LoRAModule(item["name"], item["path"], item.get("base_model_name")))
    else:
        modules = []
        for part in (p.strip() for p in text.split(",") if p.strip()):
            name, sep, path = part.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"LoRA modules: expected name=path, got {part!r}")
            modules.append(LoRAModule(name.strip(), path.strip()))
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"LoRA modules: a name is given twice in {names}")
    return tuple(modules)


class LoRARegistry:
    """name -> the `LoRARequest` requests with that ``model`` run with. Only request greenlets (one hub thread)
    touch it; `check` (reading the adapter's files) may run on a worker thread."""

    def __init__(self, base_name: str, check: Callable[[LoRARequest], None], *, roots: tuple[str, ...] = (),
                 allow_runtime: bool = False):
        self.base_name, self.check = base_name, check
        self.roots = tuple(os.path.realpath(r) for r in roots)
        self.allow_runtime = allow_runtime
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    def __iter__(self) -> Iterator[LoRARequest]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self._by_name.get(name)

    def prepare(self, name: str, path: str, runtime: bool, replacing: bool = False) -> LoRARequest:
        """The request a new adapter would be served as, checked (LoRAModuleError): its name is free (or,
        `replacing`, taken), its path inside the roots (runtime loads), its files an adapter this base can serve.
        Nothing is registered."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise LoRAModuleError(f"LoRA adapter name {name!r}: use 1 to 128 letters, digits and ._:/@+-",
                                  "lora_name")
        if name == self.base_name:
            raise LoRAModuleError(f"LoRA adapter name {name!r} is the base model's", "lora_name")
        if name in self._by_name and not replacing:
            raise LoRAModuleError(f"the LoRA adapter {name!r} is already loaded", "lora_name")
        if not isinstance(path, str) or not path or "\x00" in path:
            raise LoRAModuleError(f"LoRA adapter {name!r}: lora_path must be a folder's path")
        if runtime and self.roots:
            real = os.path.realpath(path)
            if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in self.roots):
                raise LoRAModuleError(f"LoRA adapter {name!r}: lora_path is outside the folders adapters may be "
                                      f"loaded from (JAXLLM_LORA_ROOTS)")
            path = real  # what was checked is what the engine reads, even if a link changes later
        request = LoRARequest(name, self._next_id, path, self.base_name)
        self._next_id += 1  # even if it is refused: two loads checked at once never share an id
        try:
            self.check(request)
        except ValueError as e:  # LoRAError (an InvalidRequestError) and friends: the message says what is wrong
            raise LoRAModuleError(str(e)) from None
        return request

    def add(self, request: LoRARequest) -> None:
        """Registers a request `prepare` made (LoRAModuleError if its name was taken meanwhile)."""
        if request.lora_name in self._by_name:
            raise LoRAModuleError(f"the LoRA adapter {request.lora_name!r} is already loaded", "lora_name")
        self._by_name[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest:
        """Requests already running keep their adapter; new ones naming it get 404."""
        request = self._by_name.pop(name, None) if isinstance(name, str) else None
        if request is None:
            raise LoRAModuleError(f"the LoRA adapter {name!r} is not loaded", "lora_name", 404)
        return request
