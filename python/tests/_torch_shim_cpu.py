"""Drives gpupool's torch shim without a GPU (run by test_torch_shim_cpu.py
in its own process): builds python/tests/torch_shim_harness.cpp (the shim's
source plus entry points that call the allocator as PyTorch does) against
the installed torch, installs it over gpupool on the simulator, and checks
what each hook does. Prints "torch shim cpu: OK" at the end; any failed
assertion exits non-zero."""

import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import gpupool
import gpupool.torch as gt
import torch
from torch.utils import cpp_extension

MIB = 1 << 20
HERE = Path(__file__).resolve().parent


def build(out: str) -> None:
    try:
        incs = cpp_extension.include_paths()
    except TypeError:
        incs = cpp_extension.include_paths(False)
    cuda = gt._cuda_include_dirs(torch)
    gt._require_cuda_headers(cuda, torch.version.cuda)
    abi = bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    cmd = gt.shim_compile_args(incs, cuda, abi, out, cpp_extension.library_paths(),
                               source=str(HERE / "torch_shim_harness.cpp"))
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, " ".join(cmd) + "\n" + p.stderr[-6000:]


def main() -> None:
    gpupool.init("backend=sim,devices=2,capacity=1GiB,maint_ms=0")
    tmp = tempfile.mkdtemp()
    out = os.path.join(tmp, "harness.so")
    build(out)
    h = ctypes.CDLL(out)
    lib_path = gpupool.library_path()
    fake = None
    if "--fake-pools" in sys.argv:
        # The shim over a stand-in library that has the pool functions.
        os.environ["GPUPOOL_REAL_LIB"] = lib_path
        lib_path = os.path.join(tmp, "fakepool.so")
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-std=c11", "-fPIC", "-shared", "-o", lib_path,
                        str(HERE / "fake_pool_lib.c"), "-ldl"], check=True)
        fake = ctypes.CDLL(lib_path)
        fake.fake_pool_log.restype = ctypes.c_char_p
    err = ctypes.create_string_buffer(4096)
    E = (err, len(err))
    vp = ctypes.c_void_p

    def call(name, *args):
        err.value = b""
        rc = getattr(h, name)(*args, *E)
        return rc, err.value.decode(errors="replace")

    h.gpupool_torch_shim_install.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    assert h.gpupool_torch_shim_install(os.fsencode(lib_path), *E) == 0, err.value
    assert h.gpupool_torch_shim_install(os.fsencode(lib_path), *E) == 0  # no-op
    assert h.harness_current_is_shim() == 1
    name = ctypes.create_string_buffer(64)
    h.harness_name(name, 64)
    assert name.value == b"gpupool", name.value

    h.harness_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(vp)] + [ctypes.c_char_p, ctypes.c_size_t]
    h.harness_malloc_on.argtypes = [ctypes.c_size_t, ctypes.c_int, vp, ctypes.POINTER(vp)] + [ctypes.c_char_p, ctypes.c_size_t]
    h.harness_free.argtypes = [vp, ctypes.c_char_p, ctypes.c_size_t]
    h.harness_record_stream.argtypes = [vp, ctypes.c_char_p, ctypes.c_size_t]
    h.harness_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    stats_t = ctypes.c_int64 * 9
    h.harness_stats.argtypes = [ctypes.c_int, stats_t, ctypes.c_char_p, ctypes.c_size_t]
    u64 = ctypes.c_uint64
    for n in ("harness_create_pool", "harness_begin_pool", "harness_end_pool", "harness_release_pool"):
        getattr(h, n).argtypes = [ctypes.c_int, u64, u64, ctypes.c_char_p, ctypes.c_size_t]
    h.harness_pool_use_count.argtypes = [ctypes.c_int, u64, u64]
    h.gpupool_torch_shim_pool_key.argtypes = [u64, u64]
    h.gpupool_torch_shim_pool_key.restype = u64
    h.gpupool_torch_shim_missing_pools.restype = ctypes.c_char_p

    def malloc(size, device):
        p = vp()
        rc, msg = call("harness_malloc", size, device, ctypes.byref(p))
        return (p.value if rc == 0 else None), msg

    def stats(device):
        s = stats_t()
        rc, msg = call("harness_stats", device, s)
        assert rc == 0, msg
        keys = ("allocated", "allocated_peak", "reserved", "reserved_peak", "requested",
                "requested_peak", "active", "allocations", "num_ooms")
        return dict(zip(keys, list(s)))

    # Zero bytes: NULL, no error (PyTorch never frees it).
    p, msg = malloc(0, 1)
    assert p is None or p == 0, (p, msg)

    # Allocation and statistics.
    p, msg = malloc(MIB, 1)
    assert p, msg
    g = gpupool.memory_stats(1)
    s = stats(1)
    assert g["requested_bytes.all.current"] == MIB and s["requested"] == MIB, (g, s)
    assert s["allocated"] == g["allocated_bytes.all.current"] and s["reserved"] == g["reserved_bytes.all.current"]
    assert s["allocations"] == 1 and s["active"] >= MIB, s

    # record_stream: the block's own device is found; an unknown pointer is an error.
    rc, msg = call("harness_record_stream", p)
    assert rc == 0, msg
    rc, msg = call("harness_record_stream", 0x1234)
    assert rc == 1 and msg.startswith("Error: gpupool: record_stream failed"), msg

    # Free, then the peak stays until reset.
    rc, msg = call("harness_free", p)
    assert rc == 0, msg
    s = stats(1)
    assert s["requested"] == 0 and s["requested_peak"] == MIB, s
    rc, msg = call("harness_reset_peak", 1)
    assert rc == 0, msg
    assert stats(1)["requested_peak"] == 0

    # Out of memory under a limit: c10::OutOfMemoryError with gpupool's report.
    gpupool.set_memory_limit(8 * MIB, device=1)
    p, msg = malloc(16 * MIB, 1)
    assert p is None and msg.startswith("OutOfMemoryError: gpupool: CUDA out of memory"), msg
    assert "GPUPOOL_STATUS_OUT_OF_MEMORY" in msg, msg
    assert stats(1)["num_ooms"] >= 1
    gpupool.set_memory_limit(None, device=1)
    # Larger than the device: out of memory too, as PyTorch's own allocator says.
    p, msg = malloc(4 << 30, 1)
    assert p is None and msg.startswith("OutOfMemoryError:") and "INVALID_SIZE" in msg, msg
    # Anything else: a plain error.
    p, msg = malloc(MIB, 7)
    assert p is None and msg.startswith("Error: gpupool:") and "INVALID_DEVICE" in msg, msg

    # empty_cache gives cached memory back.
    p, _ = malloc(64 * MIB, 0)
    call("harness_free", p)
    r0 = gpupool.memory_stats(0)["reserved_bytes.all.current"]
    rc, msg = call("harness_empty_cache")
    assert rc == 0, msg
    r1 = gpupool.memory_stats(0)["reserved_bytes.all.current"]
    assert r0 - r1 >= 64 * MIB, (r0, r1)

    # Memory fraction: needs the driver for the device's size.
    rc, msg = call("harness_set_memory_fraction", 0.5, 0)
    assert rc == 0 or "libcuda" in msg or "cuDevice" in msg, msg
    rc, msg = call("harness_set_memory_fraction", 1.5, 0)
    assert rc == 1 and "outside [0, 1]" in msg, msg

    # MemPool's destructor path never throws; use_on_oom is refused.
    assert call("harness_set_use_on_oom", 0)[0] == 0
    rc, msg = call("harness_set_use_on_oom", 1)
    assert rc == 1 and "use_on_oom" in msg, msg

    # Pool ids.
    assert h.gpupool_torch_shim_pool_key(5, 0) == 10
    assert h.gpupool_torch_shim_pool_key(0, 5) == 11
    k = h.gpupool_torch_shim_pool_key(3, 4)
    assert k % 2 == 1 and k != 0

    # Private pools.
    if h.gpupool_torch_shim_has_pools():
        def log():
            return fake.fake_pool_log().decode().splitlines() if fake else []

        def requested():
            return gpupool.memory_stats(0)["requested_bytes.all.current"]

        # A block of another stream, allocated before the pool's window.
        side = gpupool.stream_create(0)
        q = vp()
        rc, msg = call("harness_malloc_on", MIB, 0, side, ctypes.byref(q))
        assert rc == 0, msg
        q = q.value
        n0 = len(log())
        r0 = requested()
        # torch.cuda.MemPool(): {0, 1} is gpupool pool 3.
        rc, msg = call("harness_create_pool", 0, 0, 1)
        assert rc == 0, msg
        assert h.harness_pool_use_count(0, 0, 1) == 1
        # use_mem_pool: begin, allocations routed (gpupool told once per stream).
        rc, msg = call("harness_begin_pool", 0, 0, 1)
        assert rc == 0, msg
        assert h.harness_pool_use_count(0, 0, 1) == 2
        rc, msg = call("harness_begin_pool", 0, 0, 1)
        assert rc == 1 and "already allocating" in msg, msg
        p1, msg = malloc(MIB, 0)
        assert p1, msg
        p2, msg = malloc(2 * MIB, 0)
        assert p2, msg
        if fake:
            assert log()[n0:] == ["begin 0 3 0", f"alloc_in_pool {MIB} 0 0 3",
                                  f"alloc_in_pool {2 * MIB} 0 0 3"], log()[n0:]
        # Inside the window: a free on a stream gpupool routes is gpupool's
        # at once; one on a stream the pool accepts but gpupool was not told
        # of waits for the end.
        assert call("harness_free", p1)[0] == 0
        assert call("harness_free", q)[0] == 0
        if fake:  # (a real library may itself defer frees while a pool is active)
            assert requested() == r0 + 2 * MIB
        rc, msg = call("harness_end_pool", 0, 0, 1)
        assert rc == 0, msg
        if fake:  # (a real library's accounting of pool frees is its own)
            assert requested() == r0 + MIB, (requested(), r0)
        if fake:
            assert log()[n0 + 3:] == [f"free {p1} 0 0", "end 0 3", f"free {q} 0 {side}"], log()[n0 + 3:]
        # After the end: allocations are gpupool's ordinary ones again.
        p3, msg = malloc(MIB, 0)
        assert p3, msg
        assert call("harness_free", p3)[0] == 0
        if fake:
            assert [l for l in log()[n0 + 6:] if not l.startswith("free")] == [], log()
        # use_mem_pool's releasePool, then ~MemPool's: gpupool_release_pool at zero.
        rc, msg = call("harness_release_pool", 0, 0, 1)
        assert rc == 0 and h.harness_pool_use_count(0, 0, 1) == 1, msg
        assert call("harness_free", p2)[0] == 0
        rc, msg = call("harness_release_pool", 0, 0, 1)
        assert rc == 0 and h.harness_pool_use_count(0, 0, 1) == 0, msg
        if fake:
            assert log()[-1] == "release 0 3", log()
            # A graph pool ({5, 0}: 10) that allocated nothing (and, without
            # a device, no current stream to tell gpupool of): gpupool
            # never sees it, so no end or release reaches it either.
            n1 = len(log())
            assert call("harness_begin_pool", 0, 5, 0)[0] == 0
            assert call("harness_end_pool", 0, 5, 0)[0] == 0
            assert call("harness_release_pool", 0, 5, 0)[0] == 0
            assert log()[n1:] == [], log()[n1:]
        assert requested() == r0 - MIB
        gpupool.stream_destroy(side, 0)
        print("private pools: available, routed")
    else:
        missing = h.gpupool_torch_shim_missing_pools().decode()
        assert "gpupool_alloc_in_pool" in missing, missing
        rc, msg = call("harness_create_pool", 0, 0, 1)
        assert rc == 1 and "unavailable" in msg and missing in msg, msg
        rc, msg = call("harness_begin_pool", 0, 1, 0)
        assert rc == 1 and "unavailable" in msg, msg
        assert call("harness_end_pool", 0, 1, 0)[0] == 0
        assert call("harness_release_pool", 0, 1, 0)[0] == 0
        print("private pools: unavailable (" + missing + "), reported")

    # A tensor outliving gpupool at exit: its free is silent.
    p, msg = malloc(MIB, 0)
    assert p, msg
    gpupool.shutdown()
    assert call("harness_free", p)[0] == 0
    print("torch shim cpu: OK")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
