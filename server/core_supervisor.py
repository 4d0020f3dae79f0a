"""Engine-core processes started and watched from a parent that never imports JAX: gunicorn's master (several
API workers) or the headless entry point with data parallelism.

Each core is a fresh interpreter (`python -m server.engine_core --address ... --data-parallel-rank r`). Without
explicit addresses, they listen on IPC sockets in a private directory, with a random shared secret that only
this process's children see (set in this process's environment, which gunicorn's workers inherit). A core that
exits while the supervisor runs (its engine died, or it was killed) is restarted after `RESTART_DELAY_S`; the API
workers answer 503 meanwhile and reconnect by themselves."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

RESTART_DELAY_S = 1.0


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent goes, even by SIGKILL (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class CoreSupervisor:
    def __init__(self, log, data_parallel_size: int = 1, addresses: list[str] | None = None,
                 secret: str | None = None):
        self.log = log
        self.dir = None
        if addresses is None:
            self.dir = tempfile.mkdtemp(prefix="jaxllm-core-")
            os.chmod(self.dir, 0o700)  # the socket files: no access for other users
            addresses = [f"ipc://{self.dir}/engine-core-{r}" for r in range(data_parallel_size)]
        if len(addresses) != data_parallel_size:
            raise ValueError(f"{len(addresses)} addresses for data_parallel_size={data_parallel_size}")
        self.addresses = addresses
        self.secret = secret or secrets.token_hex(32)
        self.procs: list[subprocess.Popen | None] = [None] * data_parallel_size
        self.restarts = 0
        self._stopping = False

    def start(self) -> None:
        os.environ["JAXLLM_ENGINE_ADDRESS"] = ",".join(self.addresses)
        os.environ["JAXLLM_ENGINE_SECRET"] = self.secret
        for rank in range(len(self.addresses)):
            self._spawn(rank)
            threading.Thread(target=self._watch, args=(rank,), name=f"jaxllm-core-supervisor-{rank}",
                             daemon=True).start()

    def _spawn(self, rank: int) -> None:
        cmd = [sys.executable, "-m", "server.engine_core", "--address", self.addresses[rank],
               "--data-parallel-rank", str(rank), "--data-parallel-size", str(len(self.addresses))]
        self.procs[rank] = subprocess.Popen(cmd, env=os.environ.copy(), preexec_fn=_die_with_parent)
        self.log.info("engine core %d started (pid %d) on %s", rank, self.procs[rank].pid, self.addresses[rank])

    def _watch(self, rank: int) -> None:
        while not self._stopping:
            proc = self.procs[rank]
            proc.wait()  # (its status may read 0 when gunicorn's arbiter reaped it first)
            if self._stopping:
                return
            self.log.error("engine core %d (pid %d) exited; restarting it in %.0f s", rank, proc.pid,
                           RESTART_DELAY_S)
            time.sleep(RESTART_DELAY_S)
            if not self._stopping:
                self.restarts += 1
                self._spawn(rank)

    def wait(self) -> None:
        """Blocks until `stop` (the headless entry point's main thread)."""
        while not self._stopping:
            time.sleep(0.2)

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stopping = True
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
