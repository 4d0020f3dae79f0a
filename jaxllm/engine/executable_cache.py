"""Compiled step executables kept on disk between processes, so a restart skips tracing and lowering.

JAX's persistent compilation cache already skips XLA's compile, but it is keyed by the lowered module: every
start still traces the model and lowers it for each bucket before it can look anything up (on a 2-core CPU
that was a large part of a warm start; README has the figures). This cache is keyed by everything the trace
depends on instead, so a hit needs no trace at all:

- the code: the source of every module of the `jaxllm` and `pallas_kernels` packages, and the versions of
  jax, jaxlib and flax;
- the model's structure and static settings (its nnx graph definition: config, dtype, kernels chosen);
- the step's abstract inputs: every argument's shape, dtype and sharding, and their tree structure;
- the platform (backend, its version, the devices), JAX's flags that change tracing, and ``XLA_FLAGS``.

Only engines that load their model from a checkpoint use it: a model handed in by a notebook may have been
changed in ways (a patched method) that no key sees. Entries are pickles that run code when loaded (as JAX
warns for `serialize_executable`): the directory is created private to the user, and must stay so.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path

import flax
import jax
import jaxlib
from jax.experimental import serialize_executable

logger = logging.getLogger("jaxllm.engine")

MAX_ENTRIES = 256  # least recently used entries beyond this are deleted
_TRACE_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
                "jax_numpy_dtype_promotion", "jax_default_prng_impl", "jax_threefry_partitionable")


@functools.cache
def code_fingerprint() -> str:
    """A hash of the source of the packages whose code a step traces, and of the libraries that trace it."""
    import jaxllm
    import pallas_kernels

    h = hashlib.sha256(f"jax {jax.__version__} jaxlib {jaxlib.__version__} flax {flax.__version__}".encode())
    for package in (jaxllm, pallas_kernels):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _describe(x) -> str:
    sharding = getattr(x, "sharding", None)
    return f"{tuple(x.shape)}:{x.dtype}:{sharding}"


def step_key(graphdef, args: tuple) -> str:
    """The cache key of a step compiled for the model `graphdef` and the (concrete or abstract) `args`."""
    h = hashlib.sha256(code_fingerprint().encode())
    h.update(repr(graphdef).encode())
    leaves, treedef = jax.tree.flatten(args)
    h.update(str(treedef).encode())
    for leaf in leaves:
        h.update(_describe(leaf).encode())
    device = jax.devices()[0]
    h.update(f"{jax.default_backend()} {device.client.platform_version} {jax.devices()}".encode())
    h.update(repr([(name, getattr(jax.config, name)) for name in _TRACE_FLAGS]).encode())
    h.update(os.environ.get("XLA_FLAGS", "").encode())
    return h.hexdigest()


class ExecutableCache:
    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = self.directory.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise PermissionError(f"{self.directory} is writable by other users or not owned by this one: its "
                                  f"entries could run their code here")

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.jaxllm-step"

    def load(self, key: str) -> jax.stages.Compiled | None:
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            serialized, in_tree, out_tree, device_ids = pickle.loads(blob)
            by_id = {d.id: d for d in jax.devices()}
            compiled = serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
        except Exception as e:  # a truncated or foreign entry: compile again and overwrite it
            logger.warning("executable cache entry %s unreadable (%s: %s); compiling instead", path.name,
                           type(e).__name__, e)
            return None
        os.utime(path)  # recency for eviction
        return compiled

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        try:
            device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
            blob = pickle.dumps((*serialize_executable.serialize(compiled), device_ids))
        except (ValueError, NotImplementedError) as e:  # this backend cannot serialize executables
            logger.info("executable cache: cannot serialize this step (%s)", e)
            return
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, self._path(key))  # atomic: a concurrent reader sees the old entry or the new one
        self._evict()

    def _evict(self) -> None:
        entries = []
        for path in self.directory.glob("*.jaxllm-step"):
            try:
                entries.append((path.stat().st_mtime, path))
            except FileNotFoundError:  # evicted by another process meanwhile
                pass
        for _, path in sorted(entries, reverse=True)[MAX_ENTRIES:]:
            path.unlink(missing_ok=True)
