"""Multi-host on one machine: two processes with two host devices each (gloo collectives between them) hold
one model with tensor parallel 4; rank 0 schedules and rank 1 (`python -m server.engine_core --headless
--host-rank 1`) runs the steps rank 0 sends it."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

pytestmark = pytest.mark.slow  # processes over jax.distributed

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [p.tolist() for p in np.random.default_rng(0).integers(0, 1024, (16, 9))]
NEW_TOKENS = 16

RANK0 = """
import json
from jaxllm.engine.llm_engine import LLMEngine
from server.settings import ServerSettings
from tests.engine.test_multihost import greedy

engine = LLMEngine(ServerSettings.from_env().engine)
tokens = greedy(engine)
print(json.dumps({"tokens": tokens, "read": engine.checkpoint_bytes_read, "channel": engine.step_channel_stats}))
engine.close()
"""


def greedy(engine) -> list[list[int]]:
    """Every prompt's greedy continuation, all in one batch."""
    from jaxllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(PROMPTS))]


def coordinator_port() -> int:
    """A free port whose successor (the step channel) is free too."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port pair")


def engine_env(folder: Path, cache_dir: str, **extra: str) -> dict[str, str]:
    """The same engine configuration for every process (only the rank differs)."""
    return {**os.environ, "JAXLLM_MODEL": str(folder), "JAXLLM_DTYPE": "float32", "JAXLLM_ATTN_IMPL": "reference",
            "JAXLLM_MATMUL_IMPL": "reference", "JAXLLM_MAX_NUM_SEQS": "16", "JAXLLM_MAX_NUM_BATCHED_TOKENS": "16",
            "JAXLLM_NUM_PAGES": "512", "JAXLLM_MAX_MODEL_LEN": "256", "JAXLLM_COMPILATION_CACHE_DIR": cache_dir,
            "JAX_PLATFORMS": "cpu", **extra}


def multihost_env(folder: Path, cache_dir: str, port: int, **extra: str) -> dict[str, str]:
    return engine_env(folder, cache_dir, JAXLLM_TENSOR_PARALLEL_SIZE="4", JAXLLM_NUM_HOSTS="2",
                      JAXLLM_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                      XLA_FLAGS="--xla_force_host_platform_device_count=2", **extra)


def start_follower(env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "server.engine_core", "--headless", "--host-rank", "1"], cwd=ROOT,
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def bytes_read(log_text: str) -> int:
    return int(re.search(r"this process read (\d+) bytes of the checkpoint", log_text).group(1))


def tensor_bytes(folder: Path) -> int:
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="numpy") as f:
            total += sum(f.get_tensor(name).nbytes for name in f.keys())
    return total


@pytest.fixture(scope="module")
def tp_folder(tiny_model_dir):
    folder, _ = tiny_model_dir("qwen2_tp")  # 8 heads, 4 KV heads, vocab 1024, MLP 128: tp 4 splits them all
    return folder


def test_tensor_parallel_4_over_two_processes_equals_one_device(tp_folder, compile_cache_dir, tmp_path):
    from jaxllm.engine.llm_engine import LLMEngine
    from server.settings import ServerSettings

    single = LLMEngine(ServerSettings.from_env(engine_env(tp_folder, compile_cache_dir)).engine)
    expected = greedy(single)
    total = tensor_bytes(tp_folder)
    assert single.checkpoint_bytes_read == total

    env = multihost_env(tp_folder, compile_cache_dir, coordinator_port())
    follower = start_follower(env, tmp_path / "rank1.log")
    try:
        rank0 = subprocess.run([sys.executable, "-c", RANK0], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=300)
        assert rank0.returncode == 0, rank0.stderr[-3000:]
        assert follower.wait(60) == 0  # told to stop by rank 0, then left the job cleanly
    finally:
        follower.kill()
    out = json.loads(rank0.stdout.strip().splitlines()[-1])
    assert out["tokens"] == expected
    assert all(len(t) == NEW_TOKENS for t in expected)
    # Every step went to the follower (16 decode steps after the prompts' step, at least).
    assert out["channel"]["steps"] >= NEW_TOKENS and out["channel"]["bytes"] > 0
    # Each process read only its devices' half of the sharded tensors (norm weights, replicated, are tiny).
    read = [out["read"], bytes_read((tmp_path / "rank1.log").read_text())]
    for r in read:
        assert 0.45 * total < r < 0.55 * total, (r, total)
    assert total <= sum(read) < 1.05 * total


def test_rank_0_dying_ends_the_follower(tp_folder, compile_cache_dir, tmp_path):
    """No host waits forever for a rank 0 that is gone: the job's runtime ends the follower."""
    env = multihost_env(tp_folder, compile_cache_dir, coordinator_port(), JAXLLM_HEARTBEAT_TIMEOUT="5")
    follower = start_follower(env, tmp_path / "rank1.log")
    die = RANK0.replace("engine.close()", "import os; os.kill(os.getpid(), 9)")
    try:
        rank0 = subprocess.run([sys.executable, "-c", die], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=300)
        assert rank0.returncode == -9
        assert follower.wait(30) != 0
    finally:
        follower.kill()


def test_step_codec_round_trip():
    import jax

    from jaxllm.engine.multihost import StepCodec

    constants = {"history/4": jax.device_put(np.full((4, 8), -1, np.int32))}
    codec = StepCodec(constants)
    leaves = [np.arange(6, dtype=np.int32).reshape(2, 3), constants["history/4"], np.bool_(True),
              np.linspace(0, 1, 5, dtype=np.float32), np.zeros((0, 3), np.uint32)]
    frames = codec.encode((8, 4), leaves)
    assert len(frames) == 2  # a header and one buffer, whatever the number of arrays
    bucket, back = StepCodec(constants).decode([bytes(f) for f in frames])
    assert bucket == (8, 4)
    assert back[1] is constants["history/4"]
    for a, b in zip(leaves, back, strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.asarray(a).shape == np.asarray(b).shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hosts_started_with_different_settings_refuse_to_start(tp_folder, compile_cache_dir, tmp_path):
    env = multihost_env(tp_folder, compile_cache_dir, coordinator_port())
    follower = start_follower({**env, "JAXLLM_MAX_NUM_SEQS": "8"}, tmp_path / "rank1.log")
    try:
        rank0 = subprocess.run([sys.executable, "-c", RANK0], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=300)
        assert rank0.returncode != 0 and "different engine config" in rank0.stderr
        assert follower.wait(60) != 0
    finally:
        follower.kill()
    assert "different engine config" in (tmp_path / "rank1.log").read_text()
