"""The worker allocator settings: a 4 MiB block comes from the heap (not a fresh mmap) once they apply, and the
opt-outs leave glibc alone. Each case runs in a fresh interpreter so this process's allocator is untouched."""

import ctypes
import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import ctypes, ctypes.util, sys
    from hybridflow.utils.allocator import keep_freed_host_memory

    class MallInfo2(ctypes.Structure):  # glibc >= 2.33 malloc.h
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    applied = keep_freed_host_memory()
    before = libc.mallinfo2().hblks
    block = libc.malloc(4 << 20)
    mapped = libc.mallinfo2().hblks - before  # 1: served by its own mmap, 0: from the heap
    libc.free(block)
    print(int(applied), mapped)
""")


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2")
    except OSError:
        return False


def _probe(**env: str) -> tuple[int, int]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES",
                          "HYBRIDFLOW_MALLOC_TUNING")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[0]), int(out[1])


pytestmark = pytest.mark.skipif(not _glibc(), reason="needs glibc >= 2.33 (mallopt, mallinfo2)")


def test_settings_serve_a_4mib_block_from_the_heap():
    assert _probe() == (1, 0)


def test_glibc_defaults_mmap_a_4mib_block():  # the control: without the settings the same block is mmapped
    assert _probe(HYBRIDFLOW_MALLOC_TUNING="0") == (0, 1)


def test_user_tuning_is_left_alone():
    assert _probe(MALLOC_MMAP_THRESHOLD_=str(1 << 20))[0] == 0
    assert _probe(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1")[0] == 0
    assert _probe(GLIBC_TUNABLES="glibc.pthread.rseq=0") == (1, 0)  # a tunable that is not malloc's


def test_spellings_of_off():
    for value in ("false", " OFF ", "no"):
        assert _probe(HYBRIDFLOW_MALLOC_TUNING=value) == (0, 1)
