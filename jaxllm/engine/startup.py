"""Where an engine's start-up time went: one log line, and the figures `python -m jaxllm.generate` and
`benchmarks/startup.py` report."""

from __future__ import annotations

import dataclasses

from jaxllm.engine.step_executables import BucketBuild


@dataclasses.dataclass
class StartupReport:
    load_s: float = 0.0  # weights and tokenizer (0 when the caller passed a loaded model)
    # Allocating the KV cache and the step's constant inputs. On CPU the cache's copy from zeroed host pages runs
    # asynchronously: it mostly lands in the first warm-up run, overlapping the builds.
    kv_cache_s: float = 0.0
    warmup_s: float = 0.0  # building every bucket and running each once (wall time: builds run concurrently)
    buckets: list[BucketBuild] = dataclasses.field(default_factory=list)
    xla_cache_hits: int = 0  # compiles served by JAX's persistent compilation cache

    @property
    def total_s(self) -> float:
        return self.load_s + self.kv_cache_s + self.warmup_s

    def summary(self) -> str:
        loaded = [b for b in self.buckets if b.source == "executable cache"]
        compiled = [b for b in self.buckets if b.source == "compiled"]
        per_bucket = ", ".join(f"{t}x{s} {b.build_s:.2f}+{b.first_run_s:.2f}"
                               for b in self.buckets for t, s in [b.bucket])
        return (f"{self.total_s:.1f} s: load {self.load_s:.2f} s, KV cache {self.kv_cache_s:.2f} s, "
                f"{len(self.buckets)} buckets {self.warmup_s:.2f} s ({len(loaded)} from the executable cache in "
                f"{sum(b.load_s for b in loaded):.2f} s; {len(compiled)} traced {sum(b.trace_s for b in compiled):.2f}"
                f" s, lowered {sum(b.lower_s for b in compiled):.2f} s, compiled "
                f"{sum(b.compile_s for b in compiled):.2f} s with {self.xla_cache_hits} XLA cache hits; warm-up runs "
                f"{sum(b.first_run_s for b in self.buckets):.2f} s); per bucket, tokens x sequences build+run s: "
                f"{per_bucket}")
