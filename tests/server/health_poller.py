"""Polls a server's /health every 20 ms from its own process until its stdin closes. Prints "ready" once the first
poll is answered, and at the end one JSON line: {"latencies": [seconds...], "failures": [...]}. A separate process,
so that what it measures is the server's latency, not the wait for the GIL of a test process running 64 client
threads. Often enough that a load of a few seconds gives well over 100 polls: below 100, a p99 is the maximum.

    python -m tests.server.health_poller http://127.0.0.1:PORT
"""

import json
import sys
import threading
import time

import requests


def main(url: str) -> None:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    latencies, failures = [], []
    while not stop.is_set():
        t = time.monotonic()
        try:
            status = requests.get(url + "/health", timeout=5).status_code
        except requests.RequestException as e:
            status = repr(e)
        if status != 200:
            failures.append(status)
        latencies.append(time.monotonic() - t)
        if len(latencies) == 1:
            print("ready", flush=True)
        time.sleep(0.02)
    print(json.dumps({"latencies": latencies, "failures": failures}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
