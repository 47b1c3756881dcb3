"""gpupool: a lock-free, multi-GPU device-memory allocator, from Python.

A thin ctypes layer over the C ABI of the ``libgpupool.so`` bundled in this
package. One process-wide runtime::

    import gpupool
    gpupool.init("backend=sim,devices=2,capacity=1GiB")   # or "" / "backend=cuda"
    p = gpupool.alloc(1 << 20, device=0)                  # an int device address
    gpupool.free(p, device=0)
    gpupool.memory_stats(0)["allocated_bytes.all.peak"]   # torch.cuda.memory_stats() keys
    gpupool.set_memory_limit(8 << 30, device=0)
    gpupool.shutdown()

Streams are integers: the backend's stream handle (a ``cudaStream_t`` such
as ``torch.cuda.current_stream().cuda_stream`` on CUDA, a handle from
:func:`stream_create` on the simulator); ``0`` is the device's default
stream. Errors raise :class:`OutOfMemoryError` (a :class:`MemoryError`),
:class:`ValueError` for bad input (as :class:`InvalidArgumentError`), or
:class:`Error` for anything else; each carries the C status in ``status``.

Pause and resume (virtual-memory devices; the simulator has it): memory
allocated under a tag can give its device memory back while its addresses
stay valid to hold, as vLLM's sleep mode does::

    w = gpupool.alloc(1 << 30, tag="weights")     # or: with gpupool.tag_scope("weights"): ...
    gpupool.pause("weights", save=True)           # device memory released, bytes kept on the host
    gpupool.resume("weights")                     # same addresses, bytes restored

Tags are ints (0 to 2**64-1) or strings (hashed to one). A tagged block owns
whole granules (2 MiB on CUDA). Touching paused memory is an illegal
address; :func:`pause` waits for the streams the blocks were used on.

Sharing memory with another process: :func:`export` gives an
:class:`IpcHandle` (file descriptors plus numbers); send the descriptors
with ``socket.send_fds`` and the numbers (:meth:`IpcHandle.meta`) any way,
then in the other process::

    h = gpupool.IpcHandle.from_meta(meta, fds)   # fds from socket.recv_fds
    q = gpupool.import_handle(h, device=0)       # the same bytes, mapped here
    gpupool.close_import(q, device=0)

Integrations: :mod:`gpupool.torch` (PyTorch's pluggable allocator) and
:mod:`gpupool.cupy` (CuPy's allocator hook).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import numbers
import os
import threading
from typing import Callable, Optional

from . import _lib

__version__ = "0.1.0"

__all__ = [
    "Error",
    "OutOfMemoryError",
    "InvalidArgumentError",
    "init",
    "shutdown",
    "is_initialized",
    "device_count",
    "alloc",
    "free",
    "record_stream",
    "stream_create",
    "stream_destroy",
    "memory_stats",
    "stats",
    "reset_peak_memory_stats",
    "set_memory_limit",
    "snapshot",
    "record_history",
    "dump_snapshot",
    "trim",
    "begin_allocate_to_pool",
    "end_allocate_to_pool",
    "release_pool",
    "alloc_in_pool",
    "mark_step",
    "pause",
    "resume",
    "tag_scope",
    "IpcHandle",
    "export",
    "import_handle",
    "close_import",
    "on_oom",
    "version",
    "abi_version",
    "library_path",
]


class Error(RuntimeError):
    """A gpupool call failed. ``status`` is the ``GPUPOOL_STATUS_*`` code,
    ``status_name`` its name, and the message is gpupool's own."""

    def __init__(self, status: int, message: str):
        self.status = status
        self.status_name = _status_name(status)
        super().__init__(f"{message} [{self.status_name}]")


class OutOfMemoryError(Error, MemoryError):
    """The pool could not serve a request even after reclaiming its cache,
    or a memory limit refused it. The message gives requested, live,
    reserved, cached, pending and largest-free bytes."""


class InvalidArgumentError(Error, ValueError):
    """Bad input: a size, device, stream or pointer gpupool refuses."""


_BAD_INPUT = {
    _lib.NULL_ARGUMENT,
    _lib.INVALID_SIZE,
    _lib.INVALID_DEVICE,
    _lib.WRONG_DEVICE,
    _lib.UNKNOWN_POINTER,
    _lib.DOUBLE_FREE,
    _lib.INVALID_HANDLE,
    _lib.INVALID_ARGUMENT,
    _lib.CONFIG,
}


def _status_name(status: int) -> str:
    try:
        return _lib.lib().gpupool_status_name(status).decode()
    except Exception:  # the library itself failed to load
        return f"status {status}"


def _last_error() -> str:
    return _lib.lib().gpupool_last_error().decode(errors="replace")


def _error(status: int) -> Error:
    msg = _last_error()
    if status in (_lib.OUT_OF_MEMORY, _lib.DEVICE_OUT_OF_MEMORY):
        return OutOfMemoryError(status, msg)
    if status in _BAD_INPUT:
        return InvalidArgumentError(status, msg)
    return Error(status, msg)


def _check(status: int) -> None:
    if status != _lib.OK:
        raise _error(status)


def _int(value, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    v = int(value)
    if not lo <= v <= hi:
        raise ValueError(f"{what} {v} is out of range [{lo}, {hi}]")
    return v


_INT_MAX = 2**31 - 1
_U64_MAX = 2**64 - 1
_PTR_MAX = 2 ** (8 * ctypes.sizeof(ctypes.c_void_p)) - 1


def _device(device, allow_all: bool = False) -> int:
    return _int(device, "device", -1 if allow_all else 0, _INT_MAX)


def _stream(stream) -> Optional[int]:
    return _int(stream, "stream", 0, _PTR_MAX) or None


def _ptr(ptr) -> int:
    p = _int(ptr, "ptr", 0, _PTR_MAX)
    if p == 0:
        raise ValueError("ptr is 0 (NULL)")
    return p


# ---- lifecycle -------------------------------------------------------------------

#: The configuration the running runtime was started with by :func:`init`
#: (None when it was started elsewhere, e.g. by C code, or is not running);
#: gpupool.torch reads it to refuse a simulator under PyTorch.
_started_conf: Optional[str] = None


def init(conf: Optional[str] = "") -> None:
    """Starts gpupool. ``conf`` is a ``GPUPOOL_CONF`` string such as
    ``"backend=sim,devices=2,capacity=1GiB"`` or ``"backend=cuda,max_bytes=40GiB"``;
    ``""`` or ``None`` reads ``$GPUPOOL_CONF`` (defaults where unset). Already
    running is not an error (the running configuration stays). Bad keys
    raise :class:`ValueError` naming the key."""
    if conf is not None and not isinstance(conf, str):
        raise TypeError(f"conf must be a str, not {type(conf).__name__}")
    global _started_conf
    arg = conf.encode() if conf else None
    st = _lib.lib().gpupool_init(arg)
    if st != _lib.ALREADY_INITIALIZED:
        _check(st)
        _started_conf = conf or os.environ.get("GPUPOOL_CONF", "")


def shutdown() -> None:
    """Stops gpupool and gives all device memory back; pointers still live
    become invalid. Not running is not an error. :func:`init` starts it
    again."""
    global _started_conf
    st = _lib.lib().gpupool_shutdown()
    if st not in (_lib.NOT_INITIALIZED, _lib.SHUTDOWN):
        _check(st)
    _started_conf = None


def is_initialized() -> bool:
    """Whether a runtime is running."""
    n = ctypes.c_int()
    return _lib.lib().gpupool_device_count(ctypes.byref(n)) == _lib.OK


def device_count() -> int:
    """Devices of the running runtime."""
    n = ctypes.c_int()
    _check(_lib.lib().gpupool_device_count(ctypes.byref(n)))
    return n.value


# ---- memory ------------------------------------------------------------------------


def _tag(tag) -> int:
    """A tag as the C ABI's ``uint64_t``: an int as is, a str hashed."""
    if isinstance(tag, str):
        return int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=8).digest(), "little")
    return _int(tag, "tag", 0, _U64_MAX)


def alloc(size: int, device: int = 0, stream: int = 0, tag=None) -> int:
    """Allocates ``size`` bytes on ``device`` for use on ``stream``; returns
    the device address (aligned to 256 bytes; never moved). With ``tag`` (an
    int or a str) the block is tagged for :func:`pause`: it owns whole
    granules (granule aligned, its size rounded up to the granularity).
    Raises :class:`OutOfMemoryError` when even a reclaimed pool cannot serve
    it or a memory limit refuses it, :class:`ValueError` for a size of 0 or
    one larger than the device."""
    n = _int(size, "size", 0, _PTR_MAX)
    if n == 0:
        raise ValueError("size must be at least 1 byte")
    out = ctypes.c_void_p()
    if tag is None:
        st = _lib.lib().gpupool_alloc(n, _device(device), _stream(stream), ctypes.byref(out))
    else:
        st = _lib.lib().gpupool_alloc_tagged(
            n, _device(device), _stream(stream), _tag(tag), ctypes.byref(out)
        )
    _check(st)
    return int(out.value)


def free(ptr: int, device: int = 0, stream: int = 0) -> None:
    """Frees ``ptr`` (from :func:`alloc` on ``device``), ordered after the
    work enqueued so far on ``stream`` and on the streams recorded with
    :func:`record_stream`. A pointer of another device, an unknown one or a
    double free raise :class:`ValueError` and change nothing."""
    _check(_lib.lib().gpupool_free(_ptr(ptr), _device(device), _stream(stream)))


def record_stream(ptr: int, stream: int, device: int = 0) -> None:
    """Marks ``ptr`` as also used on ``stream`` (PyTorch's ``record_stream``)."""
    _check(_lib.lib().gpupool_record_stream(_ptr(ptr), _device(device), _stream(stream)))


def stream_create(device: int = 0) -> int:
    """Creates a stream on ``device`` (non-blocking on CUDA); returns its handle."""
    out = ctypes.c_void_p()
    _check(_lib.lib().gpupool_stream_create(_device(device), ctypes.byref(out)))
    return int(out.value)


def stream_destroy(stream: int, device: int = 0) -> None:
    """Destroys a stream made by :func:`stream_create`."""
    _check(_lib.lib().gpupool_stream_destroy(_device(device), _stream(stream)))


def trim() -> None:
    """Gives cached device memory of every device back (waits for pending
    frees; PyTorch's ``empty_cache``)."""
    _check(_lib.lib().gpupool_trim())


def _pool_id(pool) -> int:
    v = _int(pool, "pool", 0, 2**64 - 1)
    if v == 0:
        raise ValueError("private pool id 0 is reserved")
    return v


def begin_allocate_to_pool(pool: int, stream: int = 0, device: int = 0) -> None:
    """From now on, allocations on ``stream`` of ``device`` go to private
    (CUDA graph) pool ``pool`` (a nonzero id; made on first use) until
    :func:`end_allocate_to_pool`, and a graph capture counts as underway on
    ``stream``: gpupool then records no event on a capturing stream (frees
    that would are deferred to the end), queries no event and unmaps no
    memory. Call it before the capture begins, once per stream to route
    (PyTorch's ``beginAllocateToPool``)."""
    _check(
        _lib.lib().gpupool_begin_allocate_to_pool(_device(device), _pool_id(pool), _stream(stream))
    )


def end_allocate_to_pool(pool: int, device: int = 0) -> None:
    """Ends the routing of every stream routed to ``pool`` on ``device``
    (after the capture ended); deferred frees record their events once no
    capture is left. Blocks freed in the pool stay in it."""
    _check(_lib.lib().gpupool_end_allocate_to_pool(_device(device), _pool_id(pool)))


def release_pool(pool: int, device: int = 0) -> None:
    """The graph of ``pool`` is gone: its free memory goes back to the
    device pool; blocks still live stay the pool's until freed. An unknown
    or already released pool raises :class:`ValueError`."""
    _check(_lib.lib().gpupool_release_pool(_device(device), _pool_id(pool)))


def alloc_in_pool(size: int, pool: int, device: int = 0, stream: int = 0) -> int:
    """Allocates ``size`` bytes directly in private pool ``pool`` (freed with
    :func:`free`, the block stays in the pool until :func:`release_pool`)."""
    n = _int(size, "size", 0, _PTR_MAX)
    if n == 0:
        raise ValueError("size must be at least 1 byte")
    out = ctypes.c_void_p()
    _check(
        _lib.lib().gpupool_alloc_in_pool(
            n, _device(device), _stream(stream), _pool_id(pool), ctypes.byref(out)
        )
    )
    return int(out.value)


def mark_step() -> None:
    """Marks a step boundary on every device in use: call it once per
    training step (or served batch), at the same point of each. From the
    second mark on, large requests that repeat the recorded step are served
    from a plan made for it: no lock shared between streams, no driver
    call, reserved memory close to the step's peak of live bytes. A step
    that departs from the plan is served as usual and learned anew."""
    _check(_lib.lib().gpupool_mark_step())


# ---- pause and resume ---------------------------------------------------------------


def pause(tag, save: bool = True) -> int:
    """Gives the device memory of every live block tagged ``tag`` (on every
    device in use) back to the driver, keeping their addresses; with
    ``save`` their bytes are copied to host memory first. Waits for the
    streams those blocks were used on. Returns the bytes released: 0 for an
    unknown tag or one already paused. ``memory_stats()`` shows the blocks
    in ``paused_bytes.all.current``, no longer in ``reserved_bytes``.
    Freeing a paused block is allowed. :class:`Error` (status
    ``UNSUPPORTED``) on devices without virtual memory management."""
    out = ctypes.c_uint64()
    _check(_lib.lib().gpupool_pause(_tag(tag), 1 if save else 0, ctypes.byref(out)))
    return int(out.value)


def resume(tag) -> int:
    """Maps device memory again under every paused block tagged ``tag``, at
    the same addresses, and restores saved bytes (unsaved contents are
    undefined). Returns the bytes mapped (0 if nothing was paused). All or
    nothing per device: :class:`OutOfMemoryError` leaves the blocks paused
    with their saved bytes."""
    out = ctypes.c_uint64()
    _check(_lib.lib().gpupool_resume(_tag(tag), ctypes.byref(out)))
    return int(out.value)


_scopes = threading.local()


@contextlib.contextmanager
def tag_scope(tag):
    """Tags every allocation this thread makes through gpupool's C ABI
    while the block runs (:func:`alloc` without ``tag=``, and PyTorch's
    allocations once :mod:`gpupool.torch` is installed), so that
    :func:`pause` can release them. Scopes nest; the innermost tag wins."""
    t = _tag(tag)
    stack = getattr(_scopes, "stack", None)
    if stack is None:
        stack = _scopes.stack = []
    stack.append(t)
    _check(_lib.lib().gpupool_set_thread_tag(t))
    try:
        yield
    finally:
        stack.pop()
        if stack:
            _check(_lib.lib().gpupool_set_thread_tag(stack[-1]))
        else:
            _check(_lib.lib().gpupool_clear_thread_tag())


# ---- sharing between processes --------------------------------------------------------


class IpcHandle:
    """An allocation exported by :func:`export`: ``fds`` (file descriptors
    this object owns, one per granule under the allocation) with
    ``fd_offsets``, and ``chunk_bytes``, ``offset`` (of the allocation in
    the first chunk) and ``size``. :meth:`close` (or leaving a ``with``
    block) closes the descriptors; send them first (``socket.send_fds``)."""

    def __init__(self, fds, fd_offsets, chunk_bytes: int, offset: int, size: int):
        self.fds = list(fds)
        self.fd_offsets = list(fd_offsets)
        self.chunk_bytes, self.offset, self.size = int(chunk_bytes), int(offset), int(size)
        if len(self.fds) != len(self.fd_offsets):
            raise ValueError("one fd offset per descriptor")

    def meta(self) -> dict:
        """Everything but the descriptors, as plain numbers (JSON-able)."""
        return {
            "fd_offsets": self.fd_offsets,
            "chunk_bytes": self.chunk_bytes,
            "offset": self.offset,
            "size": self.size,
        }

    @classmethod
    def from_meta(cls, meta: dict, fds) -> "IpcHandle":
        """The handle a receiver rebuilds from :meth:`meta` and the
        descriptors it received (in the sender's order)."""
        return cls(fds, meta["fd_offsets"], meta["chunk_bytes"], meta["offset"], meta["size"])

    def close(self) -> None:
        """Closes the descriptors (an import already made keeps its own)."""
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (
            f"IpcHandle({len(self.fds)} chunks of {self.chunk_bytes} B, "
            f"offset {self.offset}, size {self.size})"
        )


def export(ptr: int, device: int = 0) -> IpcHandle:
    """Exports the allocation at ``ptr`` (from :func:`alloc`, live and not
    paused) for another process. Every granule it touches is shared
    (neighbours' bytes included); keep it allocated while it is imported.
    :class:`Error` (status ``UNSUPPORTED``) without virtual memory
    management or shareable handles."""
    l = _lib.lib()
    n = ctypes.c_size_t()
    cb, off, sz = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
    args = (ctypes.byref(n), ctypes.byref(cb), ctypes.byref(off), ctypes.byref(sz))
    p, d = _ptr(ptr), _device(device)
    st = l.gpupool_export(p, d, None, 0, *args)
    while st == _lib.BUFFER_TOO_SMALL:
        chunks = (_lib.IpcChunk * n.value)()
        st = l.gpupool_export(p, d, chunks, n.value, *args)
        if st == _lib.OK:
            return IpcHandle(
                [c.fd for c in chunks], [c.fd_offset for c in chunks], cb.value, off.value, sz.value
            )
    _check(st)
    raise Error(_lib.PANIC, "gpupool_export exported nothing")


def import_handle(handle: IpcHandle, device: int = 0) -> int:
    """Maps memory another process exported (``handle`` rebuilt with
    :meth:`IpcHandle.from_meta`) on ``device``; returns its address here.
    The descriptors stay the handle's (close it after). The memory is the
    exporter's: :func:`memory_stats` does not count it. Release with
    :func:`close_import`."""
    if not isinstance(handle, IpcHandle):
        raise TypeError(f"handle must be an IpcHandle, not {type(handle).__name__}")
    n = len(handle.fds)
    chunks = (_lib.IpcChunk * max(n, 1))()
    for i, (fd, off) in enumerate(zip(handle.fds, handle.fd_offsets)):
        chunks[i].fd = _int(fd, "fd", 0, _INT_MAX)
        chunks[i].fd_offset = _int(off, "fd_offset", 0, _U64_MAX)
    out = ctypes.c_void_p()
    _check(
        _lib.lib().gpupool_import(
            _device(device),
            chunks,
            n,
            _int(handle.chunk_bytes, "chunk_bytes", 0, _U64_MAX),
            _int(handle.offset, "offset", 0, _U64_MAX),
            _int(handle.size, "size", 0, _U64_MAX),
            ctypes.byref(out),
        )
    )
    return int(out.value)


def close_import(ptr: int, device: int = 0) -> None:
    """Unmaps memory mapped by :func:`import_handle` (work using it must
    have completed)."""
    _check(_lib.lib().gpupool_import_close(_ptr(ptr), _device(device)))


# ---- statistics -------------------------------------------------------------------


def _text(fn, device: int) -> str:
    size = 1 << 14
    while True:
        buf = ctypes.create_string_buffer(size)
        st = fn(device, buf, size)
        if st == _lib.OK:
            return buf.value.decode()
        if st != _lib.BUFFER_TOO_SMALL:
            _check(st)
        size = _lib.lib().gpupool_needed_len() + 4096


def memory_stats(device: int = 0) -> dict:
    """Statistics of ``device`` with ``torch.cuda.memory_stats()``'s flat keys
    and meanings: ``requested_bytes.all.current`` (sizes asked for),
    ``allocated_bytes.all.current`` (their rounded sizes),
    ``active_bytes.all.current`` (plus freed blocks not yet reusable),
    ``reserved_bytes.all.current`` (device memory held),
    ``inactive_split_bytes.all.current`` (free memory that cannot go back to
    the device without moving live blocks), each also ``.all.peak``;
    ``allocation.all.current``, ``num_alloc_retries``, ``num_ooms``,
    ``num_device_alloc``, ``num_device_free``; and gpupool's own
    ``cached_bytes.*``, ``pending_bytes.*``, ``paused_bytes.all.current``
    (blocks paused by :func:`pause`), ``num_oom_waits``, ..."""
    return json.loads(_text(_lib.lib().gpupool_memory_stats_json, _device(device)))


def stats(device: int = 0) -> dict:
    """gpupool's own statistics of ``device`` (``PoolStats``): byte figures
    as ``{"current", "peak"}`` under the same names as
    :func:`memory_stats`, plus counters and ``fragmentation``;
    ``driver_calls`` counts the backend's driver calls by CUDA name (every
    device's: read it around a step to see what the steady state costs)."""
    return json.loads(_text(_lib.lib().gpupool_stats_json, _device(device)))


def reset_peak_memory_stats(device: int = 0) -> None:
    """Resets every ``.peak`` of ``device`` (``-1``: every device) to the
    current value."""
    _check(_lib.lib().gpupool_reset_peak_stats(_device(device, allow_all=True)))


# ---- limits ---------------------------------------------------------------------


def set_memory_limit(nbytes: Optional[int], device: int = 0) -> None:
    """The pool of ``device`` (``-1``: every device) never holds more than
    ``nbytes`` of device memory from now on (``None`` or ``0``: no limit but
    the device). Lowering it below what is held gives cached memory back
    first; live memory stays, and the pool refuses to grow until it is under
    the limit. Allocations the limit refuses raise :class:`OutOfMemoryError`.
    The keys ``max_bytes`` and ``fraction`` of the configuration set a limit
    at start."""
    n = 0 if nbytes is None else _int(nbytes, "nbytes", 0, _U64_MAX)
    _check(_lib.lib().gpupool_set_memory_limit(_device(device, allow_all=True), n))


_oom_lock = threading.Lock()
_oom_keep = None  # the ctypes trampoline must outlive its registration


def on_oom(callback: Optional[Callable[[int, int], None]]) -> None:
    """Calls ``callback(device, requested_bytes)`` once for every
    out-of-memory error, on the allocating thread, just before
    :class:`OutOfMemoryError` is raised (``None`` removes it). It may read
    :func:`memory_stats` but must not allocate through gpupool. Exceptions
    it raises are printed and ignored. Stays registered across
    :func:`shutdown` and :func:`init`."""
    global _oom_keep
    if callback is not None and not callable(callback):
        raise TypeError("callback must be callable or None")
    with _oom_lock:
        if callback is None:
            tramp = _lib.OOM_CALLBACK()
        else:

            def tramp_fn(device, requested, _user):
                try:
                    callback(int(device), int(requested))
                except BaseException:  # nothing may unwind into the C caller
                    import sys
                    import traceback

                    print("gpupool: exception in the on_oom callback:", file=sys.stderr)
                    traceback.print_exc()

            tramp = _lib.OOM_CALLBACK(tramp_fn)
        _check(_lib.lib().gpupool_set_oom_callback(tramp, None))
        _oom_keep = tramp


# ---- snapshots ------------------------------------------------------------------


def snapshot(device: int = 0):
    """A snapshot of ``device`` in gpupool's JSON layout (``device``,
    ``segments`` with their ``blocks``, ``stats``, ``history``) as a dict;
    ``device=-1`` gives a list, one per device. Exact while no other thread
    allocates; a diagnostic, not a fast call."""
    d = _device(device, allow_all=True)
    snaps = json.loads(_text(_lib.lib().gpupool_snapshot_json, d))
    return snaps if d == -1 else snaps[0]


def record_history(enabled: bool = True, device: int = -1) -> None:
    """Turns alloc/free event recording on (clearing earlier events) or off."""
    _check(_lib.lib().gpupool_record_history(_device(device, allow_all=True), 1 if enabled else 0))


def dump_snapshot(path, device: int = -1) -> None:
    """Writes a pickle in PyTorch's snapshot layout (open it in
    https://pytorch.org/memory_viz)."""
    _check(_lib.lib().gpupool_snapshot_pickle(_device(device, allow_all=True), os.fsencode(path)))


# ---- about ------------------------------------------------------------------------


def version() -> str:
    """The version of the loaded library."""
    return _lib.lib().gpupool_version().decode()


def abi_version() -> int:
    """The C ABI version of the loaded library (``GPUPOOL_ABI_VERSION``)."""
    return int(_lib.lib().gpupool_abi_version())


def library_path() -> str:
    """The path of the loaded ``libgpupool.so``."""
    return _lib.path()
