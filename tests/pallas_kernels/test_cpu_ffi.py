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
