"""Plumbing for the CPU kernels: numba code called from a jitted step through XLA's typed FFI, and a parallel
for-loop that runs on XLA's own intra-op thread pool.

The FFI handler is a numba ``cfunc`` that reads XLA's C call frame (``xla/ffi/api/c_api.h``, API 0.3) by byte
offsets, so no C++ toolchain is needed; buffers are used in place. `check_ffi_abi` guards those offsets: before a
kernel is registered, the installed jaxlib's header must declare the API version and the very struct definitions
they were read from, or registration fails with an error that says which struct changed.

Why XLA's thread pool rather than numba's ``prange``: inside a jitted step XLA's Eigen workers are awake
(spinning) between thunks, so OpenMP workers on the same cores fight them. Measured on 2 cores, the 120
single-token matmuls of SmolLM2: 22.4 ms with XLA's dot, 21.4-26 ms with a numba ``prange`` kernel (whatever
the OpenMP wait policy), 18.4 ms with the same kernel's chunks shared with one task on XLA's pool.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import platform
import re
import threading
import time
from pathlib import Path

import jax
import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_ARCH = platform.machine().lower()
_CLOCK_MONOTONIC = time.CLOCK_MONOTONIC  # this platform's clockid (`call_clock` takes timespec as two 64-bit words)


def drop_stale_cache(module_file: str) -> None:
    """Call at the top of a module whose numba functions use this one, before they are defined. numba's on-disk
    cache checks only the source file of each function, not the files it calls into: after an edit of this
    file (or of another kernel file whose IR a kernel inlines), a kernel module's cached machine code would still
    hold the old code. Its cached files in ``__pycache__`` are deleted when the package's source changed since
    they were written (`_package_hash`)."""
    cache_dir = os.path.join(os.path.dirname(module_file), "__pycache__")
    stem = os.path.splitext(os.path.basename(module_file))[0]
    stamp_path = os.path.join(cache_dir, f"{stem}.cpu_ffi.stamp")
    try:
        with open(stamp_path) as f:
            if f.read() == _SOURCE_HASH:
                return
    except OSError:
        pass
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for path in glob.glob(os.path.join(cache_dir, f"{stem}.*.nb[ic]")):
            os.remove(path)
        with open(stamp_path, "w") as f:
            f.write(_SOURCE_HASH)
    except OSError:  # read-only install: numba caches elsewhere, keyed by files that only change together
        pass


def _package_hash() -> str:
    """Every source file of the kernels' package (and numba's version): the code a kernel's machine code may come
    from. A kernel's loops close over intrinsics whose LLVM IR other files generate (`stable_key` ids them by their
    parameters, not their code), so an edit anywhere in the package must drop every kernel's cache, not only an
    edit of this file (a development checkout once ran a stale int8 kernel this way)."""
    h = hashlib.sha256(numba.__version__.encode())
    root = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        h.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


_SOURCE_HASH = _package_hash()


def _load(bits: int):
    @intrinsic
    def load(typingctx, addr):
        def codegen(context, builder, sig, args):
            return builder.load(builder.inttoptr(args[0], ir.IntType(bits).as_pointer()))
        return getattr(types, f"int{bits}")(types.int64), codegen
    return load


def _store(bits: int):
    @intrinsic
    def store(typingctx, addr, val):
        def codegen(context, builder, sig, args):
            builder.store(args[1], builder.inttoptr(args[0], ir.IntType(bits).as_pointer()))
            return context.get_dummy_value()
        return types.void(types.int64, getattr(types, f"int{bits}")), codegen
    return store


load64, load32, store64, store32 = _load(64), _load(32), _store(64), _store(32)


@intrinsic
def to_int(typingctx, ptr):
    return types.int64(types.voidptr), lambda ctx, b, sig, args: b.ptrtoint(args[0], ir.IntType(64))


@intrinsic
def to_ptr(typingctx, addr):
    return types.voidptr(types.int64), lambda ctx, b, sig, args: b.inttoptr(args[0], ctx.get_value_type(types.voidptr))


@intrinsic
def fetch_add(typingctx, addr, val):
    """Atomic ``*addr += val``; returns the old value."""
    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", builder.inttoptr(args[0], ir.IntType(64).as_pointer()), args[1], "seq_cst")
    return types.int64(types.int64, types.int64), codegen


@intrinsic
def compare_and_swap(typingctx, addr, old, new):
    """Atomic ``if *addr == old: *addr = new``; returns whether it swapped."""
    def codegen(context, builder, sig, args):
        res = builder.cmpxchg(builder.inttoptr(args[0], ir.IntType(64).as_pointer()), args[1], args[2],
                              "seq_cst", "seq_cst")
        return builder.extract_value(res, 1)
    return types.boolean(types.int64, types.int64, types.int64), codegen


@intrinsic
def load_acquire(typingctx, addr):
    def codegen(context, builder, sig, args):
        return builder.load_atomic(builder.inttoptr(args[0], ir.IntType(64).as_pointer()), "acquire", 8)
    return types.int64(types.int64), codegen


@intrinsic
def spin_pause(typingctx):
    """The CPU's spin-wait hint (x86 ``pause``, Arm ``yield``): a polling loop leaves the core's other hardware
    thread its issue slots and does not flood the memory system with reads."""
    def codegen(context, builder, sig, args):
        if _ARCH in ("x86_64", "amd64"):
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                        "llvm.x86.sse2.pause"), [])
        elif _ARCH in ("aarch64", "arm64"):
            builder.asm(ir.FunctionType(ir.VoidType(), []), "yield", "", [], True)
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def call_clock(typingctx, fn):
    """Calls ``clock_gettime(CLOCK_MONOTONIC, &ts)`` at address ``fn``; returns the time in nanoseconds."""
    def codegen(context, builder, sig, args):
        i64, i32 = ir.IntType(64), ir.IntType(32)
        ts = cgutils.alloca_once(builder, ir.ArrayType(i64, 2))  # struct timespec: seconds, nanoseconds
        words = builder.bitcast(ts, i64.as_pointer())
        f = builder.inttoptr(args[0], ir.FunctionType(i32, [i32, i64.as_pointer()]).as_pointer())
        builder.call(f, [ir.Constant(i32, _CLOCK_MONOTONIC), words])
        seconds = builder.load(builder.gep(words, [ir.Constant(i32, 0)]))
        nanoseconds = builder.load(builder.gep(words, [ir.Constant(i32, 1)]))
        return builder.add(builder.mul(seconds, ir.Constant(i64, 1_000_000_000)), nanoseconds)
    return types.int64(types.int64), codegen


def ir_prefetch(b, addr, locality: int) -> None:
    """A read hint for the cache line at the i64 address `addr` (never faults): locality 3 into every level, 2 into
    L2 and below (`prefetch`, `prefetch_l2`)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0")
    b.call(fn, [b.inttoptr(addr, i8p), ir.Constant(i32, 0), ir.Constant(i32, locality), ir.Constant(i32, 1)])


def _prefetch(locality: int):
    @intrinsic
    def prefetch(typingctx, addr):
        def codegen(context, builder, sig, args):
            ir_prefetch(builder, args[0], locality)
            return context.get_dummy_value()
        return types.void(types.int64), codegen
    return prefetch


# Hints the cache line at an address into the caches (a read; never faults): `prefetch` into every level, for
# what is read next (an attention page); `prefetch_l2` into L2 and below, for a stream read some rows ahead (a
# decode step's weights). Weight rows prefetched into L1 evicted the rows being read, the more so the longer the
# rows (docs/performance.md, "A decode step's weights streamed at memory speed").
prefetch, prefetch_l2 = _prefetch(3), _prefetch(2)


@intrinsic
def keep_alive(typingctx, arr):
    """Holds a numba array's reference up to this point. numba releases a variable right after its last use in
    the function's IR, so an array known only by its address (``arr.ctypes.data``) is freed, and its memory
    handed to the next allocation of any thread, while the raw address is still being written through: call
    this after the last access through such an address."""
    return types.void(arr), lambda context, builder, sig, args: context.get_dummy_value()


@intrinsic
def call_c0(typingctx, fn):
    """Calls the C function at address ``fn`` as ``int fn(void)``."""
    def codegen(context, builder, sig, args):
        f = builder.inttoptr(args[0], ir.FunctionType(ir.IntType(32), []).as_pointer())
        builder.call(f, [])
        return context.get_dummy_value()
    return types.void(types.int64), codegen


@intrinsic
def call_c(typingctx, fn, arg):
    """Calls the C function at address ``fn`` as ``void *fn(void *arg)``; returns its result as an int."""
    def codegen(context, builder, sig, args):
        p = ir.IntType(8).as_pointer()
        f = builder.inttoptr(args[0], ir.FunctionType(p, [p]).as_pointer())
        return builder.ptrtoint(builder.call(f, [builder.inttoptr(args[1], p)]), ir.IntType(64))
    return types.int64(types.int64, types.int64), codegen


def _stack_words(count: int):
    @intrinsic
    def stack_words(typingctx):
        """The address of ``count`` int64 words on the calling function's stack."""
        def codegen(context, builder, sig, args):
            words = cgutils.alloca_once(builder, ir.ArrayType(ir.IntType(64), count))
            return builder.ptrtoint(words, ir.IntType(64))
        return types.int64(), codegen
    return stack_words


def symbol(name: str, function: bool = False):
    """An intrinsic ``() -> int64``: the address of the process symbol ``name`` (a C function with ``function``,
    else data), resolved when the compiled code is loaded, not when it is compiled: compiled code that uses it
    stays valid in numba's on-disk cache from one process to the next. Define the symbol with `export_symbol`
    before that code is compiled or loaded."""
    @intrinsic
    def address(typingctx):
        def codegen(context, builder, sig, args):
            g = builder.module.globals.get(name)
            if g is None:
                g = ir.Function(builder.module, ir.FunctionType(ir.VoidType(), []), name) if function else \
                    ir.GlobalVariable(builder.module, ir.IntType(64), name)
            return builder.ptrtoint(g, ir.IntType(64))
        return types.int64(), codegen
    return stable_key(address, "symbol", name, function)


def stable_key(intr, *key):
    """Gives the numba intrinsic `intr`, built by a factory from the parameters `key`, an id derived from them (and
    returns it). numba's disk cache keys a function by pickling its closure, and an intrinsic pickles with its id,
    a fresh uuid in every process by default: a kernel whose loops close over intrinsics would miss the cache,
    compile again and add an entry, in every process. `key` must tell apart every intrinsic of the process."""
    intr._set_uuid("jaxllm-" + hashlib.sha256(repr(key).encode()).hexdigest()[:32])
    return intr


def export_symbol(name: str, address: int) -> None:
    """Makes ``name`` resolve to ``address`` for numba code loaded from now on (see `symbol`)."""
    llvm.add_symbol(name, address)


# -- LLVM IR helpers for the kernels' inner loops (here, so that an edit drops the kernels' cached machine code)
def ir_fma16(b, x, y, z):
    """llvm.fma on <16 x float>: one rounding, whatever the target's vector width."""
    v = ir.VectorType(ir.FloatType(), 16)
    return b.call(cgutils.get_or_insert_function(b.module, ir.FunctionType(v, [v, v, v]), "llvm.fma.v16f32"),
                  [x, y, z])


def ir_hsum(b, v):
    """A fixed-order sum of a <16 x float>'s lanes: halves added until one lane is left."""
    i32 = ir.IntType(32)
    width = v.type.count
    while width > 1:
        width //= 2
        lo, hi = (b.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(s, s + width))))
                  for s in (0, width))
        v = b.fadd(lo, hi)
    return b.extract_element(v, ir.Constant(i32, 0))


def ir_for(b, count, carried, body):
    """for i in range(count) (i64): carried = body(i, carried); returns the final carried values."""
    i64 = ir.IntType(64)
    pre = b.block
    head, loop, done = (b.append_basic_block(name) for name in ("head", "loop", "done"))
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(i64)
    i.add_incoming(ir.Constant(i64, 0), pre)
    phis = []
    for v in carried:
        phi = b.phi(v.type)
        phi.add_incoming(v, pre)
        phis.append(phi)
    b.cbranch(b.icmp_signed("<", i, count), loop, done)
    b.position_at_end(loop)
    new = body(i, phis)
    i.add_incoming(b.add(i, ir.Constant(i64, 1)), b.block)
    for phi, v in zip(phis, new, strict=True):
        phi.add_incoming(v, b.block)
    b.branch(head)
    b.position_at_end(done)
    return phis


# -- the call frame (XLA_FFI_CallFrame): api +16, ctx +24, stage +32, args.args +72, rets.rets +112
@numba.njit(inline="always")
def buffer(frame, i, ret=False):
    """(data address, dims address) of argument (or result) ``i``; XLA_FFI_Buffer: data +24, dims +40."""
    b = load64(load64(frame + (112 if ret else 72)) + 8 * i)
    return load64(b + 24), load64(b + 40)


# XLA_FFI_DataType values (xla_data.proto's PrimitiveType) the kernels dispatch on
U8, F16, F32, BF16 = 6, 10, 11, 16
# The element types kernels read float arrays as, by XLA_FFI_DataType (`widen`)
ELEMENT_TYPES = {F32: np.float32, F16: np.uint16, BF16: np.int16}


@numba.njit(inline="always")
def buffer_dtype(frame, i):
    """XLA_FFI_Buffer.dtype (+16) of argument ``i``."""
    return load32(load64(load64(frame + 72) + 8 * i) + 16)


@intrinsic
def widen(typingctx, x):
    """An element as float32: float32 as is, float16 bits (uint16) converted exactly, bfloat16 bits (int16) as the
    upper half of a float32's. numba has no 16-bit float types: kernels see 16-bit arrays as integer arrays whose
    type names the format (`ELEMENT_TYPES`)."""
    if x == types.float32:
        return types.float32(x), lambda context, builder, sig, args: args[0]
    if x == types.uint16:
        def codegen(context, builder, sig, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(x), codegen
    if x == types.int16:
        def codegen(context, builder, sig, args):
            bits = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(bits, ir.FloatType())
        return types.float32(x), codegen
    return None


@numba.njit(inline="always")
def dim(dims, i):
    return load64(dims + 8 * i)


@numba.njit(inline="always")
def is_execute(frame):
    """Answers XLA's metadata query (FFI API 0.3, no traits) and says whether this call is the EXECUTE stage,
    the only one with work to do."""
    ext = load64(frame + 8)
    if ext != 0:
        if load32(ext + 8) == 1:  # XLA_FFI_Extension_Metadata
            md = load64(ext + 24)
            store64(md + 8, 24)
            store64(md + 16, 0)
            store32(md + 24, np.int32(0))
            store32(md + 28, np.int32(3))
            store32(md + 32, np.int32(0))
        return False
    return load32(frame + 32) == 3


# -- a parallel for-loop on XLA's intra-op thread pool
# A launch claims a slot of a process-wide table (a late task may still read it after the caller returns, so
# the slot, not the caller's stack, holds the arguments; it is freed by whoever drops the last reference).
# Slot layout in 64-byte lines of 8 words: line 0 is [0] references (0 = free), [1] chunks, [2] chunks done,
# [3] helpers started, [4] the chunk function; lines 1-4 the kernel's words; line 5 + w worker w's range of
# chunks: [0] the next chunk to claim, [1] the end. Each range counter has its own cache line: its owner claims
# chunks from it without contention until a worker that ran out of work steals from it.
# The calling thread is worker 0; one helper per other core. More would only contend for the cores.
# Everything that differs between processes or machines (the table's address, the worker count, the task's
# address) is read at run time through exported symbols, never frozen into the compiled code, so that numba's
# on-disk cache serves every process: compiling this plumbing and the kernels takes seconds, loading them a
# fraction of one.
MAX_WORKERS = 64
_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
WORKERS = min(MAX_WORKERS, max(1, _cores))
_WORDS_AT, _RANGES_AT = 64, 320  # byte offsets: the kernel's words (so at most 32 of them), the first range
NUM_SLOTS, SLOT_WORDS, MAX_SLOT_WORDS = 256, 8 * (5 + WORKERS), 8 * (5 + MAX_WORKERS)
_slots = np.zeros((NUM_SLOTS, SLOT_WORDS), np.int64)
_workers = np.array([WORKERS], np.int64)
export_symbol("jaxllm_cpu_ffi_slots", _slots.ctypes.data)
export_symbol("jaxllm_cpu_ffi_workers", _workers.ctypes.data)
export_symbol("jaxllm_cpu_ffi_sched_yield", ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value)
_slots_address, _workers_address = symbol("jaxllm_cpu_ffi_slots"), symbol("jaxllm_cpu_ffi_workers")
_sched_yield, _task_address = symbol("jaxllm_cpu_ffi_sched_yield", True), symbol("jaxllm_cpu_ffi_task", True)
_slot_on_stack, _schedule_args, _destroy_args = _stack_words(MAX_SLOT_WORDS), _stack_words(5), _stack_words(3)
# Waiting for a helper's last chunk spins, then yields the core: on an oversubscribed host (a server's request
# thread wants it) a spin must not hold a core for a whole time slice.
SPINS_BEFORE_YIELD = 1000
# Lingering helpers. XLA's pool puts an idle worker to sleep after a short spin, and a launch that had to wake it
# waited ~30-40 us on a VM (an output projection after a step of work on the calling thread alone: 44-56 us a call,
# 15-18 us with the worker awake). A step's launches are separated by a few us of small XLA ops on the calling
# thread (norms, residual adds, the layer loop's bookkeeping), steps by the host's work (85 us median, 280 us p90
# for a single stream with async scheduling), and a woken helper came in late for the call that followed
# (docs/performance.md, "Helpers that linger"). So a helper task, once its own chunks are done, waits up to
# LINGER_NS on a mailbox of its own (a cache line of `_mailboxes`), yielding its core to any thread that wants it,
# and a launch hands its slot to a waiting helper with one compare-and-swap instead of scheduling a task. A mailbox
# holds ABSENT (nobody waits on it), WAITING (a helper polls it) or the address of a slot posted to that helper; the
# line's next word counts the slots run from it. Box w (1 <= w < workers()) is for one helper at a time; a helper
# that finds every box taken leaves. The wait is read at run time (`set_linger`). 300 us covers most gaps between
# steps, and on 2 cores it measured as fast as 1 ms. It also bounds what a waiting helper costs XLA's own parallel
# ops (a float32 prefill's dots): they run without that pool thread until it leaves.
LINGER_NS = 300_000
ABSENT, WAITING = 0, 1
_mailboxes = np.zeros((MAX_WORKERS, 8), np.int64)
_linger_ns = np.array([LINGER_NS], np.int64)
export_symbol("jaxllm_cpu_ffi_mailboxes", _mailboxes.ctypes.data)
export_symbol("jaxllm_cpu_ffi_linger_ns", _linger_ns.ctypes.data)
export_symbol("jaxllm_cpu_ffi_clock_gettime", ctypes.cast(ctypes.CDLL(None).clock_gettime, ctypes.c_void_p).value)
_mailboxes_address, _clock = symbol("jaxllm_cpu_ffi_mailboxes"), symbol("jaxllm_cpu_ffi_clock_gettime", True)
_linger_address = symbol("jaxllm_cpu_ffi_linger_ns")


def set_linger(ns: int) -> int:
    """Sets how long an idle helper waits for the next launch (0: it leaves at once); returns the previous wait."""
    previous = int(_linger_ns[0])
    _linger_ns[0] = max(0, int(ns))
    return previous


def lingering() -> list[tuple[int, int]]:
    """The mailboxes' states (ABSENT, WAITING, or a posted slot's address) and how many slots each has run:
    [(state, runs)] for boxes 1 .. workers() - 1."""
    return [(int(_mailboxes[w, 0]), int(_mailboxes[w, 1])) for w in range(1, WORKERS)]


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's pool threads: no helper waits on a box, no task holds a slot."""
    _mailboxes.fill(ABSENT)
    _slots.fill(0)


os.register_at_fork(after_in_child=_after_fork_in_child)
API_SCHEDULE, API_ERROR_DESTROY = 136, 64  # XLA_FFI_Api: XLA_FFI_ThreadPool_Schedule, XLA_FFI_Error_Destroy
_CACHED = dict(nogil=True, cache=True)


@numba.njit(inline="always", **_CACHED)
def workers():
    """How many threads share a launch (this process's value, read at run time)."""
    return load64(_workers_address())


@intrinsic
def call_chunk(typingctx, fn, words, chunk):
    """Calls the C function at address ``fn`` as ``void fn(int64 words, int64 chunk)``."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        f = builder.inttoptr(args[0], ir.FunctionType(ir.VoidType(), [i64, i64]).as_pointer())
        builder.call(f, [args[1], args[2]])
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64), codegen


@numba.njit(**_CACHED)
def _drain(slot, worker):
    """Runs chunks for ``worker``: its own range first, then what is left of the others'."""
    n, fn, done = workers(), load64(slot + 32), 0
    for j in range(n):
        counter = slot + _RANGES_AT + 64 * ((worker + j) % n)
        end = load64(counter + 8)
        while True:
            c = fetch_add(counter, 1)
            if c >= end:
                break
            call_chunk(fn, slot + _WORDS_AT, c)
            done += 1
    fetch_add(slot + 16, done)


@numba.njit(inline="always", **_CACHED)
def _help(slot):
    """A helper's share of a launch: chunks as worker 1, 2, ... (in the order helpers join), then its reference
    dropped."""
    _drain(slot, 1 + fetch_add(slot + 24, 1))
    fetch_add(slot, -1)


@numba.njit(**_CACHED)
def _linger():
    """Waits on a free mailbox for slots posted to it, runs each, and leaves once none came for the wait
    `set_linger` sets (LINGER_NS unless changed)."""
    if load64(_linger_address()) <= 0:
        return
    boxes, box = _mailboxes_address(), 0
    for w in range(1, workers()):
        if compare_and_swap(boxes + 64 * w, ABSENT, WAITING):
            box = boxes + 64 * w
            break
    if box == 0:
        return
    since, spins = call_clock(_clock()), 0
    while True:
        posted = load_acquire(box)
        if posted != WAITING:
            _help(posted)
            fetch_add(box + 8, 1)
            compare_and_swap(box, posted, WAITING)  # only this helper changes a box that holds a slot
            since, spins = call_clock(_clock()), 0
            continue
        spins += 1
        if spins % 64 == 0:
            if call_clock(_clock()) - since >= load64(_linger_address()) and compare_and_swap(box, WAITING, ABSENT):
                return  # (had the swap failed, a slot was posted just then: the loop runs it)
            call_c0(_sched_yield())  # a thread that wants this core (a server's request thread) gets it
        spin_pause()


@numba.cfunc(types.void(types.voidptr), nopython=True, cache=True)
def _task(data):
    """A helper on XLA's pool: its share of the launch that scheduled it, then a linger for the next ones."""
    _help(to_int(data))
    _linger()


export_symbol("jaxllm_cpu_ffi_task", _task.address)


@numba.njit(**_CACHED)
def launch(frame, words, num_chunks, chunk_fn, split):
    """Runs ``chunk_fn(words_addr, chunk)`` (a C function: a numba cfunc ``void(int64, int64)``) for every chunk,
    shared by the calling thread and up to ``workers() - 1`` helpers (lingering ones first, then tasks scheduled on
    XLA's pool); ``words`` (a tuple of at most 32 int64: addresses, sizes) is what the chunks read their arguments
    from, at ``words_addr``. Returns when every chunk is done.

    Chunks are claimed in order from one shared counter, or with ``split`` each worker starts on its own
    contiguous range (its memory reads stream, and claims do not contend) and then steals what is left of the
    others'. A chunk must not depend on which thread runs it, so results are the same whatever the pool does (a
    task may also run late, or on the caller's thread)."""
    n = workers()
    helpers = min(n - 1, num_chunks - 1)
    slot = 0
    if helpers > 0:
        table, stride = _slots_address(), 8 * 8 * (5 + n)
        for i in range(NUM_SLOTS):
            if compare_and_swap(table + stride * i, 0, 1 + helpers):
                slot = table + stride * i
                break
    if slot == 0:  # serial (nothing to share, or every slot busy): the stack holds the words
        helpers = 0
        slot = _slot_on_stack()
    for i in range(len(words)):
        store64(slot + _WORDS_AT + 8 * i, words[i])
    store64(slot + 8, num_chunks)
    store64(slot + 16, 0)
    store64(slot + 24, 0)
    store64(slot + 32, chunk_fn)
    parts = helpers + 1 if split else 1
    for w in range(n):
        start, end = (w * num_chunks // parts, (w + 1) * num_chunks // parts) if w < parts else (0, 0)
        store64(slot + _RANGES_AT + 64 * w, start)
        store64(slot + _RANGES_AT + 64 * w + 8, end)
    posted = 0
    if helpers > 0:  # first to helpers waiting on their mailboxes, the rest as tasks on XLA's pool
        boxes = _mailboxes_address()
        for w in range(1, n):
            if posted == helpers:
                break
            if compare_and_swap(boxes + 64 * w, WAITING, slot):
                posted += 1
    if helpers > posted:
        api, ctx = load64(frame + 16), load64(frame + 24)
        schedule_args = _schedule_args()  # XLA_FFI_ThreadPool_Schedule_Args
        store64(schedule_args, 40)
        store64(schedule_args + 8, 0)
        store64(schedule_args + 16, ctx)
        store64(schedule_args + 24, _task_address())
        store64(schedule_args + 32, slot)
        for _ in range(helpers - posted):
            error = call_c(load64(api + API_SCHEDULE), schedule_args)
            if error != 0:  # no thread pool here: the caller does every chunk
                fetch_add(slot, -1)
                destroy_args = _destroy_args()  # XLA_FFI_Error_Destroy_Args
                store64(destroy_args, 24)
                store64(destroy_args + 8, 0)
                store64(destroy_args + 16, error)
                call_c(load64(api + API_ERROR_DESTROY), destroy_args)
    _drain(slot, 0)
    spins = 0
    while load_acquire(slot + 16) < num_chunks:  # chunks still running on a helper
        spins += 1
        if spins > SPINS_BEFORE_YIELD:
            call_c0(_sched_yield())
        spin_pause()
    if helpers > 0:
        fetch_add(slot, -1)


# The signature of a kernel's FFI handler, a module-level numba cfunc (so numba caches it) of this form:
#     @numba.cfunc(HANDLER, cache=True)
#     def handler(frame_ptr):
#         frame = to_int(frame_ptr)
#         if is_execute(frame):
#             ...  # the kernel's work, read from the frame's buffers
#         return to_ptr(0)
HANDLER = types.voidptr(types.voidptr)

_lock = threading.Lock()
_handlers: dict[str, object] = {}  # keeps each compiled cfunc (and so its address) alive


# The C API version and the structs whose byte offsets the numba code here reads, with a digest of each one's
# definition (comments and spacing dropped) in the c_api.h of jaxlib 0.10.2, where the offsets were checked.
FFI_API_VERSION = (0, 3)
FFI_STRUCT_DIGESTS = {
    "XLA_FFI_Extension_Base": "a8425dff22479236",
    "XLA_FFI_Api_Version": "46faa8f5c86cd539",
    "XLA_FFI_Buffer": "a47dcfe8c9bb5508",
    "XLA_FFI_Args": "9d9baac4c9be8e1e",
    "XLA_FFI_Rets": "04a6ede28dd54e1e",
    "XLA_FFI_CallFrame": "2746cbe13ddf9f11",
    "XLA_FFI_Metadata": "1b67b091700492bc",
    "XLA_FFI_Metadata_Extension": "eca33c538c52a060",
    "XLA_FFI_Api": "39fce3cb7c1e50c9",
}


def ffi_struct_digests(header: str) -> dict[str, str]:
    digests = {}
    for name in FFI_STRUCT_DIGESTS:
        match = re.search(r"struct " + name + r" \{(.*?)\}", header, re.S)
        body = " ".join(re.sub(r"//[^\n]*", "", match.group(1)).split()) if match else "missing"
        digests[name] = hashlib.sha256(body.encode()).hexdigest()[:16]
    return digests


def check_ffi_abi(header_path: str | os.PathLike | None = None) -> None:
    """Raises RuntimeError unless the XLA FFI C header (default: the installed jaxlib's) declares the API version
    and the struct definitions this module's byte offsets were read from."""
    path = Path(header_path or os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h"))
    header = path.read_text()
    version = tuple(int(m.group(1)) if (m := re.search(rf"#define XLA_FFI_API_{part} (\d+)", header)) else -1
                    for part in ("MAJOR", "MINOR"))
    changed = [name for name, digest in ffi_struct_digests(header).items() if digest != FFI_STRUCT_DIGESTS[name]]
    if version != FFI_API_VERSION or changed:
        raise RuntimeError(
            f"{path}: XLA FFI API {version[0]}.{version[1]}, changed structs {changed or 'none'}; the CPU kernels read "
            f"XLA's call frame by byte offsets checked against API {FFI_API_VERSION[0]}.{FFI_API_VERSION[1]} "
            "(jaxlib 0.10.2). Re-check pallas_kernels/cpu_ffi.py against this header, or run with "
            "attn_impl='reference' and matmul_impl='reference'.")


def register_once(target: str, load_handler) -> None:
    """Registers the numba cfunc ``load_handler()`` returns (``void *handler(XLA_FFI_CallFrame *)``, see
    `HANDLER`) as the XLA:CPU FFI target ``target``, once per process."""
    with _lock:
        if target in _handlers:
            return
        if not _handlers:
            check_ffi_abi()
        handler = load_handler()
        new_capsule = ctypes.pythonapi.PyCapsule_New
        new_capsule.restype = ctypes.py_object
        new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
        jax.ffi.register_ffi_target(target, new_capsule(handler.address, b"xla._CUSTOM_CALL_TARGET", None),
                                    platform="cpu")
        _handlers[target] = handler


def busy_slots(settle_s: float = 1.0) -> int:
    """Slots still referenced once in-flight work settles (a helper task may start, find nothing left, and
    drop its reference just after its launch returned): a leak check for tests."""
    deadline = time.monotonic() + settle_s
    while np.count_nonzero(_slots[:, 0]) and time.monotonic() < deadline:
        time.sleep(0.001)
    return int(np.count_nonzero(_slots[:, 0]))
