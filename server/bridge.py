"""Hands engine outputs from the engine's OS thread to the greenlet serving the request.

Under gevent, a per-request `gevent.queue.Queue` is only ever touched by the hub thread: the engine thread
schedules `put_nowait` on the hub with `loop.run_callback_threadsafe`, which also wakes the hub. Without
gevent (Flask's test client, a threaded server) a C `_queue.SimpleQueue` does the same job.
"""

from __future__ import annotations

import _queue


def _gevent_active() -> bool:
    try:
        from gevent import monkey
    except ImportError:
        return False
    return monkey.is_module_patched("socket")


class OutputStream:
    def __init__(self):
        if _gevent_active():
            import gevent.queue
            from gevent import get_hub

            self._loop = get_hub().loop
            self._queue = gevent.queue.Queue()
            self._gevent = True
        else:
            self._queue = _queue.SimpleQueue()
            self._gevent = False

    def push(self, item) -> None:
        """Called on the engine thread."""
        if self._gevent:
            self._loop.run_callback_threadsafe(self._queue.put_nowait, item)
        else:
            self._queue.put(item)

    def get(self, timeout: float | None = None):
        """The next item, or None after `timeout` seconds without one."""
        try:
            return self._queue.get(timeout=timeout)
        except _queue.Empty:  # gevent.queue.Empty is the same class
            return None
