"""Runs the engine in a background OS thread: requests join the running batch at the next step and stream
their outputs back as they are produced.

`add_request` and `abort_request` are thread-safe: they only enqueue into a C-level ``_queue.SimpleQueue``,
which gevent does not patch, and the engine thread applies them between steps. Under gunicorn's gevent
worker ``threading.Thread`` is a greenlet, so the loop is started with the original
``_thread.start_new_thread``: a JAX step must not block the event loop.
"""

from __future__ import annotations

import _queue
import logging
import threading
import time
import traceback
from collections.abc import Callable

from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger("jaxllm.engine")


def gevent_active() -> bool:
    """Whether this process runs under gevent's monkey-patching (a gunicorn gevent worker)."""
    try:
        from gevent import monkey
    except ImportError:
        return False
    return monkey.is_module_patched("socket")


def start_os_thread(target: Callable[[], None]) -> None:
    try:
        from gevent import monkey
    except ImportError:
        monkey = None
    if monkey is not None and monkey.is_module_patched("threading"):
        monkey.get_original("_thread", "start_new_thread")(target, ())
    else:
        threading.Thread(target=target, name="jaxllm-engine", daemon=True).start()


class EngineDeadError(RuntimeError):
    pass


class EngineLoop:
    """on_death: called on the engine thread once the engine has died, after every in-flight request got its
    EngineDeadError (a server uses it to exit its worker so a fresh one is started). flush: called on the engine
    thread after each iteration's output callbacks (the requests it applied, then its step), so that a caller
    can hand a step's outputs on together (an engine-core process sends one message per client per step)."""

    def __init__(self, engine: LLMEngine, on_death: Callable[[], None] | None = None,
                 flush: Callable[[], None] | None = None, *, thread: bool = True):
        self.engine = engine
        self.frontend = engine.frontend  # `EngineClient`
        self.on_death = on_death
        self.flush = flush
        self._inbox: _queue.SimpleQueue = _queue.SimpleQueue()
        self._stopping = False
        self.stopped = False
        self.error: str | None = None
        # The engine's counters for other threads (metrics, health, drain): a fresh dict that only the engine
        # thread writes, once per loop iteration, and never mutates, so readers need no lock.
        self.stats: dict = engine.stats()
        if thread:
            start_os_thread(self._run)

    @property
    def alive(self) -> bool:
        return self.error is None and not self.stopped

    @property
    def rank_stats(self) -> list[dict]:
        """Per engine (one here; one per data-parallel rank on an API server using several)."""
        return [self.stats]

    @property
    def capacity(self) -> int:
        """Requests in flight beyond which a server refuses new ones: the running batch plus the waiting queue."""
        cfg = self.engine.config
        return cfg.max_num_seqs + cfg.max_waiting_requests

    def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                    on_output: Callable[[RequestOutput], None], cache_salt: str | None = None, *,
                    prepared: tuple[str | None, list[int]] | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validation errors (InvalidRequestError: bad prompt or parameters) are raised here, in the caller's
        thread, so nothing a client sends can raise inside the engine thread. prepared: the result of
        `engine.prepare_prompt(prompt, params, cache_salt)`, when the caller already ran it (e.g. on a worker
        thread)."""
        if not self.alive:
            raise EngineDeadError(self.error or "the engine is stopped")
        prepared = prepared or self.engine.prepare_prompt(prompt, params, cache_salt)
        self._inbox.put(("add", (request_id, prepared, params, on_output, cache_salt, lora_request)))

    def abort_request(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Stops after the in-flight requests finish, or after drain_timeout_s (they are then aborted)."""
        deadline = time.monotonic() + drain_timeout_s
        while self.alive and self.stats.get("num_requests", 0) and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stopping = True
        self._inbox.put(("stop", None))
        while not self.stopped and self.error is None:
            time.sleep(0.01)

    def _apply(self, kind: str, arg) -> None:
        if kind == "add":
            request_id, prepared, params, on_output, cache_salt, lora_request = arg
            try:
                self.engine.add_request(request_id, prepared[1], params, on_output, prepared=prepared,
                                        cache_salt=cache_salt, lora_request=lora_request)
            except Exception as e:  # e.g. a duplicate request id: only this request is refused
                logger.warning("request %s rejected: %s", request_id, e)
                try:
                    on_output(e)
                except Exception:
                    logger.exception("request %s: its output callback failed", request_id)
        elif kind == "abort":
            self.engine.abort_request(arg)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self.run_once(block=True)
            self.shutdown()
        except Exception:  # the engine is dead: fail every request instead of leaving it hanging
            self.die(traceback.format_exc())
        finally:
            self.stopped = True

    def run_once(self, block: bool) -> None:
        """One iteration: applies what was handed in (idle and `block`: waits for it), steps once if anything
        is unfinished, flushes the outputs and publishes the stats. Raises if the engine failed (see `die`). The
        loop's own thread calls it; an owner that runs the loop on its own thread (an engine-core process's
        main thread, which also owns its sockets) calls it instead of starting one."""
        busy = self.engine.has_unfinished_requests()
        try:  # idle: sleep until a request arrives; busy: only pick up what is already there
            kind, arg = self._inbox.get() if block and not busy else self._inbox.get_nowait()
        except _queue.Empty:
            kind = None
        while kind is not None:
            if kind == "stop":
                self._stopping = True
                break
            self._apply(kind, arg)
            try:
                kind, arg = self._inbox.get_nowait()
            except _queue.Empty:
                kind = None
        if not self._stopping and self.engine.has_unfinished_requests():
            self.engine.step()
        self._flush()
        self.stats = self.engine.stats()

    def shutdown(self) -> None:
        """Aborts whatever is still unfinished (each request gets its final output); the loop is then stopped."""
        self._refuse_queued("the engine is stopped", apply_aborts=True)
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        self._flush()
        self.stats = self.engine.stats()
        self.stopped = True

    def die(self, error: str) -> None:
        """The engine failed (`error`: the traceback): every unfinished request, applied or queued, gets an
        EngineDeadError, then `on_death` runs."""
        self.error = error
        logger.error("engine loop died:\n%s", self.error)
        for request in list(self.engine.requests.values()):
            if request.on_output:
                try:
                    request.on_output(EngineDeadError("the engine died"))
                except Exception:
                    logger.exception("request %s: its output callback failed", request.request_id)
        self._refuse_queued("the engine died", apply_aborts=False)
        self._flush()
        if self.on_death is not None:
            self.on_death()

    def _flush(self) -> None:
        if self.flush is not None:
            try:
                self.flush()
            except Exception:
                logger.exception("flushing the step's outputs failed")

    def _refuse_queued(self, why: str, apply_aborts: bool) -> None:
        """Requests handed in but not yet applied get an EngineDeadError (they must not wait forever); queued
        aborts are applied when the engine still works."""
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except _queue.Empty:
                return
            if kind == "add":
                try:
                    arg[3](EngineDeadError(why))
                except Exception:
                    logger.exception("request %s: its output callback failed", arg[0])
            elif kind == "abort" and apply_aborts:
                self._apply(kind, arg)
