"""An API server's handle on an engine-core process: the same interface as the in-process `EngineLoop`
(`EngineClient`), over ZeroMQ (see `core_protocol`).

`frontend` is built from the limits the core sends at the handshake and the model's tokenizer,
loaded here: prompts are tokenized and validated in this process. One reader (a greenlet under gevent, else a
daemon thread) receives outputs and hands them to each request's callback, as the engine made them. When the
core's connection drops (the process died) every unfinished request gets an `EngineDeadError` at once and
`alive` turns false; when a core is listening on the address again, the client passes the handshake again and
serves."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

from jaxllm.engine import core_protocol as proto
from jaxllm.engine.engine_loop import EngineDeadError, gevent_active
from jaxllm.engine.frontend import Frontend, PreparedPrompt
from jaxllm.errors import EngineBusyError, InvalidRequestError
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import PoolingRequestOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger("jaxllm.engine_client")
HEARTBEAT_TIMEOUT_S = 10.0  # no stats for this long from a connected core: it is hung, treat it as dead
HANDSHAKE_RETRY_S = 1.0


class EngineCoreRefused(RuntimeError):
    pass


@dataclasses.dataclass
class _Request:
    """A request sent to the core: what its outputs are rebuilt with, and who gets them."""
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    on_output: Callable[[RequestOutput | PoolingRequestOutput | Exception], None]


class EngineCoreClient:
    def __init__(self, address: str, secret: str, *, timeout_s: float = 600.0,
                 tokenizer_loader: Callable[[proto.CoreInfo], object] | None = None):
        self.green = gevent_active()
        if self.green:
            import zmq.green as zmq
        else:
            import zmq
        self.zmq = zmq
        self.address, self.secret = address, secret
        self.ctx = zmq.Context()
        self._lock = contextlib.nullcontext() if self.green else threading.Lock()
        self._connect()
        self.requests: dict[str, _Request] = {}
        self.stats: dict = {}
        self.sent_since_stats: set[str] = set()
        self.finished_since_stats = 0
        self.error: str | None = None
        self.stopped = False
        self._ready = False
        self._last_heard = time.monotonic()
        try:
            info = self._handshake(timeout_s)
        except BaseException:  # (refused, timed out): close the sockets, or the context's finalizer blocks forever
            self._close()
            raise
        self.info, self.stats = info, info.stats
        load = tokenizer_loader or _load_tokenizer
        self.frontend = Frontend(load(info), info.limits, info.eos_token_ids, info.model_name, info.score_template,
                                 info.mm_spec, info.lora_spec)
        self._start_reader()

    def _connect(self) -> None:
        """A fresh DEALER socket to the core (and its monitor, which reports a dropped connection)."""
        zmq = self.zmq
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, os.urandom(16))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a core that is not there (no stale hellos)
        sock.connect(self.address)
        self.sock, self.monitor = sock, sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    # -- the interface the server uses (as EngineLoop's)
    @property
    def alive(self) -> bool:
        return self._ready and not self.stopped

    @property
    def load(self) -> int:
        """Unfinished requests on the core (data-parallel routing): as it last reported, less this client's that
        finished since, plus this client's sent since and still unfinished (exact for this client's own)."""
        return max(0, self.stats.get("num_requests", 0) - self.finished_since_stats) + len(self.sent_since_stats)

    @property
    def rank_stats(self) -> list[dict]:
        return [self.stats]

    @property
    def capacity(self) -> int:
        return self.info.capacity

    def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                    on_output: Callable[[RequestOutput | Exception], None], cache_salt: str | None = None, *,
                    prepared: PreparedPrompt | None = None, lora_request: LoRARequest | None = None) -> None:
        if not self.alive:
            raise EngineDeadError(self.error or "the engine core is not connected")
        text, ids, mm = PreparedPrompt(*(prepared or self.frontend.prepare_prompt(prompt, params, cache_salt)))
        self.requests[request_id] = _Request(request_id, text, ids, on_output)
        images = None if mm is None else [proto.WireImage(rows, tuple(grid)) for rows, grid in mm.to_wire()]
        payload = proto.encode(proto.Add(request_id, text, ids, proto.params_to_wire(params), cache_salt, images,
                                       proto.WireLoRA.of(lora_request)))
        with self._lock:
            self.sock.send(payload)
        self.sent_since_stats.add(request_id)

    def abort_request(self, request_id: str) -> None:
        if request_id in self.requests and self.alive:
            with self._lock:
                self.sock.send(proto.encode(proto.Abort(request_id)))

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        deadline = time.monotonic() + drain_timeout_s
        while self.alive and self.requests and time.monotonic() < deadline:
            time.sleep(0.02)
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self.stopped = True

    # -- the handshake
    def _handshake(self, timeout_s: float) -> proto.CoreInfo:
        """Blocks until a core on the address accepted this client's proof of the secret; returns its info."""
        zmq = self.zmq
        deadline = time.monotonic() + timeout_s
        answered: set[bytes] = set()
        while True:
            try:
                self.sock.send(proto.encode(proto.Hello()), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # not connected yet
            poll_until = min(deadline, time.monotonic() + HANDSHAKE_RETRY_S)
            while time.monotonic() < poll_until:
                if not self.sock.poll(int(max(0.0, poll_until - time.monotonic()) * 1000) + 1, zmq.POLLIN):
                    continue
                message = proto.decode_core(self.sock.recv())
                if isinstance(message, proto.Challenge) and message.nonce not in answered:
                    answered.add(message.nonce)
                    self.sock.send(proto.encode(proto.Auth(proto.prove(self.secret, message.nonce))))
                elif isinstance(message, proto.Ready):
                    self._ready, self._last_heard = True, time.monotonic()
                    return message.info
                elif isinstance(message, proto.Refused):
                    raise EngineCoreRefused(f"the engine core at {self.address} refused this client: "
                                            f"{message.reason}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no engine core answered at {self.address} within {timeout_s:.0f} s")

    # -- the reader
    def _start_reader(self) -> None:
        if self.green:
            import gevent

            gevent.spawn(self._read_forever)
        else:
            threading.Thread(target=self._read_forever, name="jaxllm-engine-client", daemon=True).start()

    def _read_forever(self) -> None:
        try:
            while not self.stopped:
                if self._ready:
                    self._read_until_lost()
                else:
                    self._reconnect()
        finally:
            self._close()

    def _close(self) -> None:
        """The sockets closed and the context ended, on the reader (the thread that polls them) once it stops: a
        context left to the garbage collector with a monitored socket open blocks whichever thread collects it,
        forever (pyzmq's finalizer terminates the context, which waits for the monitor)."""
        with self._lock:
            try:
                self.sock.disable_monitor()
            except self.zmq.ZMQError:
                pass
            self.monitor.close(linger=0)
            self.sock.close(linger=500)  # the aborts `stop` sent go out first
            self.ctx.term()

    def _read_until_lost(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        # Under gevent every socket call is on the hub's thread; with OS threads the socket is shared with the
        # request threads' sends, so the reader holds the lock while it touches it and waits in short slices.
        wait_ms = 500 if self.green else 10
        while self._ready and not self.stopped:
            with self._lock:
                events = dict(poller.poll(timeout=0 if not self.green else wait_ms))
                if self.monitor in events:
                    self.monitor.recv_multipart()
                messages = []
                if self.sock in events:
                    while True:
                        try:
                            messages.append(self.sock.recv(flags=zmq.NOBLOCK))
                        except zmq.Again:
                            break
            if self.monitor in events:
                self._lost("the engine core's connection dropped")
            for payload in messages:
                self._last_heard = time.monotonic()
                try:
                    self._dispatch(proto.decode_core(payload))
                except Exception:
                    logger.exception("bad message from the engine core")
            if self._ready and time.monotonic() - self._last_heard > HEARTBEAT_TIMEOUT_S:
                self._lost(f"the engine core sent nothing for {HEARTBEAT_TIMEOUT_S:.0f} s")
            if not events and not self.green:
                time.sleep(wait_ms / 1000)

    def _dispatch(self, message: proto.CoreMessage) -> None:
        if isinstance(message, proto.Outs):  # one step's outputs for this client
            for item in message.items:
                self._dispatch(item)
        elif isinstance(message, proto.Out):
            r = self.requests.get(message.request_id)
            if r is not None:
                out = proto.output_from_wire(message.output, r.request_id, r.prompt, r.prompt_ids)
                if out.finished:
                    del self.requests[message.request_id]
                    self._ended(message.request_id)
                r.on_output(out)
        elif isinstance(message, proto.Fail):
            r = self.requests.pop(message.request_id, None)
            if r is not None:
                self._ended(message.request_id)
                error = {"invalid": InvalidRequestError, "dead": EngineDeadError,
                         "full": EngineBusyError}.get(message.kind, RuntimeError)
                r.on_output(error(message.message))
        elif isinstance(message, proto.Stats):
            self.stats = message.stats
            self.sent_since_stats.clear()
            self.finished_since_stats = 0

    def _ended(self, request_id: str) -> None:
        if request_id in self.sent_since_stats:
            self.sent_since_stats.discard(request_id)
        else:  # counted in the last stats, gone now
            self.finished_since_stats += 1

    def _lost(self, why: str) -> None:
        if not self._ready:
            return
        logger.error("%s: failing %d requests", why, len(self.requests))
        self._ready, self.error = False, why
        requests, self.requests = self.requests, {}
        self.sent_since_stats.clear()
        self.finished_since_stats = 0
        for r in requests.values():
            try:
                r.on_output(EngineDeadError(why))
            except Exception:
                logger.exception("request %s: its output callback failed", r.request_id)

    def _reconnect(self) -> None:
        """A new socket (the old one's queue may hold the dead core's leftovers), then the handshake again."""
        with self._lock:
            self.monitor.close(0)
            self.sock.close(0)
            self._connect()
            try:
                info = self._handshake(HANDSHAKE_RETRY_S * 2)
            except TimeoutError:
                return
            except EngineCoreRefused as e:
                logger.error("%s", e)
                time.sleep(HANDSHAKE_RETRY_S)
                return
        self.info, self.stats, self.error = info, info.stats, None
        logger.info("engine core at %s connected again", self.address)


def _load_tokenizer(info: proto.CoreInfo):
    from jaxllm.loading import load_tokenizer

    # None: the embedded model; a hub id resolves from this host's Hugging Face cache (fetched if missing)
    return load_tokenizer(info.model, revision=info.revision, download_dir=info.download_dir)
