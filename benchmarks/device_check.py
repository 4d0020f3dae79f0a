"""One command for a GPU or TPU host: are the native kernels right, how fast are they, does the engine agree
with the CPU engine, and how close does an 8B-shaped model come to the device's roofline.

    python benchmarks/device_check.py [--out out/device_check]      # on the accelerator host (~3 min on an H100)
    python benchmarks/device_check.py --smoke                       # every part on this backend, tiny shapes

Parts (each recorded even when another fails; the exit status is 1 if any check failed):
1. parity: the chosen attention kernel (`jaxllm.kernels`, native on this platform) against the jnp reference
   over decode, prefill and mixed batches, float32 and bfloat16 caches, with and without a sliding window;
2. attention speed: decode 64 x 1024 and 256 x 2048 contexts and a mixed batch; KV bytes read per second
   against the device's peak HBM bandwidth (`jaxllm.plan.DEVICES`);
3. engine agreement: the embedded SmolLM2 (or `--model`) in float32 (must be identical) and bfloat16 on this
   device against the float32 CPU engine with the jnp kernels (run in a subprocess with JAX_PLATFORMS=cpu),
   greedy, the first diverging token per prompt;
4. 8B roofline: a Llama-3.1-8B-shaped model with random bfloat16 weights (no download): decode tok/s at batch 1,
   32, 128 and 256 (prompt 1024, 128 new tokens; 8192 tokens a step, the llama-3.1-8b-h100 preset's budget and
   vLLM's default on such a GPU) and prefill tok/s, against the HBM-bandwidth (decode) and
   FLOP (prefill) rooflines; and a device profile of decode steps at batch 1, 32 and 256 and of prefill steps
   (`device_profile.py`: time per kernel kind, idle gaps, the dearest kernels and their GB/s);
5. the decode step's matmuls: the Pallas skinny matmul against XLA's GEMM (cuBLAS) at the 8B model's weight
   shapes, 1 and 16 rows, in weight GB/s, and a sweep of the kernel's block sizes (`skinny_matmul_speed.py`);
and no recompilation during the timed runs of parts 3 and 4.
Writes device_check.json and device_check.md under --out (after each part). `--parts 41` runs some parts, in
that order.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm import LLM, SamplingParams
from jaxllm.config import ModelConfig
from jaxllm.engine import compile_monitor, step_options
from jaxllm.kernels import attention_kernel, choose_kernels
from jaxllm.loading.weights import abstract_model
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.plan import DEVICES, Device, bundled_model_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_profile as kernel_profile  # noqa: E402 (beside this script)
import skinny_matmul_speed  # noqa: E402
from paged_batch import random_paged_batch  # noqa: E402

T0 = time.perf_counter()
DEADLINE = float("inf")  # (perf_counter) past it, no part starts and part 4 takes no more profiles: --budget-s
PROFILE_STEPS = 9  # traced steps a decode profile covers (the first recomputes each cached prompt's last token)

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
           "Explain photosynthesis in one sentence.", "Who wrote Hamlet?", "What is 17 times 23?",
           "Name a color of the rainbow.", "Translate 'good morning' into Spanish.", "What is a paged KV cache?",
           "Give a synonym for happy.", "How many legs does a spider have?", "What is the boiling point of water?",
           "Describe a cat in five words.", "What does CPU stand for?", "Spell 'necessary' backwards.",
           "What is the largest planet?"]


@dataclasses.dataclass(frozen=True)
class Sizes:
    decode_shapes: tuple[tuple[int, int], ...]  # (sequences, context)
    mixed: tuple[tuple[int, int], ...]  # (query_len, context) per sequence
    heads: tuple[int, int, int]  # q heads, KV heads, head_dim (attention parts)
    page_size: int
    prompts: int
    engine_tokens: int
    model: ModelConfig
    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    engine: dict  # EngineConfig options of part 4's engine (only the buckets it runs: each is a long compile)
    agreement_engine: dict  # part 3's
    profile_batches: tuple[int, ...]  # decode batches of part 4 that are also profiled
    skinny: dict  # part 5's options (`skinny_matmul_speed.run`)


def sizes(smoke: bool) -> Sizes:
    if smoke:
        tiny = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
        return Sizes(((4, 64), (8, 128)), ((1, 40), (24, 24), (1, 100)), (4, 2, 16), 16, 2, 6, tiny, (1, 4), 32, 8,
                     {"max_num_batched_tokens": 64, "token_buckets": (4, 64)},
                     {"max_num_batched_tokens": 64, "token_buckets": (4, 64)}, (4,),
                     {"rows": (1, 3), "rounds": 2, "interpret": jax.default_backend() != "gpu", "min_copy_bytes": 1})
    return Sizes(((64, 1024), (256, 2048)), tuple([(1, 1024)] * 32 + [(512, 512), (512, 1536)]), (32, 8, 128), 16,
                 len(PROMPTS), 64, bundled_model_config("meta-llama/Llama-3.1-8B-Instruct"), (1, 32, 128, 256),
                 1024, 128, {"max_num_batched_tokens": 8192, "token_buckets": (1, 32, 128, 256, 1024, 8192)},
                 {"max_num_batched_tokens": 1024, "token_buckets": (16, 1024)}, (1, 32, 256), {})


def device_profile() -> Device | None:
    kind = jax.devices()[0].device_kind.lower()
    for key, device in DEVICES.items():
        if key in kind.replace(" ", ""):
            return device
    return None


def _attend(kernels, q, new, k, v, meta, **options):
    fn = jax.jit(functools.partial(attention_kernel(kernels), sm_scale=q.shape[-1] ** -0.5, **options))
    return fn(q, new, new, k, v, meta.slot_mapping, meta.kv_lens, meta.block_tables, meta.query_start_loc)


def part_parity(s: Sizes) -> dict:
    rows, ok = [], True
    for dtype in (jnp.float32, jnp.bfloat16):
        kernels = choose_kernels(dtype=dtype)
        reference = choose_kernels("reference", dtype=dtype)
        for name, seqs in (("decode", [(1, c) for c in (1, 17, 64, 90)]), ("prefill", [(37, 37), (20, 20)]),
                           ("mixed", [(1, 40), (13, 50), (21, 21), (1, 77)])):
            for window in (None, 24):
                q, new, k, v, meta = random_paged_batch(seqs, s.heads, s.page_size, dtype)
                got = np.asarray(_attend(kernels, q, new, k, v, meta, sliding_window=window)[0], np.float32)
                with jax.default_matmul_precision("highest"):  # XLA's GPU default for float32 dots is TF32
                    want = np.asarray(_attend(reference, q, new, k, v, meta, sliding_window=window)[0], np.float32)
                err = float(np.max(np.abs(got - want)))
                tol = 2e-5 if dtype == jnp.float32 else 3e-2
                rows.append({"kernel": kernels.attention, "dtype": jnp.dtype(dtype).name, "batch": name,
                             "sliding_window": window, "max_abs_err": err, "ok": err <= tol})
                ok &= err <= tol
    return {"ok": ok, "rows": rows}


CALLS = 10  # calls queued back to back per timed round: each call's host dispatch overlaps the one before, so a
# round times the device's work (timed one call at a time, an H100 host's dispatch and wait added 0.22-0.46 ms to
# a ~0.8 ms attention call: `benchmarks/results/device_check_h100_ab.json`)


def _timed_in_place(fn, q, new, k, v, *rest, rounds: int = 10) -> tuple[float, tuple]:
    """Median seconds per call of fn(q, new, k, v, *rest) -> (out, k, v) over `rounds` rounds of CALLS calls, k and v
    donated: each call gets the caches the last one returned. Returns the median and the final caches."""
    out, k, v = fn(q, new, k, v, *rest)
    jax.block_until_ready(out)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(CALLS):
            out, k, v = fn(q, new, k, v, *rest)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / CALLS)
    return float(np.median(times)), (k, v)


def _interleaved(trials: dict, rounds: int = 7) -> dict:
    """{name: (fn, args)} -> {name: median seconds per call, or the error that compiling or running it raised}.
    Every trial is compiled and run once first, then timed in rounds that take each trial in turn (A B C A B C
    ...), so that the device's clocks and any drift fall on all of them alike; a round is CALLS calls."""
    out, times = {}, {}
    for name, (fn, args) in trials.items():
        try:
            jax.block_until_ready(fn(*args))
            times[name] = []
        except Exception as e:  # noqa: BLE001 (a variant the compiler rejects is recorded, not fatal)
            out[name] = e
    for _ in range(rounds):
        for name in times:
            fn, args = trials[name]
            start = time.perf_counter()
            for _ in range(CALLS):
                result = fn(*args)
            jax.block_until_ready(result)
            times[name].append((time.perf_counter() - start) / CALLS)
    return out | {name: float(np.median(t)) for name, t in times.items()}


def part_attention_speed(s: Sizes, device: Device | None) -> dict:
    kernels = choose_kernels(dtype=jnp.bfloat16)
    rows = []
    cases = [(f"decode {n} x {ctx}", [(1, ctx)] * n) for n, ctx in s.decode_shapes] + [("mixed", list(s.mixed))]
    batches = {}
    # the caches donated and threaded from call to call, as the engine's step does: without donation the step's
    # cache write copies both caches first (the first H100 run's rows timed that copy: 3.4 ms where the kernel
    # alone took 1.44 ms at 256 x 2048)
    fn = jax.jit(lambda q, new, k, v, m, slots: attention_kernel(kernels)(
        q, new, new, k, v, slots, m.kv_lens, m.block_tables, m.query_start_loc, sm_scale=0.1), donate_argnums=(2, 3))
    for name, seqs in cases:
        q, new, k, v, meta = random_paged_batch(seqs, s.heads, s.page_size, jnp.bfloat16)
        no_slots = jnp.full_like(meta.slot_mapping, -1)  # the timing is the attention's, not the cache write's
        sec, (k, v) = _timed_in_place(fn, q, new, k, v, meta, no_slots)
        batches[name] = (q, new, k, v, meta)
        kv_bytes = sum(ctx for _, ctx in seqs) * 2 * s.heads[1] * s.heads[2] * 2
        gbs = kv_bytes / sec / 1e9
        rows.append({"case": name, "ms": sec * 1e3, "kv_GB_s": gbs,
                     "fraction_of_peak": gbs * 1e9 / device.hbm_bytes_per_s if device else None})
    out = {"ok": True, "kernel": kernels.attention, "rows": rows}
    if kernels.attention == "pallas_gpu":
        out["sweep"] = sweep_gpu_blocks(s, device, batches)
    return out


def sweep_gpu_blocks(s: Sizes, device: Device | None, batches: dict, interpret: bool = False) -> list[dict]:
    """The GPU kernel's decode block sizes tried on the decode shapes (`batches`: part 2's, by case name): the
    table's choice and its neighbours (KV splits on the smaller batch; tokens per iteration, warps and pipeline
    stages on the larger; larger pages), all of a shape timed interleaved (`_interleaved`)."""
    from pallas_kernels.ragged_paged_attention import gpu
    rows = []
    h, kvh, d = s.heads

    def attend(sizes):
        return jax.jit(functools.partial(gpu.ragged_paged_attention, sm_scale=0.1, sizes=sizes, interpret=interpret))

    def record(case, trials, base, n, ctx):
        kv_bytes = n * ctx * 2 * kvh * d * 2
        for (label, sizes), sec in _interleaved(trials).items():
            if isinstance(sec, Exception):
                rows.append({"case": label, **dataclasses.asdict(sizes), "error": str(sec)[:200]})
                continue
            gbs = kv_bytes / sec / 1e9
            rows.append({"case": label, **dataclasses.asdict(sizes), "table": sizes == base and label == case,
                         "ms": round(sec * 1e3, 4), "kv_GB_s": round(gbs, 1),
                         "fraction_of_peak": round(gbs * 1e9 / device.hbm_bytes_per_s, 4) if device else None})

    for i, (n, ctx) in enumerate(s.decode_shapes):
        q, _, k, v, meta = batches[f"decode {n} x {ctx}"]
        max_pages = meta.block_tables.shape[1]
        base = gpu.block_sizes(n, n, kvh, h // kvh, d, s.page_size, max_pages)
        if i == 0:  # KV splits
            variants = {dataclasses.replace(base, block_q=bq, num_splits=x) for bq in (1, base.block_q)
                        for x in (4, 8, 16)}
        else:  # sequences per program (1 and 2: a tile padded to MIN_ROWS rows) x tokens per iteration x stages
            variants = {dataclasses.replace(base, block_q=bq, tokens_per_iter=t, num_stages=st)
                        for bq in (1, 2, 4) for t in (64, 128) for st in (2, 3)}
            variants |= {dataclasses.replace(base, block_q=1, tokens_per_iter=64, num_warps=2)}
        variants.add(base)
        case = f"{n} x {ctx}"
        args = (q, k, v, meta.kv_lens, meta.block_tables, meta.query_start_loc)
        trials = {(case, sizes): (attend(sizes), args)
                  for sizes in sorted(variants, key=lambda b: (b != base, dataclasses.astuple(b)))}
        if i == len(s.decode_shapes) - 1:
            # larger pages at the largest shape (the engine's GPU page is 16 tokens): each page of a head one longer
            # contiguous load
            for page_size in (2 * s.page_size, 4 * s.page_size):
                qp, _, kp, vp, mp = random_paged_batch([(1, ctx)] * n, s.heads, page_size, jnp.bfloat16)
                pbase = gpu.block_sizes(n, n, kvh, h // kvh, d, page_size, mp.block_tables.shape[1])
                for sizes in {pbase, dataclasses.replace(pbase, tokens_per_iter=max(pbase.tokens_per_iter,
                                                                                    2 * page_size))}:
                    trials[(f"{case}, {page_size}-token pages", sizes)] = (
                        attend(sizes), (qp, kp, vp, mp.kv_lens, mp.block_tables, mp.query_start_loc))
        record(case, trials, base, n, ctx)
    return rows


def adopt_sweep_winner(part2: dict, s: Sizes) -> dict | None:
    """Makes the GPU kernel's decode table row the sweep's fastest at part 2's largest decode shape (in this
    process); returns the row adopted, or None when there is no sweep."""
    from pallas_kernels.ragged_paged_attention import gpu
    n, ctx = s.decode_shapes[-1]
    rows = [r for r in part2.get("sweep", []) if r["case"] == f"{n} x {ctx}" and "ms" in r]
    if not rows:
        return None
    best = min(rows, key=lambda r: r["ms"])
    h, kvh, d = s.heads
    key = gpu.table_key("decode", d)
    table_rows = best["block_q"] * gpu._pow2(h // kvh)  # tokens x the group, padded as the kernel pads it
    gpu.BLOCK_TABLE[key] = (table_rows, best["tokens_per_iter"], best["num_warps"], best["num_stages"])
    return {"key": list(key), "row": list(gpu.BLOCK_TABLE[key]), "from": best}


CPU_REFERENCE = """
import json, sys
from jaxllm import LLM, SamplingParams
options = json.loads(sys.argv[3])
options["token_buckets"] = tuple(options["token_buckets"]) if "token_buckets" in options else None
# the reference kernels: the CPU kernels' FFI guard refuses a jaxlib it was not checked against
llm = LLM(options.pop("model"), dtype="float32", attn_impl="reference", matmul_impl="reference", max_num_seqs=16,
          max_model_len=512, num_pages=16 * 32 + 8, **options)
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[1])],
                    SamplingParams(temperature=0, max_tokens=int(sys.argv[2]), ignore_eos=True), use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def part_engine_agreement(s: Sizes, dtypes: list[str], model: str | None) -> dict:
    """Greedy tokens of the engine on this device in each of `dtypes` against the float32 CPU engine (one run):
    float32 must be identical; bfloat16 is reported (rounding moves near-ties)."""
    rows, recompiles, prompts, ok = [], 0, None, True
    outputs = {}
    for dtype in dtypes:
        # 16 sequences of up to 512 tokens in 16-token pages
        llm = LLM(model, dtype=dtype, max_num_seqs=16, max_model_len=512, num_pages=16 * 32 + 8,
                  **s.agreement_engine)
        if prompts is None:
            tok = llm.get_tokenizer()
            prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                       for p in PROMPTS[:s.prompts]]
        params = SamplingParams(temperature=0, max_tokens=s.engine_tokens, ignore_eos=True)
        before = compile_monitor.snapshot()
        outputs[dtype] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                        params, use_tqdm=False)]
        recompiles += compile_monitor.snapshot()["compiles"] - before["compiles"]
        del llm
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", CPU_REFERENCE, json.dumps(prompts), str(s.engine_tokens),
                          json.dumps({"model": model, **s.agreement_engine})],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the CPU engine failed ({out.returncode}): {out.stderr[-3000:]}")
    cpu = json.loads(out.stdout.strip().splitlines()[-1])
    for dtype, ours in outputs.items():
        first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
                 for x, y in zip(ours, cpu, strict=True)]
        identical = sum(f is None for f in first)
        exact = jnp.dtype(dtype) == jnp.float32
        ok &= identical == len(prompts) or not exact
        rows.append({"dtype": dtype, "prompts": len(prompts), "identical": identical,
                     "must_be_identical": bool(exact), "first_divergence": str(first)})
    return {"ok": ok and recompiles == 0, "model": model or "embedded SmolLM2", "rows": rows,
            "recompiles_while_running": recompiles}


def random_stacked_model(cfg: ModelConfig) -> LlamaForCausalLM:
    """Random bfloat16 weights made directly in the stacked layout: initialising per layer and then stacking leaves
    the per-layer buffers' holes in the GPU allocator, and the 19.6 GB K cache of part 4 found no room among them
    (bytes in use 15 GiB of 59 GiB, yet 18.3 GiB could not be had)."""
    graphdef, state = nnx.split(abstract_model(cfg, jnp.bfloat16, choose_kernels(dtype=jnp.bfloat16)))
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    make = jax.jit(lambda key, shape, dtype: (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype),
                   static_argnums=(1, 2))
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, [make(k, x.shape, x.dtype) for k, x in zip(keys, leaves,
                                                                                                        strict=True)]))


def _log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {message}", flush=True)


def part_roofline(s: Sizes, device: Device | None, profile_dir: str | None, save=lambda part: None,
                  matmul_impl: str = "auto") -> dict:
    """Timings first (each row saved as it lands), then the profiles while the deadline allows."""
    cfg = s.model
    model = random_stacked_model(cfg)
    if matmul_impl != "auto":
        model.set_matmul_impl(matmul_impl)
    stats = jax.devices()[0].memory_stats() or {}  # None on CPU
    in_use = {"after_model_GB": stats.get("bytes_in_use", 0) / 1e9}
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(__import__("flax").nnx.state(model)))
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    top = max(s.batches)
    max_len = s.prompt_len + s.new_tokens + 16
    _log("8B model made; building the engine")
    llm = LLM(model=model, dtype="bfloat16", max_num_seqs=top, max_model_len=max_len,
              num_pages=top * -(-max_len // 16) + 8, **s.engine)
    startup = llm.engine.startup
    part = {"ok": False, "weight_GB": weight_bytes / 1e9, "matmul": model.matmul_impl, "startup": startup.summary(),
            "rows": [], "profiles": {}}
    _log(f"engine built: {startup.summary()}")
    save(part)
    rng = np.random.default_rng(0)
    rows, recompiles, prompts_of = part["rows"], 0, {}
    for batch in s.batches:
        prompts = [{"prompt_token_ids": rng.integers(0, cfg.vocab_size, s.prompt_len).tolist()} for _ in range(batch)]
        prompts_of[batch] = prompts
        before = compile_monitor.snapshot()["compiles"]
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        many = SamplingParams(temperature=0, max_tokens=s.new_tokens, ignore_eos=True)
        timings = []
        # cold prefill; then, with the prompts in the prefix cache, one token and all the new tokens: their
        # difference is the decode of new_tokens - 1 tokens per sequence
        for params in (one, one, many):
            start = time.perf_counter()
            with HostTimeline(llm.engine.runner) as host:
                llm.generate(prompts, params, use_tqdm=False)
            timings.append(time.perf_counter() - start)
        prefill_s, cached_one_s, cached_many_s = timings
        recompiles += compile_monitor.snapshot()["compiles"] - before
        decode_s = cached_many_s - cached_one_s
        decode_tok_s = batch * (s.new_tokens - 1) / decode_s
        prefill_tok_s = batch * s.prompt_len / prefill_s
        context = s.prompt_len + s.new_tokens // 2
        row = {"batch": batch, "decode_tok_s": decode_tok_s, "prefill_tok_s": prefill_tok_s,
               "host_ms_per_step": host.per_step(cached_many_s)}
        if device:
            roof = batch * device.hbm_bytes_per_s / (weight_bytes + batch * context * kv_token)
            flops = 2 * weight_bytes / 2 * s.prompt_len * batch  # 2 FLOPs per parameter per token
            row |= {"decode_roofline_tok_s": roof, "decode_fraction": decode_tok_s / roof,
                    "prefill_fraction": (flops / prefill_s) / device.bf16_flops}
        rows.append(row)
        part |= {"ok": recompiles == 0, "recompiles_while_running": recompiles}
        _log(f"batch {batch}: {row}")
        save(part)
    if profile_dir is not None:
        for batch in s.profile_batches:
            if time.perf_counter() > DEADLINE:
                break
            # re-cached first (a later batch may have evicted these prompts): every traced step is a decode step
            llm.generate(prompts_of[batch], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            part["profiles"][f"decode {batch}"] = _profile_decode(llm, prompts_of[batch], batch,
                                                                  Path(profile_dir) / f"decode{batch}")
            _log(f"profiled decode {batch}")
            save(part)
        if time.perf_counter() < DEADLINE:
            fresh = [{"prompt_token_ids": rng.integers(0, cfg.vocab_size, s.prompt_len).tolist()}
                     for _ in range(max(1, min(top, s.engine["max_num_batched_tokens"] // s.prompt_len)))]
            part["profiles"]["prefill"] = _profile_prefill(llm, fresh, Path(profile_dir) / "prefill")
            _log("profiled prefill")
    stats = jax.devices()[0].memory_stats() or {}
    in_use |= {k: v / 1e9 for k, v in stats.items() if k in ("peak_bytes_in_use", "bytes_limit")}
    part["memory_GB"] = in_use
    return part


class HostTimeline:
    """Where the host's time goes while the engine runs: in the runner's dispatch (building a step's inputs and
    enqueueing it: a dispatch that waits on the device shows here), in its collect (waiting for the device to finish
    a step and reading its tokens back), and the rest (scheduling, outputs). Wraps the runner's two methods on the
    instance for the `with` block."""

    def __init__(self, runner):
        self.runner, self.seconds, self.steps = runner, {"dispatch": 0.0, "collect": 0.0}, 0

    def __enter__(self) -> HostTimeline:
        for name in self.seconds:
            setattr(self.runner, name, self._timed(name, getattr(self.runner, name)))
        return self

    def _timed(self, name: str, call):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.steps += name == "dispatch"
        return timed

    def __exit__(self, *exc) -> None:
        for name in self.seconds:
            delattr(self.runner, name)

    def per_step(self, wall_s: float) -> dict:
        n = max(self.steps, 1)
        out = {k: round(v / n * 1e3, 3) for k, v in self.seconds.items()}
        return out | {"other": round((wall_s - sum(self.seconds.values())) / n * 1e3, 3), "steps": self.steps}


def _profile_decode(llm: LLM, prompts: list[dict], batch: int, logdir: Path) -> dict:
    """The device profile of decode steps at `batch` (prompts already in the prefix cache: every step is the
    decode bucket's)."""
    runner = llm.engine.runner
    bucket = runner.bucket_for(batch, batch)
    params = SamplingParams(temperature=0, max_tokens=PROFILE_STEPS, ignore_eos=True)
    out = kernel_profile.profile(lambda: llm.generate(prompts, params, use_tqdm=False), logdir,
                                 [runner.build(bucket).as_text()])
    return {"bucket": str(bucket), **out}


def _profile_prefill(llm: LLM, prompts: list[dict], logdir: Path) -> dict:
    """The device profile of prefill steps: new prompts filling the token budget, one token each."""
    runner = llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    bucket = runner.bucket_for(min(tokens, llm.engine.config.max_num_batched_tokens), len(prompts))
    out = kernel_profile.profile(lambda: llm.generate(prompts, params, use_tqdm=False), logdir,
                                 [runner.build(bucket).as_text()])
    return {"bucket": str(bucket), **out}


def to_markdown(report: dict) -> str:
    lines = [f"# device_check: {report['device']} ({report['backend']}){' — smoke' if report['smoke'] else ''}", ""]
    if report.get("xla_flags"):
        lines += [f"XLA_FLAGS: `{report['xla_flags']}`", ""]
    if report.get("step_options"):
        lines += [f"step options (GPU): `{report['step_options']}`", ""]
    for name, part in report["parts"].items():
        lines.append(f"## {name}: {'ok' if part.get('ok') else 'FAILED'}")
        rows = part.get("rows")
        if rows:
            keys = list(rows[0])
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            for r in rows:
                lines.append("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values())
                             + " |")
        tables = {k: v for k, v in part.items() if k != "rows" and isinstance(v, list) and v
                  and all(isinstance(r, dict) for r in v)}
        rest = {k: v for k, v in part.items() if k not in ("rows", "ok", "profiles", *tables)}
        if rest:
            lines.append("")
            lines.append(", ".join(f"{k}: {v}" for k, v in rest.items()))
        lines.append("")
        for key, table in tables.items():
            keys = list(dict.fromkeys(k for r in table for k in r))
            lines += [f"### {key}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in table] + [""]
        for case, prof in part.get("profiles", {}).items():
            lines += _profile_markdown(case, prof)
    return "\n".join(lines)


def _profile_markdown(case: str, prof: dict) -> list[str]:
    lines = [f"### profile: {case}", ""]
    if "error" in prof:
        return lines + [f"error: {prof['error']}", ""]
    lines.append(f"bucket {prof['bucket']}, {prof['steps']} steps: {prof['step_ms']} ms a step, device busy "
                 f"{prof['busy_ms']} ms, idle {prof['idle_ms']} ms, {prof['launches_per_step']} kernels a step "
                 f"({prof['annotated']:.0%} matched to the program)")
    lines += ["", "| kind | ms a step |", "|---|---|"] + [f"| {k} | {v} |" for k, v in prof["kinds_ms"].items()]
    keys = list(prof["top"][0]) if prof["top"] else []
    lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(v) for v in r.values()) + " |" for r in prof["top"]]
    if prof.get("host_top"):
        lines += ["", "host events (inclusive; nested events each count their span):", "",
                  "| event | thread | calls a step | ms a step |", "|---|---|---|---|"]
        lines += [f"| {r['event']} | {r['thread']} | {r['calls_per_step']} | {r['ms_per_step']} |"
                  for r in prof["host_top"]]
    return lines + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, on whatever backend this is")
    p.add_argument("--out", default="out/device_check")
    p.add_argument("--parts", default="12345", help="which parts to run, e.g. 14")
    p.add_argument("--engine-dtypes", default="float32,bfloat16",
                   help="part 3's dtypes on this device (float32 must be identical to the CPU engine)")
    p.add_argument("--model", help="part 3's model (default: the embedded SmolLM2; a lent GPU host gets a cut copy, "
                                   "benchmarks/truncate_gguf.py)")
    p.add_argument("--no-profile", action="store_true", help="part 4 without its device profiles")
    p.add_argument("--traces", help="where part 4's profiler traces go (default: OUT/traces)")
    p.add_argument("--adopt-sweep", action="store_true",
                   help="part 4 runs with part 2's fastest decode block sizes at its largest shape (run 2 first)")
    p.add_argument("--budget-s", type=float, help="seconds after which no part starts (a lent host's time limit)")
    p.add_argument("--step-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA option the GPU step compiles with (replaces jaxllm.engine.step_options' value; "
                        "true/false for booleans): an A/B of the step's options")
    p.add_argument("--batches", help="part 4's decode batches, e.g. 1,32 (default: 1,32,128,256), each profiled")
    p.add_argument("--attention-merge", choices=("kernel", "reference"), default="kernel",
                   help="how the GPU attention merges its KV splits: its Pallas merge kernel, or XLA's reductions "
                        "(an A/B)")
    p.add_argument("--matmul-impl", default="auto", help="part 4's matmul kernel (jaxllm.kernels: an A/B of "
                                                         "reference, XLA's GEMM, against the auto choice)")
    args = p.parse_args()
    global DEADLINE
    if args.budget_s:
        DEADLINE = T0 + args.budget_s
    compile_monitor.install()
    for option in args.step_option:
        name, _, value = option.partition("=")
        step_options.GPU_OPTIONS[name] = {"true": True, "false": False}.get(value.lower(), value)
    if args.attention_merge == "reference":
        from pallas_kernels.ragged_paged_attention import gpu
        gpu.merge_splits = gpu.merge_splits_reference
    s = sizes(args.smoke)
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
        s = dataclasses.replace(s, batches=batches, profile_batches=batches, engine=s.engine | {
            "token_buckets": tuple(sorted({*batches, s.prompt_len, s.engine["max_num_batched_tokens"]}))})
    device = device_profile()
    import flax
    report = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "smoke": args.smoke,
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "step_options": step_options.GPU_OPTIONS,
              "attention_merge": args.attention_merge, "matmul_impl": args.matmul_impl,
              "versions": {"jax": jax.__version__, "jaxlib": jax.lib.__version__, "flax": flax.__version__},
              "parts": {}}
    parts = {"1 kernel parity": lambda: part_parity(s),
             "2 attention speed": lambda: part_attention_speed(s, device),
             "3 engine agreement (this device vs the CPU engine, greedy)":
                 lambda: part_engine_agreement(s, args.engine_dtypes.split(","), args.model),
             "4 8B-shaped roofline": lambda: part_roofline(
                 s, device, None if args.no_profile else args.traces or f"{args.out}/traces",
                 lambda part: write(report | {"parts": report["parts"] | {"4 8B-shaped roofline": part}}),
                 args.matmul_impl),
             "5 skinny matmul speed": lambda: skinny_matmul_speed.run(
                 s.model, device.hbm_bytes_per_s if device else None, **s.skinny)}
    out = Path(args.out)

    def write(r: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "device_check.json").write_text(json.dumps(r, indent=1))
        (out / "device_check.md").write_text(to_markdown(r))

    for name, run in sorted(parts.items(), key=lambda kv: args.parts.find(kv[0][0])):  # in --parts' order
        if name[0] not in args.parts:
            continue
        if name[0] == "4" and args.adopt_sweep:
            report["adopted_decode_row"] = adopt_sweep_winner(report["parts"].get("2 attention speed", {}), s)
        if time.perf_counter() > DEADLINE:
            report["parts"][name] = {"ok": False, "error": "skipped: --budget-s spent"}
            write(report)
            continue
        _log(f"{name}: starting")
        start = time.perf_counter()
        try:
            report["parts"][name] = run()
        except Exception as e:  # every part runs; a failure is recorded with its traceback
            report["parts"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc(limit=5)}
        report["parts"][name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {'ok' if report['parts'][name]['ok'] else 'FAILED'} "
              f"({report['parts'][name]['seconds']} s)", flush=True)
        write(report)  # after every part: a host that cuts the run short still leaves the parts already done
    print(to_markdown(report))
    sys.exit(0 if all(part["ok"] for part in report["parts"].values()) else 1)


if __name__ == "__main__":
    main()
