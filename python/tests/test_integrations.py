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


def _fake_torch(calls):
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
    return fake


def test_torch_python_route_points_pytorch_at_the_bundled_library(pool, monkeypatch):
    """install(shim=False): PyTorch's Python CUDAPluggableAllocator over the
    library's hooks. The simulator runs here, so the CUDA-only checks are
    stubbed out for this test alone (the next tests check them)."""
    calls = []
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(calls))
    monkeypatch.delenv("GPUPOOL_CONF", raising=False)
    import gpupool.torch as gt

    monkeypatch.setattr(gt, "_allocator", None)
    monkeypatch.setattr(gt, "_require_cuda_runtime", lambda: None)
    monkeypatch.setattr(gt, "cuda_conf", lambda conf: conf)
    alloc = gt.install("backend=sim,devices=2", shim=False)
    assert gt.route() == "python"
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


def test_torch_cuda_conf_forces_the_cuda_backend(monkeypatch):
    import gpupool.torch as gt

    monkeypatch.delenv("GPUPOOL_CONF", raising=False)
    sh = "stitch_share=0.01"  # PyTorch's default: it marks no steps
    assert gt.cuda_conf(None) == f"backend=cuda,{sh}"
    assert gt.cuda_conf("") == f"backend=cuda,{sh}"
    assert gt.cuda_conf("max_bytes=1GiB") == f"backend=cuda,max_bytes=1GiB,{sh}"
    assert gt.cuda_conf("backend=auto,fraction=0.5") == f"backend=cuda,fraction=0.5,{sh}"
    assert gt.cuda_conf("backend=cuda,max_bytes=2GiB") == f"backend=cuda,max_bytes=2GiB,{sh}"
    # A share or a budget the caller sets is kept, 0 (no limit) included.
    assert gt.cuda_conf("stitch_share=0") == "backend=cuda,stitch_share=0"
    assert gt.cuda_conf("stitch_budget=4") == "backend=cuda,stitch_budget=4"
    monkeypatch.setenv("GPUPOOL_CONF", "initial_bytes=1MiB")
    assert gt.cuda_conf(None) == f"backend=cuda,initial_bytes=1MiB,{sh}"
    for bad in ("backend=sim", "devices=2,backend=sim"):
        with pytest.raises(ValueError, match="never the simulator"):
            gt.cuda_conf(bad)


@pytest.mark.parametrize("shim", [True, False])
def test_torch_install_refuses_the_simulator(monkeypatch, shim):
    calls = []
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(calls))
    import gpupool.torch as gt

    monkeypatch.setattr(gt, "_allocator", None)
    with pytest.raises(ValueError, match="backend=sim"):
        gt.install("backend=sim,devices=2", shim=shim)
    assert calls == []


@pytest.mark.parametrize("shim", [True, False])
def test_torch_install_refuses_a_running_simulator(pool, monkeypatch, shim):
    """gpupool already runs on the simulator (the fixture's): install()
    must not hand it to PyTorch, whatever conf it is given."""
    calls = []
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(calls))
    import gpupool.torch as gt

    monkeypatch.setattr(gt, "_allocator", None)
    assert gpupool._started_conf.startswith("backend=sim")
    with pytest.raises(gpupool.Error, match="already running with backend=sim"):
        gt.install("backend=cuda", shim=shim)
    assert calls == []
    gpupool.shutdown()
    assert gpupool._started_conf is None


def test_torch_shim_source_ships_in_the_package():
    import os

    import gpupool.torch as gt

    src = gt.SHIM_SOURCE
    assert src.is_file(), src
    assert src.parent.parent == __import__("pathlib").Path(gpupool.__file__).resolve().parent
    text = src.read_text()
    for needle in (
        "gpupool_torch_shim_install",
        "changeCurrentAllocator",
        "set_record_stream_fn",
        "OutOfMemoryError",
        "gpupool_alloc_in_pool",
    ):
        assert needle in text, needle
    if os.environ.get("GPUPOOL_EXPECT_INSTALLED") == "1":
        assert "site-packages" in str(src), src


def test_torch_shim_compile_args():
    import gpupool.torch as gt

    cmd = gt.shim_compile_args(["/t/inc", "/t/inc/api"], ["/cuda/inc"], True, "/o/shim.so",
                               ["/t/lib"], cxx="g++")
    assert cmd[0] == "g++" and "-std=c++17" in cmd and "-fPIC" in cmd
    assert "-D_GLIBCXX_USE_CXX11_ABI=1" in cmd
    assert cmd[cmd.index("-o") + 1] == "/o/shim.so"
    assert ["-isystem", "/cuda/inc"] == cmd[cmd.index("/cuda/inc") - 1 : cmd.index("/cuda/inc") + 1]
    assert "-L/t/lib" in cmd and "-Wl,-rpath,/t/lib" in cmd
    assert cmd[-4:] == ["-lc10", "-lc10_cuda", "-ltorch_cuda", "-ldl"]
    syn = gt.shim_compile_args(["/t/inc"], [], False, "unused", syntax_only=True, cxx="c++")
    assert syn[-1] == "-fsyntax-only" and "-o" not in syn and "-shared" not in syn
    assert "-D_GLIBCXX_USE_CXX11_ABI=0" in syn


def _fake_torch_for_build(tmp_path):
    torch_dir = tmp_path / "site" / "torch"
    (torch_dir / "include").mkdir(parents=True)
    (torch_dir / "lib").mkdir()
    fake = types.ModuleType("torch")
    fake.__file__ = str(torch_dir / "__init__.py")
    fake.__version__ = "9.9.9+fake"
    fake._C = types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True)
    ext = types.ModuleType("torch.utils.cpp_extension")
    ext.include_paths = lambda *a: [str(torch_dir / "include")]
    ext.library_paths = lambda *a: [str(torch_dir / "lib")]
    ext.CUDA_HOME = None
    utils = types.ModuleType("torch.utils")
    utils.cpp_extension = ext
    fake.utils = utils
    return fake, utils, ext


def test_torch_shim_build_is_cached_and_keyed_by_source(tmp_path, monkeypatch):
    """build_shim with a stand-in compiler: it runs once per source (and
    torch, and command), writes the library atomically into the cache, and
    a changed source builds anew."""
    import gpupool.torch as gt

    fake, utils, ext = _fake_torch_for_build(tmp_path)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setitem(sys.modules, "torch.utils", utils)
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", ext)
    cuda = tmp_path / "cuda"
    (cuda / "include").mkdir(parents=True)
    (cuda / "include" / "cuda_runtime_api.h").write_text("/* stand-in */\n")
    monkeypatch.setenv("CUDA_HOME", str(cuda))
    monkeypatch.setenv("GPUPOOL_TORCH_SHIM_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GPUPOOL_CUDA_INCLUDE", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    # Only the stand-in CUDA: no nvidia wheels from this environment's site-packages.
    import site

    monkeypatch.setattr(site, "getsitepackages", lambda: [])
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "-packages" not in p])
    # Without crt/host_defines.h (cuda_runtime.h needs it): a clear error.
    with pytest.raises(RuntimeError, match="crt/host_defines.h.*nvidia-cuda-nvcc-cu12"):
        gt.build_shim()
    (cuda / "include" / "crt").mkdir()
    (cuda / "include" / "crt" / "host_defines.h").write_text("/* stand-in */\n")
    monkeypatch.setenv("CUDA_HOME", str(cuda))
    log = tmp_path / "cxx.log"
    cxx = tmp_path / "fakecxx"
    cxx.write_text(
        "#!" + sys.executable + "\n"
        "import sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "out = sys.argv[sys.argv.index('-o') + 1]\n"
        "open(out, 'w').write('built')\n"
    )
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("GPUPOOL_TORCH_SHIM_DIR", str(tmp_path / "cache"))
    src = tmp_path / "torch_shim.cpp"
    src.write_text(gt.SHIM_SOURCE.read_text())
    monkeypatch.setattr(gt, "SHIM_SOURCE", src)

    first = gt.build_shim()
    assert first.startswith(str(tmp_path / "cache")) and open(first).read() == "built"
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and str(cuda / "include") in lines[0] and str(src) in lines[0]
    assert gt.build_shim() == first
    assert len(log.read_text().splitlines()) == 1  # cached
    src.write_text(src.read_text() + "\n// changed\n")
    second = gt.build_shim()
    assert second != first and len(log.read_text().splitlines()) == 2
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")] == []
    # A failing compiler: a clear error naming the command, nothing cached.
    cxx.write_text("#!/bin/sh\necho 'error: boom' >&2\nexit 1\n")
    src.write_text(src.read_text() + "\n// again\n")
    with pytest.raises(RuntimeError, match="boom"):
        gt.build_shim()
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_torch_shim_cuda_header_hint_names_the_wheels():
    import gpupool.torch as gt

    with pytest.raises(RuntimeError, match="nvidia-cuda-crt==13.0"):
        gt._require_cuda_headers([], "13.0")
    with pytest.raises(RuntimeError, match="nvidia-cuda-nvcc-cu12"):
        gt._require_cuda_headers([], None)


def test_torch_shim_cache_dir(monkeypatch, tmp_path):
    import gpupool.torch as gt

    monkeypatch.delenv("GPUPOOL_TORCH_SHIM_DIR", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert gt.shim_cache_dir() == tmp_path / "gpupool_torch_shim"
    monkeypatch.setenv("GPUPOOL_TORCH_SHIM_DIR", str(tmp_path / "x"))
    assert gt.shim_cache_dir() == tmp_path / "x"


def _fake_torch_stats(current_device=0):
    def refuse(*a, **k):
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")

    names = ("memory_stats", "memory_allocated", "max_memory_allocated", "memory_reserved",
             "max_memory_reserved", "reset_peak_memory_stats")
    memory = types.SimpleNamespace(**{n: refuse for n in names})
    cuda = types.SimpleNamespace(memory=memory, current_device=lambda: current_device,
                                 **{n: refuse for n in names})
    fake = types.ModuleType("torch")
    fake.cuda = cuda
    return fake, refuse


def test_torch_patch_stats_answers_with_gpupool(pool, monkeypatch):
    fake, refuse = _fake_torch_stats(current_device=1)
    monkeypatch.setitem(sys.modules, "torch", fake)
    import gpupool.torch as gt

    gt.patch_torch_stats()
    gt.patch_torch_stats()  # idempotent
    try:
        p = gpupool.alloc(3 * MIB, device=1)
        for mod in (fake.cuda, fake.cuda.memory):
            st = mod.memory_stats()  # the current device: 1
            assert st == dict(sorted(gpupool.memory_stats(1).items()))
            assert mod.memory_allocated() == st["allocated_bytes.all.current"] >= 3 * MIB
            assert mod.memory_allocated("cuda:1") == st["allocated_bytes.all.current"]
            assert mod.memory_allocated(types.SimpleNamespace(type="cuda", index=0)) == 0
            assert mod.memory_allocated(0) == 0
            assert mod.memory_reserved(1) == st["reserved_bytes.all.current"]
            assert mod.max_memory_reserved(1) == st["reserved_bytes.all.peak"]
        gpupool.free(p, device=1)
        assert fake.cuda.max_memory_allocated(1) >= 3 * MIB
        assert fake.cuda.memory_allocated(1) == 0
        fake.cuda.reset_peak_memory_stats("cuda:1")
        assert fake.cuda.max_memory_allocated(1) == 0
        with pytest.raises(ValueError):
            fake.cuda.memory_stats("cpu")
    finally:
        gt.unpatch_torch_stats()
    assert fake.cuda.memory_stats is refuse and fake.cuda.memory.max_memory_allocated is refuse


def test_torch_hooks_start_gpupool_from_gpupool_conf():
    """Without gpupool_init, the first malloc starts gpupool from
    GPUPOOL_CONF (here the simulator) and is served; so are the next."""
    import os
    import subprocess

    code = (
        "import ctypes, gpupool._lib as L\n"
        "lib = L.lib()\n"
        "lib.gpupool_torch_malloc.restype = ctypes.c_void_p\n"
        "lib.gpupool_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
        "lib.gpupool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
        "ps = [lib.gpupool_torch_malloc(n, 0, None) for n in (4096, 3 << 20, 4096)]\n"
        "print('PTRS' if all(ps) and len(set(ps)) == 3 else 'NULL', lib.gpupool_last_error().decode())\n"
        "for p, n in zip(ps, (4096, 3 << 20, 4096)):\n"
        "    lib.gpupool_torch_free(p, n, 0, None)\n"
        "print('FREED', lib.gpupool_last_error().decode())\n"
    )
    env = dict(os.environ)
    env["GPUPOOL_CONF"] = "backend=sim,devices=1,capacity=64MiB,maint_ms=0"
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    assert out.splitlines() == ["PTRS ", "FREED "], out


def test_torch_hooks_never_start_the_simulator_unasked():
    """The hooks' implicit start (GPUPOOL_CONF without a backend) is CUDA:
    where there is no driver, the first malloc fails and says so."""
    import os
    import subprocess

    code = (
        "import ctypes, gpupool._lib as L\n"
        "lib = L.lib()\n"
        "lib.gpupool_torch_malloc.restype = ctypes.c_void_p\n"
        "lib.gpupool_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]\n"
        "p = lib.gpupool_torch_malloc(4096, 0, None)\n"
        "err = lib.gpupool_last_error().decode()\n"
        "print('PTR' if p else 'NULL', err)\n"
    )
    env = dict(os.environ)
    env["GPUPOOL_CONF"] = "devices=1,capacity=64MiB"  # no backend named
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    have_driver = os.path.exists("/dev/nvidiactl")
    if have_driver:
        assert out.startswith("PTR"), out  # device memory from CUDA
    else:
        assert out.startswith("NULL"), out
        assert "driver" in out.lower() or "cuda" in out.lower(), out
