"""gpupool as PyTorch's CUDA allocator (``CUDAPluggableAllocator``).

Usage, before any CUDA tensor exists in the process::

    import gpupool.torch
    gpupool.torch.install()                 # backend=cuda unless GPUPOOL_CONF says otherwise
    ...train...
    gpupool.torch.memory_stats(0)["allocated_bytes.all.peak"]

PyTorch loads ``gpupool_torch_malloc`` / ``gpupool_torch_free`` from the same
shared object the package opened (same path, so the same loaded copy and the
same runtime).

What this route cannot do (PyTorch's Python pluggable-allocator hook takes an
allocate and a free function only): ``tensor.record_stream()``,
``torch.cuda.empty_cache()`` and ``torch.cuda.set_per_process_memory_fraction()``
do not reach gpupool (use :func:`gpupool.trim` and
:func:`gpupool.set_memory_limit`), ``torch.cuda.memory_stats()`` does not
report gpupool's figures (use :func:`memory_stats`), and an out-of-memory
returns NULL to PyTorch instead of raising ``torch.OutOfMemoryError`` (the
message goes to stderr; register :func:`gpupool.on_oom` to act on it).
"""

from __future__ import annotations

import os
from typing import Optional

import gpupool
from gpupool import _lib

# Kept from the former gpupool_torch module.
from gpupool import (  # noqa: F401
    dump_snapshot,
    memory_stats,
    record_history,
    reset_peak_memory_stats,
    snapshot,
    stats,
    trim,
    version,
)

GpupoolError = gpupool.Error

_allocator = None


def library_path() -> str:
    """The ``libgpupool.so`` PyTorch is pointed at."""
    return _lib.library_path()


def lib(path: Optional[str] = None):
    """The loaded library (ctypes), with the C ABI declared."""
    return _lib.lib(path)


def last_error() -> str:
    """This thread's message of the last gpupool call ("" after a success)."""
    return lib().gpupool_last_error().decode(errors="replace")


def init(conf: Optional[str] = None) -> None:
    """Starts gpupool with a GPUPOOL_CONF string (None: $GPUPOOL_CONF).
    Already running is not an error."""
    gpupool.init(conf)


def install(conf: Optional[str] = None, path: Optional[str] = None):
    """Makes gpupool PyTorch's CUDA allocator for this process.

    ``conf`` is a GPUPOOL_CONF string; default ``$GPUPOOL_CONF`` or
    ``backend=cuda``. It is also exported as GPUPOOL_CONF so that child
    processes see it. Call before the first CUDA allocation (PyTorch refuses
    to swap an allocator already in use). Returns the
    ``CUDAPluggableAllocator``.
    """
    global _allocator
    import torch

    conf = conf or os.environ.get("GPUPOOL_CONF") or "backend=cuda"
    os.environ["GPUPOOL_CONF"] = conf
    lib(path)
    gpupool.init(conf)
    if _allocator is None:
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(
            _lib.path(), "gpupool_torch_malloc", "gpupool_torch_free"
        )
        torch.cuda.memory.change_current_allocator(_allocator)
    return _allocator
