"""gpupool.torch and gpupool.cupy without PyTorch or CuPy: each is driven
through a stand-in module that records what it is asked, so what the
integration does with the real one is checked here; the real libraries run
in the GPU check."""

import ctypes
import gc
import sys
import types

import gpupool
import pytest

MIB = 1 << 20


class FakeCupy(types.ModuleType):
    """The parts of CuPy's API gpupool.cupy uses."""

    def __init__(self, device=0, stream=0):
        super().__init__("cupy")
        fake = self
        self.allocator = None

        class Device:
            def __init__(self, dev=None):
                self.id = device

        class Stream:
            ptr = stream

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id=-1):
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr = mem, mem.ptr + offset

        class Pool:
            def malloc(self, size):
                return ("default pool", size)

        self._pool = Pool()

        def set_allocator(fn):
            fake.allocator = fn

        self.cuda = types.SimpleNamespace(
            Device=Device,
            UnownedMemory=UnownedMemory,
            MemoryPointer=MemoryPointer,
            get_current_stream=lambda: Stream(),
            set_allocator=set_allocator,
        )
        self.get_default_memory_pool = lambda: self._pool


@pytest.fixture
def fake_cupy(monkeypatch):
    f = FakeCupy(device=1)
    monkeypatch.setitem(sys.modules, "cupy", f)
    return f


def test_cupy_and_torch_are_imported_lazily():
    import subprocess

    code = (
        "import sys, gpupool, gpupool.cupy, gpupool.torch\n"
        "assert 'cupy' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cupy_install_sets_gpupool_as_the_allocator(pool, fake_cupy):
    import gpupool.cupy as gc_

    gc_.install()  # already initialized with the simulator: kept
    assert fake_cupy.allocator is gc_.malloc
    mp = fake_cupy.allocator(3 * MIB)
    assert mp.ptr % 256 == 0 and mp.mem.size == 3 * MIB
    assert mp.mem.device_id == 1
    ctypes.memset(mp.ptr, 1, 3 * MIB)  # simulator memory is host memory
    st = gpupool.memory_stats(1)
    assert st["requested_bytes.all.current"] == 3 * MIB
    # CuPy drops the pointer: the owner frees it on the allocation's stream.
    del mp
    gc.collect()
    assert gpupool.memory_stats(1)["requested_bytes.all.current"] == 0
    zero = fake_cupy.allocator(0)
    assert zero.ptr == 0
    gc_.uninstall()
    assert fake_cupy.allocator == fake_cupy._pool.malloc


def test_cupy_out_of_memory_is_a_memory_error(pool, fake_cupy):
    import gpupool.cupy as gc_

    gpupool.set_memory_limit(8 * MIB, device=1)
    with pytest.raises(MemoryError):
        gc_.malloc(16 * MIB)
    a = gc_.Allocation(4 * MIB, 1, 0)
    a.free()
    a.free()  # idempotent
    assert gpupool.memory_stats(1)["requested_bytes.all.current"] == 0


def test_cupy_allocation_outliving_shutdown_is_harmless(pool):
    import gpupool.cupy as gc_

    a = gc_.Allocation(1000, 0, 0)
    gpupool.shutdown()
    a.free()  # the runtime took the memory back already


def test_torch_install_points_pytorch_at_the_bundled_library(pool, monkeypatch):
    calls = []

    class CUDAPluggableAllocator:
        def __init__(self, path, malloc, free):
            calls.append(("new", path, malloc, free))

    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(
        memory=types.SimpleNamespace(
            CUDAPluggableAllocator=CUDAPluggableAllocator,
            change_current_allocator=lambda a: calls.append(("change", a)),
        )
    )
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.delenv("GPUPOOL_CONF", raising=False)
    import gpupool.torch as gt

    monkeypatch.setattr(gt, "_allocator", None)
    alloc = gt.install("backend=sim,devices=2")
    assert calls[0] == ("new", gpupool.library_path(), "gpupool_torch_malloc", "gpupool_torch_free")
    assert calls[1] == ("change", alloc)
    import os

    assert os.environ["GPUPOOL_CONF"] == "backend=sim,devices=2"
    # The symbols PyTorch loads exist and work on the same runtime.
    lib = ctypes.CDLL(calls[0][1])
    lib.gpupool_torch_malloc.restype = ctypes.c_void_p
    lib.gpupool_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.gpupool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    p = lib.gpupool_torch_malloc(4096, 1, None)
    assert p and gpupool.memory_stats(1)["requested_bytes.all.current"] == 4096
    lib.gpupool_torch_free(p, 4096, 1, None)
    assert gpupool.memory_stats(1)["requested_bytes.all.current"] == 0
    # A second install reuses the allocator (PyTorch refuses a second swap).
    assert gt.install() is alloc and len(calls) == 2
