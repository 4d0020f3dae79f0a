"""An engine core in its own process: the engine loop (`EngineLoop`, the same one an in-process server runs in
a thread) behind a ZeroMQ ROUTER socket that API servers connect to (see `core_protocol` for the messages).

One thread does everything, as vLLM's engine-core busy loop does: it polls the socket (without waiting while
requests are unfinished), authenticates clients, hands their requests to the loop, runs one loop iteration (one
engine step), sends each client one message with that step's outputs for it, and broadcasts the engine's stats
every `STATS_INTERVAL_S` (the core's heartbeat). No second thread means no GIL hand-offs and no extra hop
between a step and its outputs. The one exception: a structured-output grammar the core has not compiled yet is
compiled on a thread of its own (llguidance releases the GIL), and its request joins the batch when it is ready,
so other streams do not stall for the compile. Request ids are namespaced by client, so one API server can
neither see nor abort another's requests. A client that vanished (a killed API worker) has its requests aborted
as soon as an output for it cannot be delivered, so its KV pages come back."""

from __future__ import annotations

import _queue
import concurrent.futures
import logging
import time
import traceback

import msgspec
import zmq

from jaxllm.engine import core_protocol as proto
from jaxllm.engine.engine_loop import EngineDeadError, EngineLoop
from jaxllm.engine.frontend import PreparedPrompt
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.errors import EngineBusyError, InvalidRequestError
from jaxllm.multimodal.inputs import images_from_wire

logger = logging.getLogger("jaxllm.engine_core")
STATS_INTERVAL_S = 0.2
COMPILE_POLL_S = 0.005  # how often an idle core looks for compiled grammars
SEND_QUEUE_MESSAGES = 10_000  # a client this many steps behind is treated as gone (its requests are aborted)


def _fail_kind(e: Exception) -> str:
    if isinstance(e, InvalidRequestError | ValueError | TypeError):
        return "invalid"
    return "dead" if isinstance(e, EngineDeadError) else "full" if isinstance(e, EngineBusyError) else "error"


class EngineCoreServer:
    def __init__(self, engine: LLMEngine, address: str, secret: str, *, rank: int = 0):
        if not secret:
            raise ValueError("an engine core needs a shared secret (JAXLLM_ENGINE_SECRET)")
        self.engine, self.secret = engine, secret
        c = engine.config
        self.info = proto.CoreInfo(
            model_name=engine.model_name, limits=engine.limits, eos_token_ids=engine.eos_token_ids,
            score_template=engine.frontend.score_template, mm_spec=engine.mm_spec,
            lora_spec=engine.frontend.lora_spec, max_num_seqs=c.max_num_seqs,
            max_waiting_requests=c.max_waiting_requests, page_size=c.page_size, model=c.model, revision=c.revision,
            download_dir=c.download_dir, rank=rank)
        self._pending: dict[bytes, list[proto.Out | proto.Fail]] = {}  # this iteration's outputs per client
        self._pending_done: dict[bytes, list[str]] = {}  # and the core-side ids of requests that ended
        self.loop = EngineLoop(engine, flush=self._flush, thread=False)
        self.capacity = self.loop.capacity
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxllm-grammar")
        self._compiled: _queue.SimpleQueue = _queue.SimpleQueue()  # (client, core id, failure or None)
        self._compiling: set[str] = set()  # core ids of requests whose grammar is being compiled
        self._abort_when_compiled: set[str] = set()
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished client raises: its requests end
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, SEND_QUEUE_MESSAGES)
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.nonces: dict[bytes, bytes] = {}  # client -> the challenge it must answer
        self.clients: set[bytes] = set()  # authenticated
        self.owned: dict[bytes, set[str]] = {}  # client -> its unfinished request ids (core-side, namespaced)
        self._stop_at: float | None = None

    # -- outputs
    def _flush(self) -> None:
        """One message per client for everything this iteration produced."""
        if not self._pending:
            return
        pending, done, self._pending, self._pending_done = self._pending, self._pending_done, {}, {}
        for client, items in pending.items():
            owned = self.owned.get(client)
            if owned is None:
                continue  # dropped already: its requests are being aborted
            owned.difference_update(done.get(client, ()))
            self._send(client, proto.encode(proto.Outs(items)))

    def _callback(self, client: bytes, request_id: str, core_id: str):
        def on_output(out):
            if isinstance(out, Exception):
                item, ended = proto.Fail(request_id, _fail_kind(out), str(out)), True
            else:
                item, ended = proto.Out(request_id, proto.output_to_wire(out)), out.finished
            self._pending.setdefault(client, []).append(item)
            if ended:
                self._pending_done.setdefault(client, []).append(core_id)
        return on_output

    # -- the loop
    def serve_forever(self) -> int:
        """Returns the process's exit status: 0 when stopped, 1 when the engine died."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        last_stats = 0.0
        logger.info("engine core ready on %s", self.address)
        while True:
            now = time.monotonic()
            busy = self.engine.has_unfinished_requests()
            wait_s = 0.0 if busy else max(0.0, last_stats + STATS_INTERVAL_S - now)
            if self._compiling:
                wait_s = min(wait_s, COMPILE_POLL_S)
            if poller.poll(timeout=int(wait_s * 1000)):
                self._receive()
            self._take_compiled()
            try:
                self.loop.run_once(block=False)
            except Exception:
                self.loop.die(traceback.format_exc())
                logger.error("the engine died; the engine core exits")
                return 1
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL_S:
                last_stats = now
                self._broadcast(proto.encode(proto.Stats(self.loop.stats)))
            if self._stop_at is not None and (now >= self._stop_at or not self.engine.has_unfinished_requests()):
                self.loop.shutdown()  # what is still running is aborted
                return 0

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Asks `serve_forever` to return once in-flight requests finished, or after drain_timeout_s; new
        requests are refused meanwhile. Safe from a signal handler or another thread."""
        self._stop_at = time.monotonic() + drain_timeout_s

    def close(self) -> None:
        self._compiler.shutdown(wait=True)
        self.sock.close(0)
        self.engine.close()  # multi-host: the follower hosts stop with it

    def _send(self, client: bytes, payload: bytes) -> None:
        try:
            self.sock.send_multipart([client, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the client is gone; EAGAIN: it stopped reading
            logger.warning("client %s unreachable (%s): aborting its requests", client.hex(), e)
            self._drop(client)

    def _drop(self, client: bytes) -> None:
        self.clients.discard(client)
        self.nonces.pop(client, None)
        for core_id in self.owned.pop(client, set()):
            self._abort(core_id)

    def _abort(self, core_id: str) -> None:
        if core_id in self._compiling:
            self._abort_when_compiled.add(core_id)
        else:
            self.loop.abort_request(core_id)

    def _broadcast(self, payload: bytes) -> None:
        for client in list(self.clients):
            self._send(client, payload)

    def _add(self, core_id, text, ids, params, cache_salt, on_output, images=None, lora=None) -> None:
        if images is not None:
            spec = self.engine.mm_spec
            if spec is None:
                raise InvalidRequestError("this model does not take images", "multi_modal_data")
            images = images_from_wire([(w.rows, w.grid) for w in images], spec.patch_dim)
        _, ids, mm = self.engine.prepare_prompt(ids, params, cache_salt, images)  # validated again, here
        prompt = PreparedPrompt(text, ids, mm)
        self.loop.add_request(core_id, None, params, on_output, cache_salt, prepared=prompt,
                              lora_request=None if lora is None else lora.request())

    def _add_when_compiled(self, client, request_id, core_id, text, ids, params, cache_salt, on_output,
                           images=None, lora=None) -> None:
        """On the grammar thread (llguidance compiles with the GIL released): validate, compile, hand over."""
        try:
            self._add(core_id, text, ids, params, cache_salt, on_output, images, lora)
            self._compiled.put((client, core_id, None))
        except Exception as e:
            self._compiled.put((client, core_id, proto.encode(proto.Fail(request_id, _fail_kind(e), str(e)))))

    def _take_compiled(self) -> None:
        while True:
            try:
                client, core_id, failure = self._compiled.get_nowait()
            except _queue.Empty:
                return
            self._compiling.discard(core_id)
            if core_id in self._abort_when_compiled:  # aborted meanwhile: its add is ahead of this abort
                self._abort_when_compiled.discard(core_id)
                self.loop.abort_request(core_id)
            if failure is not None:
                self.owned.get(client, set()).discard(core_id)
                if client in self.clients:
                    self._send(client, failure)

    def _receive(self) -> None:
        while True:
            try:
                client, payload = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = proto.decode_client(payload)
                self._handle(client, message)
            except Exception as e:  # a malformed message: refuse it, never die of it
                logger.warning("bad message from client %s: %s", client.hex(), e)

    def _handle(self, client: bytes, message: proto.ClientMessage) -> None:
        if isinstance(message, proto.Hello):  # a repeated hello gets the same challenge (each socket has its own
            if client not in self.clients:    # identity)
                nonce = self.nonces.setdefault(client, proto.new_nonce())
                self._send(client, proto.encode(proto.Challenge(nonce)))
        elif isinstance(message, proto.Auth):
            if client in self.clients:
                return
            nonce = self.nonces.pop(client, None)
            if nonce is not None and proto.verify(self.secret, nonce, message.proof):
                self.clients.add(client)
                self.owned.setdefault(client, set())
                info = msgspec.structs.replace(self.info, stats=self.loop.stats)
                self._send(client, proto.encode(proto.Ready(info)))
                logger.info("client %s connected", client.hex())
            else:
                logger.warning("client %s refused: wrong secret", client.hex())
                self._send(client, proto.encode(proto.Refused("wrong shared secret")))
        elif client not in self.clients:
            return  # nothing but a handshake from a client that has not passed one
        elif isinstance(message, proto.Add):
            self._handle_add(client, message)
        elif isinstance(message, proto.Abort):
            core_id = f"{client.hex()}:{message.request_id}"
            if core_id in self.owned.get(client, ()):
                self._abort(core_id)

    def _handle_add(self, client: bytes, m: proto.Add) -> None:
        core_id = f"{client.hex()}:{m.request_id}"
        on_output = self._callback(client, m.request_id, core_id)
        try:
            if self._stop_at is not None:
                raise EngineDeadError("the engine core is shutting down")
            if len(self.engine.requests) + len(self._compiling) >= self.capacity:  # several API servers: none
                raise EngineBusyError(f"the engine core holds {self.capacity} requests; retry later")  # sees all
            params = proto.params_from_wire(m.params)
            spec = getattr(params, "structured_outputs", None)  # (PoolingParams have none)
            if spec is not None and not self.engine.grammars.is_compiled(spec):  # compiling takes a while:
                self._compiling.add(core_id)  # not on the thread that steps every other request
                self.owned[client].add(core_id)
                self._compiler.submit(self._add_when_compiled, client, m.request_id, core_id, m.text, m.ids,
                                      params, m.cache_salt, on_output, m.images, m.lora)
                return
            self._add(core_id, m.text, m.ids, params, m.cache_salt, on_output, m.images, m.lora)
        except Exception as e:  # the API side validated it already; refuse what still does not pass
            self._send(client, proto.encode(proto.Fail(m.request_id, _fail_kind(e), str(e))))
            return
        self.owned[client].add(core_id)
