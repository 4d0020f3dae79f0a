"""Data parallelism on the API side: one handle over D engine cores (one per rank, each on its own devices),
with the interface of a single core's client, choosing a rank for each request.

The choice is made in each API worker with no shared state, so it must agree between workers where it matters:
- prefix affinity: a prompt with at least one full KV page has a preferred rank, a hash of its first pages
  (up to `AFFINITY_PAGES`) and its cache salt, the same in every process; requests that share those pages meet
  on one rank and hit its prefix cache;
- load: the preferred rank is left for the least loaded one when its load (unfinished requests, as its core
  last reported, plus what this worker sent since) exceeds the least loaded rank's by more than `slack`
  requests; a prompt with no full page goes to the least loaded rank (ties: in turn)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from jaxllm.engine.core_client import EngineCoreClient
from jaxllm.engine.core_protocol import CoreInfo
from jaxllm.engine.engine_loop import EngineDeadError
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

AFFINITY_PAGES = 4


def preferred_rank(ids: list[int], cache_salt: str | None, page_size: int, size: int) -> int | None:
    pages = min(AFFINITY_PAGES, len(ids) // page_size)
    if pages == 0:
        return None
    h = hashlib.blake2b(np.asarray(ids[:pages * page_size], np.int64).tobytes(), digest_size=8)
    h.update((cache_salt or "").encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little") % size


def choose_rank(loads: list[int], preferred: int | None, slack: int, start: int = 0) -> int:
    """Ties between the least loaded ranks go to the first at or after `start` (callers rotate it)."""
    least = min(range(len(loads)), key=lambda r: (loads[r], (r - start) % len(loads)))
    if preferred is not None and loads[preferred] - loads[least] <= slack:
        return preferred
    return least


class DataParallelClient:
    def __init__(self, addresses: list[str], secret: str, *, timeout_s: float = 600.0,
                 tokenizer_loader: Callable[[CoreInfo], object] | None = None):
        first = EngineCoreClient(addresses[0], secret, timeout_s=timeout_s, tokenizer_loader=tokenizer_loader)
        self.ranks = [first] + [EngineCoreClient(a, secret, timeout_s=timeout_s, tokenizer_loader=lambda info: None)
                                for a in addresses[1:]]
        self.frontend = first.frontend  # every rank serves the same model: one frontend
        self.page_size = first.info.page_size
        self.slack = max(2, first.info.max_num_seqs // 4)
        self.owner: dict[str, int] = {}
        self.routed = [0] * len(self.ranks)  # requests this worker sent to each rank
        self._turn = 0  # where ties between equally loaded ranks start

    @property
    def alive(self) -> bool:
        return all(r.alive for r in self.ranks)

    @property
    def error(self) -> str | None:
        return next((r.error for r in self.ranks if r.error), None)

    @property
    def capacity(self) -> int:
        return sum(r.capacity for r in self.ranks)

    @property
    def rank_stats(self) -> list[dict]:
        return [r.stats for r in self.ranks]

    @property
    def stats(self) -> dict:
        per = self.rank_stats
        total = {k: _add([s.get(k, 0) for s in per]) for k in per[0] if k != "kv_cache_usage"}
        total["kv_cache_usage"] = 1.0 - total["num_free_pages"] / max(1, total["num_pages"])
        return total

    def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                    on_output: Callable[[RequestOutput | Exception], None], cache_salt: str | None = None, *,
                    prepared: tuple[str | None, list[int]] | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        if not self.alive:
            raise EngineDeadError(self.error or "an engine core is not connected")
        prepared = prepared or self.frontend.prepare_prompt(prompt, params, cache_salt)
        preferred = preferred_rank(prepared[1], cache_salt, self.page_size, len(self.ranks))
        rank = choose_rank([r.load for r in self.ranks], preferred, self.slack, self._turn)
        self._turn = (rank + 1) % len(self.ranks)

        def forward(out):
            if isinstance(out, Exception) or out.finished:
                self.owner.pop(request_id, None)
            on_output(out)

        self.owner[request_id] = rank
        self.routed[rank] += 1
        try:
            self.ranks[rank].add_request(request_id, None, params, forward, cache_salt, prepared=prepared,
                                         lora_request=lora_request)
        except Exception:
            self.owner.pop(request_id, None)
            raise

    def abort_request(self, request_id: str) -> None:
        rank = self.owner.get(request_id)
        if rank is not None:
            self.ranks[rank].abort_request(request_id)

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        for r in self.ranks:
            r.stop(drain_timeout_s)


def _add(values: list) -> int | float | list | dict:
    """The ranks' values of a counter added up; a list of counters (by position) element by element, a dict of
    them (by key) key by key."""
    if values and isinstance(values[0], dict):
        keys = {k for v in values if isinstance(v, dict) for k in v}
        return {k: sum(v.get(k, 0) for v in values if isinstance(v, dict)) for k in sorted(keys)}
    if values and isinstance(values[0], list):
        width = max(len(v) for v in values if isinstance(v, list))
        return [sum(v[i] for v in values if isinstance(v, list) and i < len(v)) for i in range(width)]
    return sum(values)
