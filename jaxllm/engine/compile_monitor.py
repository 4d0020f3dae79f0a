"""Counts JAX traces, XLA compilations and persistent-cache hits in this process, from jax.monitoring
events. The engine checks after warm-up that serving compiles nothing."""

from __future__ import annotations

import collections
import threading

import jax.monitoring

TRACE = "/jax/core/compile/jaxpr_trace_duration"
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"

_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()
_local = threading.local()  # per thread: persistent-cache hits (events arrive on the compiling thread)
_installed = False


def _on_duration(event: str, duration: float, **_kwargs) -> None:
    if event in (TRACE, BACKEND_COMPILE):
        with _lock:
            _counts[event] += 1


def _on_event(event: str, **_kwargs) -> None:
    if event == CACHE_HIT:
        _local.hits = getattr(_local, "hits", 0) + 1
        with _lock:
            _counts[event] += 1


def thread_cache_hits() -> int:
    """Persistent-cache hits of compiles run on the calling thread (after install())."""
    return getattr(_local, "hits", 0)


def install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


def snapshot() -> dict[str, int]:
    """Counts since install(): "traces" (jaxprs traced), "compiles" (executables obtained: XLA compilations
    plus persistent-cache loads) and "cache_hits" (the loads)."""
    with _lock:
        return {"traces": _counts[TRACE], "compiles": _counts[BACKEND_COMPILE], "cache_hits": _counts[CACHE_HIT]}
