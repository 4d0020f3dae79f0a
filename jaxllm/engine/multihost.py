"""One model over the devices of several hosts, with JAX's multi-controller runtime.

Every host runs the same program: `jax.distributed.initialize` (rank 0 also hosts the coordination service),
one global mesh, the same model load (each host places, and reads, only its own devices' shards) and the same
bucketed step executables, warmed up in the same order. Rank 0 alone schedules: before each step it sends the
step's host inputs (token ids, positions, attention metadata, sampling tensors; a few KB) to every other rank,
which then calls the same executable, so all ranks enter the step's collectives together (lockstep). Outputs
(the sampled tokens, replicated) are read on rank 0.

Why a ZeroMQ channel and not `jax.experimental.multihost_utils.broadcast_one_to_all`: a broadcast through JAX
is itself a collective, compiled per input shape and run on the devices, that a follower would have to enter
before knowing which bucket comes next; a plain message costs tens of microseconds, needs nothing compiled and
lets a follower wait in a socket, not in a collective. The channel is unauthenticated, like JAX's coordination
service: both belong on the cluster's private network.

Failures: a host that dies or stops (even SIGSTOP) stops sending the coordination service its heartbeats, and
the service then terminates every process of the job within `HEARTBEAT_TIMEOUT_S`; an API server sees its
engine core go and answers 503. A host alive but stuck outside the runtime (a step that never returns) is caught
by `StepWatchdog`, which ends the process after `STEP_TIMEOUT_S`: nothing waits in a collective forever.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time

import jax
import msgspec
import numpy as np
import zmq

from jaxllm.config import ConfigError
from jaxllm.environment import Environment

logger = logging.getLogger("jaxllm.multihost")

_ENV = Environment.read()
HEARTBEAT_TIMEOUT_S = _ENV.heartbeat_timeout_s
INIT_TIMEOUT_S = _ENV.multihost_init_timeout_s
STEP_TIMEOUT_S = _ENV.step_timeout_s
_ENCODER, _DECODER = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()


def initialize(num_hosts: int, host_rank: int, coordinator_address: str | None) -> None:
    """Joins this process to the job (before anything starts a JAX backend). One host: nothing to do."""
    if num_hosts == 1 or jax.distributed.is_initialized():
        return
    if not coordinator_address:
        raise ConfigError("num_hosts > 1 needs coordinator_address (host:port of rank 0)")
    # CPU hosts: gloo runs the cross-process collectives (XLA's default CPU collectives are process-local).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info("joining a %d-host job as rank %d (coordinator %s)", num_hosts, host_rank, coordinator_address)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_hosts,
                               process_id=host_rank, initialization_timeout=INIT_TIMEOUT_S,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)


def step_address(coordinator_address: str) -> str:
    """The step channel: rank 0's host, the coordinator's port + 1."""
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"coordinator_address {coordinator_address!r}: expected host:port")
    return f"tcp://{host}:{int(port) + 1}"


def check_same_everywhere(what: str, fingerprint: bytes) -> None:
    """Raises on every host unless every host passed the same `fingerprint` (a collective: every host calls it at
    the same point). Hosts started with different settings would compile different steps and wait in each
    other's collectives forever."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(fingerprint).digest(), np.uint8)
    every = multihost_utils.process_allgather(digest)
    differ = [rank for rank in range(len(every)) if not np.array_equal(every[rank], digest)]
    if differ:
        raise ConfigError(f"hosts {differ} were started with a different {what} than host {jax.process_index()}: "
                          "start every host with the same settings (only host_rank differs)")


def agree_min(value: int) -> int:
    """The smallest of every host's `value` (a collective: every host calls it at the same point)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int64(value))))


class StepCodec:
    """A step's inputs (a pytree of numpy arrays and of the runner's device-resident constants) <-> two frames:
    a msgpack header, then every array's bytes back to back (one small copy: a frame per array cost more in
    ZeroMQ than the bytes). Constants travel by name (every host holds the same)."""

    def __init__(self, constants: dict[str, jax.Array]):
        self.constants = constants
        self._names = {id(v): k for k, v in constants.items()}

    def encode(self, bucket: tuple[int, int], leaves: list) -> list[bytes]:
        specs, chunks = [], []
        for leaf in leaves:
            if isinstance(leaf, jax.Array):
                specs.append(self._names[id(leaf)])
            else:
                a = np.asarray(leaf)  # (not ascontiguousarray: it makes 0-d arrays 1-d)
                specs.append([a.dtype.str, list(a.shape)])
                chunks.append(a.tobytes())
        return [_ENCODER.encode(["step", list(bucket), specs]), b"".join(chunks)]

    def decode(self, frames: list) -> tuple[tuple[int, int], list]:
        _, bucket, specs = _DECODER.decode(frames[0])
        data, at, leaves = frames[1], 0, []
        for spec in specs:
            if isinstance(spec, str):
                leaves.append(self.constants[spec])
            else:
                dtype, shape = np.dtype(spec[0]), spec[1]
                count = int(np.prod(shape, dtype=np.int64))
                leaves.append(np.frombuffer(data, dtype=dtype, count=count, offset=at).reshape(shape))
                at += count * dtype.itemsize
        return (bucket[0], bucket[1]), leaves


class StepLeader:
    """Rank 0's end of the step channel: waits until every follower said hello, then sends each step to all."""

    def __init__(self, address: str, num_followers: int):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a follower gone is an error, not a silent drop
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(address)
        self.num_followers = num_followers
        self.followers: list[bytes] = []
        self.sent_bytes = 0
        self.sends = 0
        self.send_s = 0.0

    def wait_for_followers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.followers) < self.num_followers:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise RuntimeError(f"{len(self.followers)} of {self.num_followers} follower hosts connected to the "
                                   f"step channel within {timeout_s:.0f} s")
            ident, kind, rank = self.sock.recv_multipart()
            if kind == b"hello" and ident not in self.followers:
                self.followers.append(ident)
                logger.info("follower rank %s connected", rank.decode())

    def publish(self, codec: StepCodec, bucket: tuple[int, int], leaves: list) -> None:
        """Sends one step's inputs to every follower (encoding and sending timed in `send_s`)."""
        start = time.perf_counter()
        frames = codec.encode(bucket, leaves)
        for ident in self.followers:
            self.sock.send_multipart([ident, *frames])
        self.sends += 1
        self.sent_bytes += sum(len(f) for f in frames)
        self.send_s += time.perf_counter() - start

    def stop(self) -> None:
        """Tells the followers to leave their loop (they then exit normally, with this job)."""
        for ident in self.followers:
            try:
                self.sock.send_multipart([ident, _ENCODER.encode(["stop"])], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.followers = []

    def close(self) -> None:
        self.sock.close(linger=1000)  # the stops go out first


class StepWatchdog:
    """Ends this process when a step has run longer than `timeout_s` (a peer stuck outside the runtime): a clean
    error beats a job that waits in a collective forever. `started()` / `finished()` bracket each step."""

    def __init__(self, timeout_s: float = STEP_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._since: float | None = None
        threading.Thread(target=self._watch, name="jaxllm-step-watchdog", daemon=True).start()

    def started(self) -> None:
        self._since = time.monotonic()

    def finished(self) -> None:
        self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                logger.critical("a step has run for over %.0f s: a host is stuck; ending this process", self.timeout_s)
                logging.shutdown()
                os._exit(70)


def follow(runner, address: str, rank: int) -> int:
    """A follower host's loop: say hello to rank 0, then run every step it sends, until it says stop. Returns the
    exit status (0)."""
    codec = StepCodec(runner.constants)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    sock.send_multipart([b"hello", str(rank).encode()])
    watchdog = StepWatchdog()
    logger.info("rank %d following rank 0's steps from %s", rank, address)
    steps, decode_s = 0, []
    while True:
        frames = sock.recv_multipart()
        try:
            if _DECODER.decode(frames[0])[0] == "stop":
                median = 1e6 * float(np.median(decode_s)) if decode_s else 0.0
                logger.info("rank %d: rank 0 stopped after %d steps (median %.0f us decoding a step's message)",
                            rank, steps, median)
                sock.close()
                return 0
            start = time.perf_counter()
            bucket, leaves = codec.decode(frames)
            inputs = jax.tree.unflatten(runner.input_treedef(bucket), leaves)
            decode_s.append(time.perf_counter() - start)
            watchdog.started()
            runner.run_inputs(bucket, inputs, wait=True)  # a failed step raises here, on the step it belongs to
            watchdog.finished()
        except Exception:  # the job cannot go on without this host: end now (the runtime then ends the others)
            logger.critical("rank %d failed in step %d; ending this process", rank, steps, exc_info=True)
            logging.shutdown()
            os._exit(1)
        steps += 1
