"""gpupool as CuPy's device-memory allocator.

Usage::

    import gpupool.cupy
    gpupool.cupy.install()          # cupy.cuda.set_allocator(gpupool.cupy.malloc)
    x = cupy.zeros((1024, 1024))    # memory from gpupool

Each allocation is made on CuPy's current device and current stream and is
freed, ordered on that same stream, when CuPy drops its last reference.
CuPy is imported only when these functions run. :func:`uninstall` puts
CuPy's default memory pool back.

What it cannot do: CuPy's pinned (host) memory pool is untouched; CuPy does
not tell the allocator about other streams a block is used on, so use
:func:`gpupool.record_stream` for a block shared across streams before it is
dropped.
"""

from __future__ import annotations

from typing import Optional

import gpupool


class Allocation:
    """Owns one gpupool allocation: frees it (on the stream it was made
    on) when garbage-collected. CuPy keeps it alive through
    ``UnownedMemory``'s ``owner``."""

    __slots__ = ("ptr", "size", "device", "stream", "__weakref__")

    def __init__(self, size: int, device: int, stream: int):
        self.ptr = gpupool.alloc(size, device, stream)
        self.size = size
        self.device = device
        self.stream = stream

    def free(self) -> None:
        """Frees now (idempotent)."""
        p, self.ptr = self.ptr, 0
        if p:
            try:
                gpupool.free(p, self.device, self.stream)
            except gpupool.Error as e:
                if e.status not in (gpupool._lib.SHUTDOWN, gpupool._lib.NOT_INITIALIZED):
                    raise

    def __del__(self):
        try:
            self.free()
        except Exception:
            pass


def malloc(size: int):
    """CuPy's allocator signature: ``size`` bytes on the current device and
    stream, as a ``cupy.cuda.MemoryPointer``. Raises
    :class:`gpupool.OutOfMemoryError` (a ``MemoryError``) when gpupool is
    out of memory."""
    import cupy

    device = cupy.cuda.Device().id
    if size == 0:
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device), 0)
    stream = cupy.cuda.get_current_stream().ptr
    a = Allocation(size, device, stream)
    mem = cupy.cuda.UnownedMemory(a.ptr, size, a, device)
    return cupy.cuda.MemoryPointer(mem, 0)


def install(conf: Optional[str] = None) -> None:
    """Starts gpupool (``conf``: a GPUPOOL_CONF string; default
    ``$GPUPOOL_CONF``, else ``backend=cuda``) and makes it CuPy's allocator
    for this process."""
    import os

    import cupy

    gpupool.init(conf or os.environ.get("GPUPOOL_CONF") or "backend=cuda")
    cupy.cuda.set_allocator(malloc)


def uninstall() -> None:
    """Gives CuPy its default memory pool back."""
    import cupy

    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
