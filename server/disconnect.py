"""Has the client of the current request gone away? Asked while a non-streaming request waits for the engine,
so a client that gives up stops its generation within a poll interval (a stream notices on its next write).

gunicorn puts the connection's socket in the WSGI environ. A peer that closed its side shows as POLLRDHUP
(or POLLHUP / POLLERR) on the socket even with unread bytes pending or under TLS, and polling with a zero
timeout never blocks; the original `select.poll` is used since gevent's monkey-patching removes it.
"""

from __future__ import annotations

import select

_EVENTS = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


def _poll():
    try:
        from gevent import monkey
    except ImportError:
        return select.poll()
    return monkey.get_original("select", "poll")() if monkey.is_module_patched("select") else select.poll()


def client_gone(environ: dict) -> bool:
    sock = environ.get("gunicorn.socket")
    if sock is None:  # not served by gunicorn (Flask's test client): nothing to watch
        return False
    try:
        fd = sock.fileno()
    except OSError:
        return True
    if fd < 0:
        return True
    poller = _poll()
    poller.register(fd, _EVENTS)
    return bool(poller.poll(0))
