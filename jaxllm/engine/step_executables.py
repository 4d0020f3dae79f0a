"""One compiled step executable per (tokens, sequences) bucket: built once, from the executable cache (no trace at
all) or traced, lowered and compiled (XLA's compile itself may be a hit in JAX's persistent cache). Builds are
thread-safe and may run concurrently (XLA compiles without the GIL); a caller asking for a bucket another thread
is building waits for that build."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable

import jax

from jaxllm.engine import compile_monitor
from jaxllm.engine.executable_cache import ExecutableCache, step_key


@dataclasses.dataclass
class BucketBuild:
    """How one bucket's executable was obtained, and what it cost (seconds)."""
    bucket: tuple[int, int]
    source: str  # "executable cache" or "compiled"
    trace_s: float = 0.0
    lower_s: float = 0.0
    compile_s: float = 0.0  # XLA compile, or a load from JAX's persistent cache
    load_s: float = 0.0  # deserializing from the executable cache
    first_run_s: float = 0.0  # the warm-up run
    run_s: float = 0.0  # a run after the first (the fastest of those timed at warm-up; 0: none timed)

    @property
    def build_s(self) -> float:
        return self.trace_s + self.lower_s + self.compile_s + self.load_s


class StepExecutables:
    def __init__(self, jitted, abstract_args: Callable[[tuple[int, int]], tuple], graphdef,
                 compiler_options: dict, executable_cache: ExecutableCache | None):
        """jitted: the jitted step function; abstract_args(bucket): what a build lowers against (shapes, dtypes
        and shardings only: the caches are donated by every run, so a build on another thread must not touch the
        arrays themselves)."""
        self.jitted, self.abstract_args, self._graphdef = jitted, abstract_args, graphdef
        self.compiler_options = compiler_options
        self.executable_cache = executable_cache
        self._executables: dict[tuple[int, int], jax.stages.Compiled] = {}
        self._lock = threading.Lock()  # builds run on a pool; the dicts have one writer at a time
        self.builds: dict[tuple[int, int], BucketBuild] = {}
        self._unsaved: dict[tuple[int, int], str] = {}  # bucket -> executable cache key, saved after its first run
        self._pending: dict[tuple[int, int], concurrent.futures.Future] = {}  # builds in progress
        self.build_wait_s = 0.0  # time `get` waited for builds (the engine thread's compile time)

    def build(self, bucket: tuple[int, int]) -> jax.stages.Compiled:
        """The executable of `bucket`: built before, loaded from the executable cache, or traced and compiled."""
        with self._lock:
            if (done := self._executables.get(bucket)) is not None:
                return done
            pending = self._pending.get(bucket)
            if pending is None:
                pending = self._pending[bucket] = concurrent.futures.Future()
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result()
        try:
            compiled = self._build(bucket)
            pending.set_result(compiled)
            return compiled
        except BaseException as e:
            pending.set_exception(e)
            raise
        finally:
            with self._lock:
                self._pending.pop(bucket, None)

    def prebuild(self, buckets: list[tuple[int, int]]) -> None:
        """Starts building `buckets` on background threads (a one-shot run knows which shapes it will need: its
        decode bucket then compiles while its prompt runs)."""
        for bucket in dict.fromkeys(buckets):
            threading.Thread(target=self.build, args=(bucket,), name=f"jaxllm-build-{bucket}", daemon=True).start()

    def _build(self, bucket: tuple[int, int]) -> jax.stages.Compiled:
        args = self.abstract_args(bucket)
        key = step_key(self._graphdef, args) if self.executable_cache is not None else None
        start = time.perf_counter()
        compiled = self.executable_cache.load(key) if key is not None else None
        if compiled is not None:
            report = BucketBuild(bucket, "executable cache", load_s=time.perf_counter() - start)
        else:
            traced = self.jitted.trace(*args)
            t1 = time.perf_counter()
            lowered = traced.lower()
            t2 = time.perf_counter()
            hits = compile_monitor.thread_cache_hits()
            compiled = lowered.compile(compiler_options=self.compiler_options or None)
            report = BucketBuild(bucket, "compiled", trace_s=t1 - start, lower_s=t2 - t1,
                                 compile_s=time.perf_counter() - t2)
            if compile_monitor.thread_cache_hits() > hits:
                # Re-serializing an executable JAX loaded from its own cache gives one that fails when run in a
                # later process ("Function ... not found"): only fresh compiles are kept.
                key = None
        with self._lock:  # build() lets one thread build a bucket: plain assignments
            if key is not None and report.source == "compiled":
                # Saved after its first run: XLA:CPU finishes some kernels only then, and an executable
                # serialized before lacks them (a later process fails with "Function ... not found").
                self._unsaved[bucket] = key
            self._executables[bucket] = compiled
            self.builds[bucket] = report
        return compiled

    def get(self, bucket: tuple[int, int]) -> jax.stages.Compiled:
        """The bucket's executable, built now if it is not yet (the wait counts in `build_wait_s`)."""
        run = self._executables.get(bucket)
        if run is None:
            start = time.perf_counter()
            run = self.build(bucket)
            self.build_wait_s += time.perf_counter() - start
        return run

    def first_run_pending(self, bucket: tuple[int, int]) -> bool:
        """Whether the bucket's fresh executable waits for its first run to complete to be saved."""
        return bucket in self._unsaved

    def saved_after_run(self, bucket: tuple[int, int]) -> None:
        """Its first run completed: a fresh executable goes to the executable cache."""
        if not self._unsaved:
            return
        with self._lock:
            key = self._unsaved.pop(bucket, None)
        if key is not None:
            self.executable_cache.save(key, self._executables[bucket])
