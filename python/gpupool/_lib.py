"""Loads libgpupool.so and declares the C ABI (include/gpupool.h) to ctypes."""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from pathlib import Path
from typing import Optional

_HERE = Path(__file__).resolve().parent

#: Status codes (GpupoolStatus in include/gpupool.h).
OK = 0
NOT_INITIALIZED = 1
ALREADY_INITIALIZED = 2
SHUTDOWN = 3
NULL_ARGUMENT = 4
BUFFER_TOO_SMALL = 5
PANIC = 6
INVALID_SIZE = 7
INVALID_DEVICE = 8
WRONG_DEVICE = 9
UNKNOWN_POINTER = 10
DOUBLE_FREE = 11
INVALID_HANDLE = 12
INVALID_ARGUMENT = 13
OUT_OF_MEMORY = 14
DEVICE_OUT_OF_MEMORY = 15
NO_DRIVER = 16
BACKEND = 17
CONFIG = 18
INJECTED_FAULT = 19
UNSUPPORTED = 20

#: The C ABI version these bindings were written for (GPUPOOL_ABI_VERSION).
ABI_VERSION = 1

OOM_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p)


class IpcChunk(ctypes.Structure):
    """GpupoolIpcChunk: a file descriptor and the chunk's offset in its file."""

    _fields_ = [("fd", ctypes.c_int), ("fd_offset", ctypes.c_uint64)]

_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None
_lock = threading.Lock()


def bundled_path() -> Optional[str]:
    """The library the wheel installed next to this file, if any."""
    found = sorted(glob.glob(str(_HERE / "_libgpupool*.so")))
    return found[0] if found else None


def library_path() -> str:
    """Path of libgpupool.so: ``$GPUPOOL_LIB``, else the one bundled in the
    package, else (a source checkout) ``target/release`` or ``target/debug``
    of the checkout."""
    env = os.environ.get("GPUPOOL_LIB")
    if env:
        return env
    bundled = bundled_path()
    if bundled:
        return bundled
    root = _HERE.parent.parent
    target = Path(os.environ.get("CARGO_TARGET_DIR", root / "target"))
    for profile in ("release", "debug"):
        p = target / profile / "libgpupool.so"
        if p.exists():
            return str(p)
    raise FileNotFoundError(
        "libgpupool.so not found: install the package (`pip install .`), "
        "build it (`cargo build --release`) or set GPUPOOL_LIB"
    )


def path() -> str:
    """The path of the loaded library (loading it if needed)."""
    lib()
    assert _path is not None
    return _path


def lib(path: Optional[str] = None) -> ctypes.CDLL:
    """The loaded library, with argument and result types declared."""
    global _lib, _path
    with _lock:
        if _lib is not None:
            return _lib
        p = path or library_path()
        l = ctypes.CDLL(p)
        c_int, c_size, vp, cp = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
        sigs = {
            "gpupool_init": ([cp], c_int),
            "gpupool_shutdown": ([], c_int),
            "gpupool_device_count": ([ctypes.POINTER(c_int)], c_int),
            "gpupool_alloc": ([c_size, c_int, vp, ctypes.POINTER(vp)], c_int),
            "gpupool_free": ([vp, c_int, vp], c_int),
            "gpupool_record_stream": ([vp, c_int, vp], c_int),
            "gpupool_stream_create": ([c_int, ctypes.POINTER(vp)], c_int),
            "gpupool_stream_destroy": ([c_int, vp], c_int),
            "gpupool_stream_release": ([c_int, vp], c_int),
            "gpupool_stats_json": ([c_int, cp, c_size], c_int),
            "gpupool_memory_stats_json": ([c_int, cp, c_size], c_int),
            "gpupool_reset_peak_stats": ([c_int], c_int),
            "gpupool_set_memory_limit": ([c_int, ctypes.c_uint64], c_int),
            "gpupool_set_oom_callback": ([OOM_CALLBACK, vp], c_int),
            "gpupool_abi_version": ([], c_int),
            "gpupool_snapshot_json": ([c_int, cp, c_size], c_int),
            "gpupool_snapshot_pickle": ([c_int, cp], c_int),
            "gpupool_record_history": ([c_int, c_int], c_int),
            "gpupool_trim": ([], c_int),
            "gpupool_begin_allocate_to_pool": ([c_int, ctypes.c_uint64, vp], c_int),
            "gpupool_end_allocate_to_pool": ([c_int, ctypes.c_uint64], c_int),
            "gpupool_release_pool": ([c_int, ctypes.c_uint64], c_int),
            "gpupool_alloc_in_pool": ([c_size, c_int, vp, ctypes.c_uint64, ctypes.POINTER(vp)], c_int),
            "gpupool_mark_step": ([], c_int),
            "gpupool_alloc_tagged": ([c_size, c_int, vp, ctypes.c_uint64, ctypes.POINTER(vp)], c_int),
            "gpupool_set_thread_tag": ([ctypes.c_uint64], c_int),
            "gpupool_clear_thread_tag": ([], c_int),
            "gpupool_pause": ([ctypes.c_uint64, c_int, ctypes.POINTER(ctypes.c_uint64)], c_int),
            "gpupool_resume": ([ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)], c_int),
            "gpupool_export": (
                [vp, c_int, ctypes.POINTER(IpcChunk), c_size, ctypes.POINTER(c_size)]
                + [ctypes.POINTER(ctypes.c_uint64)] * 3,
                c_int,
            ),
            "gpupool_import": (
                [c_int, ctypes.POINTER(IpcChunk), c_size]
                + [ctypes.c_uint64] * 3
                + [ctypes.POINTER(vp)],
                c_int,
            ),
            "gpupool_import_close": ([vp, c_int], c_int),
            "gpupool_last_error": ([], cp),
            "gpupool_needed_len": ([], c_size),
            "gpupool_status_name": ([c_int], cp),
            "gpupool_version": ([], cp),
        }
        for name, (args, res) in sigs.items():
            f = getattr(l, name)
            f.argtypes = args
            f.restype = res
        got = l.gpupool_abi_version()
        if got != ABI_VERSION:
            raise ImportError(
                f"{p}: C ABI version {got}, these bindings need {ABI_VERSION}"
            )
        _lib, _path = l, p
        return l
