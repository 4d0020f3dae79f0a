"""The engine-core process of the several-API-workers mode, started and watched from gunicorn's master.

The master never imports JAX: the core is a fresh interpreter (`python -m server.engine_core`) on an IPC
socket in a private directory, with a random shared secret that only the master's children see. If the core
exits while the server runs (its engine died, or it was killed), a thread restarts it after `RESTART_DELAY_S`;
the workers answer 503 meanwhile and reconnect by themselves."""

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
    """In the child before exec: SIGTERM when the master goes, even by SIGKILL (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class CoreSupervisor:
    def __init__(self, log):
        self.log = log
        self.dir = tempfile.mkdtemp(prefix="jaxllm-core-")
        os.chmod(self.dir, 0o700)  # the socket file inherits no access for other users
        self.address = f"ipc://{self.dir}/engine-core"
        self.secret = secrets.token_hex(32)
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = False

    def start(self) -> None:
        os.environ["JAXLLM_ENGINE_ADDRESS"] = self.address
        os.environ["JAXLLM_ENGINE_SECRET"] = self.secret
        self._spawn()
        threading.Thread(target=self._watch, name="jaxllm-core-supervisor", daemon=True).start()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "server.engine_core", "--address", self.address],
                                     env=os.environ.copy(), preexec_fn=_die_with_parent)
        self.log.info("engine core started (pid %d) on %s", self.proc.pid, self.address)

    def _watch(self) -> None:
        while not self._stopping:
            status = self.proc.wait()
            if self._stopping:
                return
            self.log.error("engine core (pid %d) exited with status %s; restarting it in %.0f s", self.proc.pid,
                           status, RESTART_DELAY_S)
            time.sleep(RESTART_DELAY_S)
            if not self._stopping:
                self.restarts += 1
                self._spawn()

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
