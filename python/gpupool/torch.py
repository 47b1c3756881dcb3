"""gpupool as PyTorch's CUDA allocator, plus stats and snapshots via ctypes.

Usage (before any CUDA tensor exists in the process)::

    import gpupool_torch
    gpupool_torch.install()              # backend=cuda by default
    ...train...
    print(gpupool_torch.stats(0)["reserved_bytes"])
    gpupool_torch.record_history(True)
    ...
    gpupool_torch.dump_snapshot("gpupool_snapshot.pickle")  # open in memory_viz

The library is found at ``$GPUPOOL_LIB``, else ``target/release`` then
``target/debug`` of the checkout this file lives in (build it with
``cargo build --release``).

PyTorch loads ``gpupool_torch_malloc`` / ``gpupool_torch_free`` from the same
shared object that ctypes opens here (same path, so the same loaded copy and
the same runtime).
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Optional

OK = 0
BUFFER_TOO_SMALL = 5
ALREADY_INITIALIZED = 2

_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None


class GpupoolError(RuntimeError):
    """A gpupool C ABI call failed; ``status`` is the GPUPOOL_STATUS_* code."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status_name(status)} ({status}): {message}")
        self.status = status


def library_path() -> str:
    """Path of libgpupool.so: $GPUPOOL_LIB, else this checkout's target dir."""
    env = os.environ.get("GPUPOOL_LIB")
    if env:
        return env
    root = Path(__file__).resolve().parent.parent
    target = Path(os.environ.get("CARGO_TARGET_DIR", root / "target"))
    for profile in ("release", "debug"):
        p = target / profile / "libgpupool.so"
        if p.exists():
            return str(p)
    raise FileNotFoundError(
        "libgpupool.so not found: run `cargo build --release` or set GPUPOOL_LIB"
    )


def lib(path: Optional[str] = None) -> ctypes.CDLL:
    """The loaded library, with argument and result types declared."""
    global _lib, _path
    if _lib is not None:
        return _lib
    _path = path or library_path()
    l = ctypes.CDLL(_path)
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
        "gpupool_stats_json": ([c_int, ctypes.c_char_p, c_size], c_int),
        "gpupool_snapshot_json": ([c_int, ctypes.c_char_p, c_size], c_int),
        "gpupool_snapshot_pickle": ([c_int, cp], c_int),
        "gpupool_record_history": ([c_int, c_int], c_int),
        "gpupool_trim": ([], c_int),
        "gpupool_last_error": ([], cp),
        "gpupool_needed_len": ([], c_size),
        "gpupool_status_name": ([c_int], cp),
        "gpupool_version": ([], cp),
    }
    for name, (args, res) in sigs.items():
        f = getattr(l, name)
        f.argtypes = args
        f.restype = res
    _lib = l
    return l


def status_name(status: int) -> str:
    """GPUPOOL_STATUS_* name of a status code."""
    return lib().gpupool_status_name(status).decode()


def last_error() -> str:
    """This thread's message of the last gpupool call ("" after a success)."""
    return lib().gpupool_last_error().decode(errors="replace")


def _check(status: int) -> None:
    if status != OK:
        raise GpupoolError(status, last_error())


def init(conf: Optional[str] = None) -> None:
    """Starts gpupool with a GPUPOOL_CONF string (None: read $GPUPOOL_CONF).
    Already running is not an error."""
    st = lib().gpupool_init(conf.encode() if conf is not None else None)
    if st not in (OK, ALREADY_INITIALIZED):
        _check(st)


def install(conf: Optional[str] = None, path: Optional[str] = None):
    """Makes gpupool PyTorch's CUDA allocator for this process.

    ``conf`` is a GPUPOOL_CONF string; default ``$GPUPOOL_CONF`` or
    ``backend=cuda``. It is also exported as GPUPOOL_CONF so that child
    processes see it. Call before the first CUDA allocation (PyTorch refuses
    to swap an allocator already in use). Returns the
    CUDAPluggableAllocator.
    """
    import torch

    conf = conf or os.environ.get("GPUPOOL_CONF") or "backend=cuda"
    os.environ["GPUPOOL_CONF"] = conf
    lib(path)
    init(conf)
    alloc = torch.cuda.memory.CUDAPluggableAllocator(
        _path, "gpupool_torch_malloc", "gpupool_torch_free"
    )
    torch.cuda.memory.change_current_allocator(alloc)
    return alloc


def _text(fn, device: int) -> str:
    size = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(size)
        st = fn(device, buf, size)
        if st == OK:
            return buf.value.decode()
        if st != BUFFER_TOO_SMALL:
            _check(st)
        size = lib().gpupool_needed_len() + 4096


def stats(device: int = 0) -> dict:
    """PoolStats of ``device`` as a dict (allocated_bytes, reserved_bytes,
    active_bytes, cached_bytes, pending_bytes as {"current", "peak"}, and
    counters such as num_allocs, num_frees, num_device_allocs, num_ooms)."""
    return json.loads(_text(lib().gpupool_stats_json, device))


def snapshot(device: int = -1) -> list:
    """gpupool's own snapshot layout (list, one entry per device)."""
    return json.loads(_text(lib().gpupool_snapshot_json, device))


def record_history(on: bool = True, device: int = -1) -> None:
    """Turns alloc/free event recording on (clearing earlier events) or off."""
    _check(lib().gpupool_record_history(device, 1 if on else 0))


def dump_snapshot(path: str, device: int = -1) -> None:
    """Writes a pickle in PyTorch's snapshot layout (open it in
    https://pytorch.org/memory_viz or with torch.cuda._memory_viz)."""
    _check(lib().gpupool_snapshot_pickle(device, os.fsencode(path)))


def trim() -> None:
    """Gives cached device memory back to the driver (waits for pending frees)."""
    _check(lib().gpupool_trim())


def version() -> str:
    """The library version."""
    return lib().gpupool_version().decode()
