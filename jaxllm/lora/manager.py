"""Which adapters are where: loaded and checked adapters on the host (an LRU of `max_cpu_loras`), and the
device's `max_loras` slots, each held by the running sequences that use it. The scheduler asks for a slot when it
admits a sequence with an adapter (`acquire`: None when every slot is held by others, and the sequence waits) and
gives it back when the sequence finishes or is preempted (`release`). A slot held by no one keeps its adapter
until another needs the slot (least recently used first), so an adapter that comes back is not written again.

Writing an adapter replaces the slot's rows of every table among the runner's parameters, through one update
executable per table shape compiled at start-up: swapping adapters never compiles."""

from __future__ import annotations

import functools
import re
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.engine.sequence import Sequence
from jaxllm.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from jaxllm.lora.layout import pack_layer
from jaxllm.lora.request import LoRARequest
from jaxllm.lora.spec import LoRASpec


@functools.partial(jax.jit, static_argnums=3)  # no donation: a step in flight may still read the old table
def _set_slot(table, value, slot, axis: int):  # table [S, ...] (axis 0) or [L, S, ...] (axis 1); value: no slot axis
    index = tuple(slot if i == axis else 0 for i in range(table.ndim))
    return jax.lax.dynamic_update_slice(table, jnp.expand_dims(value.astype(table.dtype), axis), index)


class LoRATables:
    """The runner's parameters that are LoRA tables: (param index, layer or None for a stacked table, linear, a|b)."""

    def __init__(self, params: list, paths: list[str]):
        self.params = params  # the runner's list: written in place (one writer: the manager)
        self.entries: list[tuple[int, int | None, str, str]] = []
        for i, path in enumerate(paths):
            m = re.search(r"layers(?:\.(\d+))?(?:\.layer)?\.(self_attn|mlp)\.(\w+)\.lora_([ab])", path)
            if m:
                layer = int(m.group(1)) if m.group(1) is not None else None
                self.entries.append((i, layer, f"{m.group(2)}.{m.group(3)}", m.group(4)))

    @property
    def linears(self) -> set[str]:
        return {linear for _, _, linear, _ in self.entries}

    def write(self, slot: int, packed: list[dict[str, tuple[np.ndarray, np.ndarray]]]) -> None:
        """packed: per layer, linear -> (a, b) (`pack_layer`)."""
        for i, layer, linear, which in self.entries:
            k = 0 if which == "a" else 1
            value = np.stack([p[linear][k] for p in packed]) if layer is None else packed[layer][linear][k]
            old = self.params[i]
            new = _set_slot(old, value, np.int32(slot), 0 if layer is not None else 1)
            # as the step's executables were compiled for (a no-op unless the update moved a split table's shards)
            self.params[i] = jax.device_put(new, old.sharding)

    def warm_up(self, cfg: ModelConfig, rank: int) -> None:
        """Compiles each table shape's update now (writing zeros into slot 0, which holds nothing yet)."""
        empty = LoRAAdapter("", 1, {})
        self.write(0, [pack_layer(empty, cfg, layer, rank) for layer in range(cfg.num_layers)])


class LoRAManager:
    def __init__(self, cfg: ModelConfig, tables: LoRATables, *, max_loras: int, max_rank: int,
                 max_cpu_loras: int | None = None):
        self.cfg, self.tables = cfg, tables
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.spec = LoRASpec.of(cfg, max_rank, tables.linears)  # what adapters are checked against
        self.host: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()  # LRU: last = most recent
        self.slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self.users = [0] * max_loras  # running sequences holding each slot
        self.owner: list[int | None] = [None] * max_loras  # lora_int_id in each slot
        self.idle: OrderedDict[int, None] = OrderedDict.fromkeys(range(max_loras))  # held by no one, LRU first
        tables.warm_up(cfg, max_rank)

    def prepare(self, request: LoRARequest) -> LoRAAdapter:
        """Loads and checks the adapter (LoRAError if it cannot be served); kept on the host."""
        known = self.host.get(request.lora_int_id)
        if known is not None:
            if known[0] != request:
                raise LoRAError(f"lora_int_id {request.lora_int_id} is already adapter {known[0].lora_name!r} "
                                f"({known[0].lora_path!r})")
            self.host.move_to_end(request.lora_int_id)
            return known[1]
        adapter = load_adapter(request.lora_name, request.lora_path, self.spec)
        self.host[request.lora_int_id] = (request, adapter)
        while len(self.host) > self.max_cpu_loras:  # the least recently used that is not on the device
            victim = next((k for k in self.host if k not in self.slot_of), None)
            if victim is None:
                break
            del self.host[victim]
        return adapter

    def acquire(self, seq: Sequence) -> bool:
        """A slot for seq's adapter (written now if it is not in one); False when every slot is held by others.
        A sequence without an adapter always gets True."""
        request = seq.request.lora_request
        if request is None or seq.lora_slot is not None:
            return True
        slot = self.slot_of.get(request.lora_int_id)
        if slot is None:
            if not self.idle:
                return False
            slot = next(iter(self.idle))
            adapter = self.prepare(request)
            if self.owner[slot] is not None:
                del self.slot_of[self.owner[slot]]
            self.tables.write(slot, [pack_layer(adapter, self.cfg, layer, self.max_rank)
                                     for layer in range(self.cfg.num_layers)])
            self.owner[slot] = request.lora_int_id
            self.slot_of[request.lora_int_id] = slot
        self.idle.pop(slot, None)
        self.users[slot] += 1
        seq.lora_slot = slot
        return True

    def release(self, seq: Sequence) -> None:
        slot = seq.lora_slot
        if slot is None:
            return
        seq.lora_slot = None
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self.idle[slot] = None  # most recently used last

    @property
    def running(self) -> dict[str, int]:
        """Adapter name -> running sequences (vLLM's lora_requests_info)."""
        names = {rid: req.lora_name for rid, (req, _) in self.host.items()}
        return {names.get(self.owner[s], str(self.owner[s])): n for s, n in enumerate(self.users) if n}
