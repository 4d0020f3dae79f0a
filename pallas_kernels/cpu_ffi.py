"""Plumbing for the CPU kernels: numba code called from a jitted step through XLA's typed FFI, and a parallel
for-loop that runs on XLA's own intra-op thread pool.

The FFI handler is a numba ``cfunc`` that reads XLA's C call frame (``xla/ffi/api/c_api.h``, API 0.x) by byte
offsets, so no C++ toolchain is needed; buffers are used in place.

Why XLA's thread pool rather than numba's ``prange``: inside a jitted step XLA's Eigen workers are awake
(spinning) between thunks, so OpenMP workers on the same cores fight them. Measured on 2 cores, the 120
single-token matmuls of SmolLM2: 22.4 ms with XLA's dot, 21.4-26 ms with a numba ``prange`` kernel (whatever
the OpenMP wait policy), 18.4 ms with the same kernel's chunks shared with one task on XLA's pool.
"""

from __future__ import annotations

import ctypes
import os
import threading

import jax
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


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
def prefetch(typingctx, addr):
    """Hints the cache line at ``addr`` into the caches (read, high locality); never faults."""
    def codegen(context, builder, sig, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        read, keep, data_cache = ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)
        builder.call(fn, [builder.inttoptr(args[0], i8p), read, keep, data_cache])
        return context.get_dummy_value()
    return types.void(types.int64), codegen


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


# -- the call frame (XLA_FFI_CallFrame): api +16, ctx +24, stage +32, args.args +72, rets.rets +112
@numba.njit(inline="always")
def buffer(frame, i, ret=False):
    """(data address, dims address) of argument (or result) ``i``; XLA_FFI_Buffer: data +24, dims +40."""
    b = load64(load64(frame + (112 if ret else 72)) + 8 * i)
    return load64(b + 24), load64(b + 40)


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
# [3] helpers started; lines 1-4 the kernel's words; line 5 + w worker w's range of chunks: [0] the next chunk
# to claim, [1] the end. Each range counter has its own cache line: its owner claims chunks from it without
# contention until a worker that ran out of work steals from it.
# The calling thread is worker 0; one helper per other core. More would only contend for the cores.
HELPERS = max(0, len(os.sched_getaffinity(0)) - 1) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) - 1
WORKERS = HELPERS + 1
_WORDS_AT, _RANGES_AT = 64, 320  # byte offsets: the kernel's words (so at most 32 of them), the first range
NUM_SLOTS, SLOT_WORDS = 256, 8 * (5 + WORKERS)
_slots = np.zeros((NUM_SLOTS, SLOT_WORDS), np.int64)
SLOTS = _slots.ctypes.data
_slot_on_stack, _schedule_args, _destroy_args = _stack_words(SLOT_WORDS), _stack_words(5), _stack_words(3)
# Waiting for a helper's last chunk spins, then yields the core: on an oversubscribed host (a server's request
# thread wants it) a spin must not hold a core for a whole time slice.
SCHED_YIELD = ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value
SPINS_BEFORE_YIELD = 1000
API_SCHEDULE, API_ERROR_DESTROY = 136, 64  # XLA_FFI_Api: XLA_FFI_ThreadPool_Schedule, XLA_FFI_Error_Destroy


def parallel_for(run_chunk, split: bool = False):
    """``launch(frame, words, num_chunks)``: runs ``run_chunk(words_addr, chunk)`` for every chunk, shared by the
    calling thread and up to HELPERS tasks on XLA's pool; ``words`` (a tuple of at most 32 int64: addresses,
    sizes) is what the chunks read their arguments from, at ``words_addr``. Returns when every chunk is done.

    Chunks are claimed in order from one shared counter, or with ``split`` each worker starts on its own
    contiguous range (its memory reads stream, and claims do not contend) and then steals what is left of the
    others'. ``run_chunk`` must not depend on which thread runs a chunk, so results are the same whatever the
    pool does (a task may also run late, or on the caller's thread)."""

    @numba.njit(nogil=True)
    def drain(slot, worker):
        done = 0
        for j in range(WORKERS):
            counter = slot + _RANGES_AT + 64 * ((worker + j) % WORKERS)
            end = load64(counter + 8)
            while True:
                c = fetch_add(counter, 1)
                if c >= end:
                    break
                run_chunk(slot + _WORDS_AT, c)
                done += 1
        fetch_add(slot + 16, done)

    @numba.cfunc(types.void(types.voidptr), nopython=True)
    def task(data):
        slot = to_int(data)
        drain(slot, 1 + fetch_add(slot + 24, 1))
        fetch_add(slot, -1)  # drop this task's reference

    task_address = task.address

    @numba.njit(nogil=True)
    def launch(frame, words, num_chunks):
        helpers = min(HELPERS, num_chunks - 1)
        slot = 0
        if helpers > 0:
            for i in range(NUM_SLOTS):
                if compare_and_swap(SLOTS + 8 * SLOT_WORDS * i, 0, 1 + helpers):
                    slot = SLOTS + 8 * SLOT_WORDS * i
                    break
        if slot == 0:  # serial (nothing to share, or every slot busy): the stack holds the words
            helpers = 0
            slot = _slot_on_stack()
        for i in range(len(words)):
            store64(slot + _WORDS_AT + 8 * i, words[i])
        store64(slot + 8, num_chunks)
        store64(slot + 16, 0)
        store64(slot + 24, 0)
        parts = helpers + 1 if split else 1
        for w in range(WORKERS):
            start, end = (w * num_chunks // parts, (w + 1) * num_chunks // parts) if w < parts else (0, 0)
            store64(slot + _RANGES_AT + 64 * w, start)
            store64(slot + _RANGES_AT + 64 * w + 8, end)
        if helpers > 0:
            api, ctx = load64(frame + 16), load64(frame + 24)
            schedule_args = _schedule_args()  # XLA_FFI_ThreadPool_Schedule_Args
            store64(schedule_args, 40)
            store64(schedule_args + 8, 0)
            store64(schedule_args + 16, ctx)
            store64(schedule_args + 24, task_address)
            store64(schedule_args + 32, slot)
            for _ in range(helpers):
                error = call_c(load64(api + API_SCHEDULE), schedule_args)
                if error != 0:  # no thread pool here: the caller does every chunk
                    fetch_add(slot, -1)
                    destroy_args = _destroy_args()  # XLA_FFI_Error_Destroy_Args
                    store64(destroy_args, 24)
                    store64(destroy_args + 8, 0)
                    store64(destroy_args + 16, error)
                    call_c(load64(api + API_ERROR_DESTROY), destroy_args)
        drain(slot, 0)
        spins = 0
        while load_acquire(slot + 16) < num_chunks:  # chunks still running on a helper
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                call_c0(SCHED_YIELD)
        if helpers > 0:
            fetch_add(slot, -1)

    return launch


def ffi_handler(execute):
    """The XLA FFI handler (``void *handler(XLA_FFI_CallFrame *)``, a numba cfunc) that runs the njit function
    ``execute(frame)`` at the EXECUTE stage and answers XLA's other queries."""

    @numba.cfunc(types.voidptr(types.voidptr), nopython=True)
    def handler(frame_ptr):
        frame = to_int(frame_ptr)
        if is_execute(frame):
            execute(frame)
        return to_ptr(0)

    return handler


_lock = threading.Lock()
_handlers: dict[str, object] = {}  # keeps each compiled cfunc (and so its address) alive


def register_once(target: str, build_handler) -> None:
    """Registers the numba cfunc ``build_handler()`` (``void *handler(XLA_FFI_CallFrame *)``) as the XLA:CPU FFI
    target ``target``, once per process."""
    with _lock:
        if target in _handlers:
            return
        handler = build_handler()
        new_capsule = ctypes.pythonapi.PyCapsule_New
        new_capsule.restype = ctypes.py_object
        new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
        jax.ffi.register_ffi_target(target, new_capsule(handler.address, b"xla._CUSTOM_CALL_TARGET", None),
                                    platform="cpu")
        _handlers[target] = handler


def busy_slots(settle_s: float = 1.0) -> int:
    """Slots still referenced once in-flight work settles (a helper task may start, find nothing left, and
    drop its reference just after its launch returned): a leak check for tests."""
    import time
    deadline = time.monotonic() + settle_s
    while np.count_nonzero(_slots[:, 0]) and time.monotonic() < deadline:
        time.sleep(0.001)
    return int(np.count_nonzero(_slots[:, 0]))
