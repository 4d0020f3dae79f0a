"""What a step's many small host inputs cost to dispatch: a jitted function called with a batch-1 decode step's
host arrays one by one (as `StepInputs` passes them: ~26 numpy leaves), with the same bytes packed into one
array that the function unpacks (static slices and bitcasts; packed in the call, or before it: a builder that
writes the leaves into one buffer), and with the leaves already on the device.

    python benchmarks/dispatch_args.py [--calls 300] [--json out.json]

Each variant: the host's time to dispatch a call (returning before the device finishes) and a call's time end
to end, medians over rounds of queued calls; variants interleaved round by round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# host leaves modelled on a batch-1 decode step's (`StepInputBuilder.build` at bucket (1, 1), the 8B preset's 2,048
# pages a sequence; not the engine's exact list). The pack and unpack below are this benchmark's own, a model of
# `jaxllm.engine.input_packing` without an engine to build.
LEAVES = ([((1,), np.int32)] * 2 + [((1,), np.int32), ((2,), np.int32), ((1, 2048), np.int32), ((1,), np.int32),
                                      ((1,), np.int32)]
          + [((1,), np.float32), ((1,), np.int32)] + [((1,), np.float32)] * 5 + [((1, 2), np.uint32)]
          + [((1,), np.int32)] * 3 + [((), np.bool_)] * 6)


def leaves(rng) -> list[np.ndarray]:
    return [(rng.integers(0, 100, shape) if dtype != np.bool_ else rng.integers(0, 2, shape)).astype(dtype)
            for shape, dtype in LEAVES]


def pack(arrays: list[np.ndarray]) -> np.ndarray:
    """Every leaf's bytes, each padded to 4, in one uint8 array."""
    parts = []
    for a in arrays:
        b = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        parts += [b, np.zeros(-len(b) % 4, np.uint8)]
    return np.concatenate(parts)


def unpack(packed: jax.Array) -> list[jax.Array]:
    out, at = [], 0
    for shape, dtype in LEAVES:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        chunk = packed[at:at + n]
        if np.dtype(dtype).itemsize == 1:
            out.append(chunk.reshape(shape).astype(dtype))
        else:
            out.append(jax.lax.bitcast_convert_type(chunk.reshape(-1, np.dtype(dtype).itemsize), dtype).reshape(shape))
        at += n + (-n % 4)
    return out


def body(*xs):
    return sum(jnp.sum(x.astype(jnp.float32)) for x in xs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    host = [leaves(rng) for _ in range(8)]  # fresh arrays each call, as each step builds its own
    many = jax.jit(body)
    one = jax.jit(lambda packed: body(*unpack(packed)))
    ref = float(many(*host[0]))
    assert abs(float(one(pack(host[0]))) - ref) <= 1e-3 * abs(ref), "the packed leaves unpack to other values"
    on_device = [jax.device_put(h) for h in host]
    packed = [pack(h) for h in host]
    variants = {"leaves from the host (one transfer each)": lambda i: many(*host[i % 8]),
                "one packed array from the host, packed in the call": lambda i: one(pack(host[i % 8])),
                "one packed array from the host, packed before": lambda i: one(packed[i % 8]),
                "leaves already on the device": lambda i: many(*on_device[i % 8])}
    samples: dict[str, dict[str, list[float]]] = {k: {"dispatch_us": [], "call_us": []} for k in variants}
    for fn in variants.values():
        jax.block_until_ready(fn(0))
    for _ in range(args.rounds):
        for name, fn in variants.items():
            out = []
            start = time.perf_counter()
            for i in range(args.calls):
                out.append(fn(i))
            mid = time.perf_counter()
            jax.block_until_ready(out)
            end = time.perf_counter()
            samples[name]["dispatch_us"].append((mid - start) / args.calls * 1e6)
            samples[name]["call_us"].append((end - start) / args.calls * 1e6)
    rows = [{"variant": k, "leaves": len(LEAVES) if "packed" not in k else 1,
             "dispatch_us": round(float(np.median(v["dispatch_us"])), 1),
             "call_us": round(float(np.median(v["call_us"])), 1)} for k, v in samples.items()]
    print(f"{jax.devices()[0].device_kind} (jax {jax.__version__}), {len(LEAVES)} leaves, {args.calls} calls a round")
    print("| variant | arguments | dispatch us a call | us a call, end to end |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['leaves']} | {r['dispatch_us']} | {r['call_us']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows,
                       "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
