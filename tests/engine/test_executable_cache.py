"""The executable cache: keys that change with what the trace depends on, a private directory, and entries that
a later process loads and runs."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxllm.engine.executable_cache import ExecutableCache, step_key

pytestmark = pytest.mark.slow  # engines built twice


def test_key_follows_the_inputs_and_the_model():
    args = (jax.ShapeDtypeStruct((4, 8), jnp.float32), jnp.zeros(3, jnp.int32))
    assert step_key("graph-a", args) == step_key("graph-a", args)
    assert step_key("graph-a", args) != step_key("graph-b", args)
    assert step_key("graph-a", args) != step_key("graph-a", (jax.ShapeDtypeStruct((4, 9), jnp.float32), args[1]))
    assert step_key("graph-a", args) != step_key("graph-a", (args[0], jnp.zeros(3, jnp.float32)))
    assert step_key("graph-a", args) != step_key("graph-a", [args[0], args[1]])  # tree structure


def test_directory_must_be_private(tmp_path):
    ExecutableCache(tmp_path / "ok")
    assert os.stat(tmp_path / "ok").st_mode & 0o777 == 0o700
    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", 0o777)
    with pytest.raises(PermissionError):
        ExecutableCache(tmp_path / "shared")


PROGRAM = """
import sys
import jax, jax.numpy as jnp
from jaxllm.engine.executable_cache import ExecutableCache
cache = ExecutableCache(sys.argv[1])
x = jnp.arange(6.0).reshape(2, 3)
compiled = cache.load("k")
if compiled is None:
    compiled = jax.jit(lambda a: jnp.tanh(a @ a.T) + 1).lower(x).compile()
    compiled(x).block_until_ready()
    cache.save("k", compiled)
    print("compiled")
else:
    print("loaded")
print(compiled(x).tolist())
"""


def test_an_entry_runs_in_a_later_process_and_a_corrupt_one_is_ignored(tmp_path):
    def run():
        out = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split("\n", 1)

    first, second = run(), run()
    assert first[0] == "compiled" and second[0] == "loaded" and first[1] == second[1]
    (tmp_path / "k.jaxllm-step").write_bytes(b"not a pickle")
    third = run()
    assert third[0] == "compiled" and third[1] == first[1]
