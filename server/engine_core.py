"""Engine cores alone, for API servers that connect to them (headless mode, and the engine processes that
gunicorn.conf.py starts for several API workers):

    JAXLLM_ENGINE_SECRET=... python -m server.engine_core [--address tcp://127.0.0.1:5555]
        [--data-parallel-size D] [--num-hosts H --host-rank 0 --coordinator-address HOST0:PORT]
    python -m server.engine_core --headless --num-hosts H --host-rank R --coordinator-address HOST0:PORT

The second form is a multi-host follower (R > 0: it runs rank 0's steps on this host's devices; see
jaxllm/engine/multihost.py); rank 0 is an engine core as usual (or gunicorn with JAXLLM_NUM_HOSTS set).

The engine is configured from the same JAXLLM_* variables as the server (server/settings.py). With
--data-parallel-size D this process supervises D engine-core processes, rank r listening on the address's port
+ r (tcp) or path + "-r" (ipc), each on its own share of the host's CPUs (and of the GPUs, when there are
some); API servers list every rank's address in JAXLLM_ENGINE_ADDRESS, comma-separated. The default address is
loopback; bind another interface only on a network you trust: the shared secret authenticates API servers (an
HMAC challenge; the secret never crosses the wire) but the traffic is not encrypted. SIGTERM stops after
in-flight requests finish (JAXLLM_DRAIN_TIMEOUT). Exit status of a core: 0 when stopped, 1 when its engine died
(the supervisor, or yours, restarts it; API servers answer 503 meanwhile and reconnect on their own)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import subprocess
import sys

from jaxllm.environment import Environment


def rank_addresses(address: str, size: int) -> list[str]:
    """One address per data-parallel rank: consecutive tcp ports, or ipc paths with a rank suffix."""
    if size == 1:
        return [address]
    m = re.fullmatch(r"(tcp://.+):(\d+)", address)
    if m:
        return [f"{m.group(1)}:{int(m.group(2)) + r}" for r in range(size)]
    if address.startswith("ipc://"):
        return [f"{address}-{r}" for r in range(size)]
    raise ValueError(f"{address}: data parallelism needs a tcp://host:port or ipc:// address")


def place_rank(rank: int, size: int) -> None:
    """Before JAX starts: this rank's share of the CPUs (XLA's and the kernels' thread pools size themselves to
    it) and, when NVIDIA GPUs are visible, of the GPUs."""
    if size == 1:
        return
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        share = cpus[rank * len(cpus) // size:(rank + 1) * len(cpus) // size] or [cpus[rank % len(cpus)]]
        os.sched_setaffinity(0, share)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None and shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, check=False).stdout
        visible = ",".join(out.split()) or None
    if visible:
        gpus = visible.split(",")
        if len(gpus) % size:
            raise ValueError(f"{len(gpus)} GPUs do not split into {size} data-parallel ranks")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[rank * len(gpus) // size:(rank + 1) * len(gpus) // size])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    env = Environment.read()
    p.add_argument("--address", default=env.engine_bind,
                   help="ZeroMQ address to listen on (tcp://host:port or ipc:///path; default %(default)s)")
    p.add_argument("--data-parallel-size", type=int, default=env.data_parallel_size)
    p.add_argument("--data-parallel-rank", type=int, help="run this one rank (what the supervisor starts)")
    p.add_argument("--headless", action="store_true", help="accepted for vLLM-style command lines (always headless)")
    p.add_argument("--num-hosts", type=int, help="multi-host: hosts the model spans (JAXLLM_NUM_HOSTS)")
    p.add_argument("--host-rank", type=int, help="multi-host: this host's rank; > 0 follows rank 0 (JAXLLM_HOST_RANK)")
    p.add_argument("--coordinator-address", help="multi-host: rank 0's host:port (JAXLLM_COORDINATOR_ADDRESS)")
    args = p.parse_args(argv)
    for name in ("num_hosts", "host_rank", "coordinator_address"):
        if getattr(args, name) is not None:
            os.environ[f"JAXLLM_{name.upper()}"] = str(getattr(args, name))
    env = Environment.read()  # with what the flags set
    logging.basicConfig(level=env.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if env.host_rank > 0:
        return follow()
    secret = env.engine_secret
    if not secret:
        p.error("set JAXLLM_ENGINE_SECRET: API servers prove they know it")
    if args.data_parallel_size < 1:
        p.error("--data-parallel-size must be >= 1")
    if args.data_parallel_size > 1 and env.num_hosts > 1:
        p.error("data parallelism over several hosts' engine cores is not supported yet")
    if args.data_parallel_size > 1 and args.data_parallel_rank is None:  # supervise one process per rank
        from server.core_supervisor import CoreSupervisor

        sup = CoreSupervisor(logging.getLogger("jaxllm.engine_core"), args.data_parallel_size,
                             rank_addresses(args.address, args.data_parallel_size), secret)
        signal.signal(signal.SIGTERM, lambda *_: sup.stop())
        signal.signal(signal.SIGINT, lambda *_: sup.stop())
        sup.start()
        sup.wait()
        return 0
    rank = args.data_parallel_rank or 0
    place_rank(rank, args.data_parallel_size)
    from jaxllm.engine.core_server import EngineCoreServer
    from jaxllm.engine.llm_engine import LLMEngine
    from server.settings import ServerSettings

    settings = ServerSettings.from_env()
    engine = LLMEngine(settings.engine)
    if settings.chat_template is not None and engine.tokenizer is not None:
        engine.tokenizer.set_chat_template(settings.chat_template)
    core = EngineCoreServer(engine, args.address, secret, rank=rank)
    signal.signal(signal.SIGTERM, lambda *_: core.stop(settings.drain_timeout_s))
    signal.signal(signal.SIGINT, lambda *_: core.stop(0.0))
    status = core.serve_forever()
    core.close()
    if status and settings.engine.num_hosts > 1:  # a multi-host job that failed: exit now, not in JAX's exit
        logging.shutdown()                         # handler, which would wait for hosts that may be gone
        os._exit(status)
    return status


def follow() -> int:
    """A multi-host follower (rank > 0): the same engine start as rank 0 (load this host's shards, warm up the
    same buckets), then run the steps rank 0 sends until it stops. It serves nothing itself."""
    from jaxllm.engine import multihost
    from jaxllm.engine.llm_engine import LLMEngine
    from server.settings import ServerSettings

    cfg = ServerSettings.from_env().engine
    engine = LLMEngine(cfg)
    return multihost.follow(engine.runner, multihost.step_address(cfg.coordinator_address), cfg.host_rank)


if __name__ == "__main__":
    sys.exit(main())
