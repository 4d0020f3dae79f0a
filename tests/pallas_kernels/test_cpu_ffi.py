"""The guard on the CPU kernels' byte offsets into XLA's FFI call frame: the installed header passes; a header
whose API version or struct layout differs is refused, naming what changed."""

import os

import jax
import pytest

from pallas_kernels.cpu_ffi import check_ffi_abi

HEADER = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")


def test_the_installed_header_matches_the_offsets():
    check_ffi_abi()


@pytest.mark.parametrize(("edit", "named"), [
    (("  XLA_FFI_ExecutionStage stage;\n", "  XLA_FFI_ExecutionStage stage;\n  int64_t priority;\n"),
     "XLA_FFI_CallFrame"),
    (("  int64_t rank;\n  int64_t* dims;", "  int64_t* dims;\n  int64_t rank;"), "XLA_FFI_Buffer"),
    (("#define XLA_FFI_API_MINOR 3", "#define XLA_FFI_API_MINOR 4"), "API 0.4"),
])
def test_a_changed_header_is_refused(tmp_path, edit, named):
    text = open(HEADER).read()
    assert edit[0] in text
    changed = tmp_path / "c_api.h"
    changed.write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(RuntimeError, match=named):
        check_ffi_abi(changed)


def test_keep_alive_holds_an_array_known_only_by_its_address():
    """numba frees an array after its last use in the IR: a kernel's scratch buffer used through its raw address
    went back to the allocator at once, and another thread's allocation then shared it (wrong outputs under
    load). With keep_alive after the last raw access, no allocation in between may get its memory."""
    import numba
    import numpy as np

    from pallas_kernels.cpu_ffi import keep_alive

    def reuses(hold):
        @numba.njit
        def count(n):
            buf = np.empty(n, np.float32)
            w = buf.ctypes.data
            hits = 0
            for _ in range(50):
                hits += np.empty(n, np.float32).ctypes.data == w
            if hold:
                keep_alive(buf)
            return hits
        return count(2048)

    assert reuses(False) > 0  # the hazard is real in this numba (else this test proves nothing)
    assert reuses(True) == 0


def _matmul_and_reference():
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.skinny_matmul.cpu import matmul

    rng = np.random.default_rng(0)
    x, w = jnp.asarray(rng.standard_normal((2, 256), np.float32)), jnp.asarray(rng.standard_normal((512, 256),
                                                                                                  np.float32))
    f = jax.jit(matmul)
    return (lambda: np.asarray(f(x, w))), np.asarray(x) @ np.asarray(w).T


def _until(predicate, seconds: float = 2.0) -> bool:
    import time
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


@pytest.fixture
def long_linger():
    from pallas_kernels.cpu_ffi import WORKERS, busy_slots, lingering, set_linger

    if WORKERS < 2:
        pytest.skip("one core: a launch has no helper to linger")
    previous = set_linger(10**9)
    yield lingering
    set_linger(0)
    assert _until(lambda: all(state == 0 for state, _ in lingering()))  # every helper left
    set_linger(previous)
    assert busy_slots() == 0


def test_a_helper_lingers_and_takes_the_next_launch(long_linger):
    """After its share of a launch, a helper waits on its mailbox, and the next launch hands it a slot there (no
    task scheduled): the outputs are the same."""
    import numpy as np

    from pallas_kernels.cpu_ffi import WAITING

    run, expected = _matmul_and_reference()
    np.testing.assert_allclose(run(), expected, rtol=1e-4, atol=1e-3)
    assert _until(lambda: any(state == WAITING for state, _ in long_linger()))
    before = sum(runs for _, runs in long_linger())
    for _ in range(5):
        np.testing.assert_allclose(run(), expected, rtol=1e-4, atol=1e-3)
    # a posted slot is counted when the helper has run it, which on a busy machine may be after the launch returned
    # (the caller had stolen every chunk)
    assert _until(lambda: sum(runs for _, runs in long_linger()) > before)


def test_a_forked_child_has_no_lingering_helpers(long_linger):
    """A child process has none of its parent's pool threads: a mailbox still marked waiting would be posted to
    and never served."""
    import warnings

    import numpy as np

    from pallas_kernels.cpu_ffi import WAITING, _mailboxes, _slots

    run, _ = _matmul_and_reference()
    run()
    assert _until(lambda: any(state == WAITING for state, _ in long_linger()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # JAX warns that a fork of a multithreaded process may deadlock
        pid = os.fork()
    if pid == 0:
        os._exit(0 if not np.any(_mailboxes) and not np.any(_slots) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
