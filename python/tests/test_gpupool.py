"""The gpupool package on the simulator: lifecycle, allocation, errors,
PyTorch-style statistics, limits, the out-of-memory callback, snapshots."""

import ctypes
import os
import pickle
import threading

import gpupool
import pytest

MIB = 1 << 20


def test_the_installed_package_is_tested():
    """CI installs the wheel and runs these tests from outside the source
    tree: the package and its bundled library must be the installed ones."""
    path = gpupool.library_path()
    assert os.path.exists(path)
    if os.environ.get("GPUPOOL_EXPECT_INSTALLED") == "1":
        pkg = os.path.dirname(os.path.abspath(gpupool.__file__))
        assert "site-packages" in pkg, pkg
        assert os.path.dirname(path) == pkg, (path, pkg)
        assert os.path.basename(path).startswith("_libgpupool")
    assert gpupool.version() == gpupool.__version__
    assert gpupool.abi_version() == 1


def test_lifecycle(pool):
    assert gpupool.is_initialized()
    assert gpupool.device_count() == 2
    gpupool.init("backend=sim,devices=1")  # already running: not an error
    assert gpupool.device_count() == 2
    gpupool.shutdown()
    assert not gpupool.is_initialized()
    with pytest.raises(gpupool.Error) as e:
        gpupool.alloc(64)
    assert "shut down" in str(e.value) and e.value.status == 3
    gpupool.shutdown()  # not running: not an error
    gpupool.init(pool_conf := "backend=sim,devices=1,capacity=64MiB")
    assert gpupool.device_count() == 1, pool_conf


def test_init_from_environment(pool, monkeypatch):
    gpupool.shutdown()
    monkeypatch.setenv("GPUPOOL_CONF", "backend=sim,devices=3,capacity=64MiB,maint_ms=0")
    gpupool.init()
    assert gpupool.device_count() == 3
    gpupool.shutdown()
    gpupool.init("")
    assert gpupool.device_count() == 3


def test_bad_config_is_a_value_error_naming_the_key(pool):
    gpupool.shutdown()
    for conf, key in [
        ("backend=sim,colour=blue", "colour"),
        ("backend=sim,fraction=2", "fraction"),
        ("backend=sim,max_bytes=lots", "max_bytes"),
    ]:
        with pytest.raises(ValueError) as e:
            gpupool.init(conf)
        assert key in str(e.value)
        assert isinstance(e.value, gpupool.Error)
    with pytest.raises(TypeError):
        gpupool.init(42)


def test_alloc_free_and_memory_is_real(pool):
    sizes = [1, 300, 4096, 70000, 3 * MIB, 9 * MIB + 17]
    ptrs = [gpupool.alloc(n, device=1) for n in sizes]
    for p, n in zip(ptrs, sizes):
        assert p % 256 == 0
        # Simulator memory is host memory: write and read it back.
        ctypes.memset(p, 0x5A, n)
        assert ctypes.string_at(p + n - 1, 1) == b"\x5a"
    assert len(set(ptrs)) == len(ptrs)
    st = gpupool.memory_stats(1)
    assert st["requested_bytes.all.current"] == sum(sizes)
    assert st["allocation.all.current"] == len(sizes)
    for p in ptrs:
        gpupool.free(p, device=1)
    st = gpupool.memory_stats(1)
    assert st["requested_bytes.all.current"] == 0
    assert st["allocated_bytes.all.current"] == 0
    assert st["requested_bytes.all.peak"] == sum(sizes)


def test_streams(pool):
    s = gpupool.stream_create(0)
    s2 = gpupool.stream_create(0)
    assert s and s2 and s != s2
    p = gpupool.alloc(5000, 0, s)
    gpupool.record_stream(p, s2, 0)
    gpupool.free(p, 0, s)
    with pytest.raises(ValueError, match="belongs to device 0"):
        gpupool.alloc(64, 1, s)
    gpupool.stream_destroy(s, 0)
    gpupool.stream_destroy(s2, 0)
    with pytest.raises(ValueError, match="unknown stream"):
        gpupool.alloc(64, 0, s)


def test_bad_input_raises_value_error_and_changes_nothing(pool):
    p = gpupool.alloc(4096, 0)
    before = gpupool.stats(0)
    cases = [
        (lambda: gpupool.alloc(0), "at least 1 byte"),
        (lambda: gpupool.alloc(-1), "out of range"),
        (lambda: gpupool.alloc(1 << 60), "larger than the device"),
        (lambda: gpupool.alloc(64, device=2), "invalid device 2"),
        (lambda: gpupool.alloc(64, device=-1), "out of range"),
        (lambda: gpupool.alloc(64, stream=0x7777), "unknown stream"),
        (lambda: gpupool.free(0), "NULL"),
        (lambda: gpupool.free(12345), "unknown pointer"),
        (lambda: gpupool.free(p + 256), "unknown pointer"),
        (lambda: gpupool.free(p, device=1), "allocated on device 0"),
        (lambda: gpupool.memory_stats(5), "invalid device 5"),
        (lambda: gpupool.set_memory_limit(-5), "out of range"),
        (lambda: gpupool.set_memory_limit(MIB, device=7), "invalid device 7"),
        (lambda: gpupool.reset_peak_memory_stats(9), "invalid device 9"),
        (lambda: gpupool.record_stream(p, 0x7777), "unknown stream"),
    ]
    for call, needle in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert needle in str(e.value), (needle, str(e.value))
    with pytest.raises(TypeError):
        gpupool.alloc(1.5)
    with pytest.raises(TypeError):
        gpupool.alloc(True)
    # Nothing changed, no driver call included (stats' driver_calls count
    # the backend's calls on every device: a free presented to device 1
    # must not build device 1's pool).
    assert gpupool.stats(0) == before
    gpupool.free(p)
    with pytest.raises(ValueError, match="double free") as e:
        gpupool.free(p)
    assert e.value.status_name == "GPUPOOL_STATUS_DOUBLE_FREE"


def test_memory_stats_have_pytorchs_keys_and_meanings(pool):
    keys = [
        "requested_bytes.all.current",
        "requested_bytes.all.peak",
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "active_bytes.all.current",
        "active_bytes.all.peak",
        "reserved_bytes.all.current",
        "reserved_bytes.all.peak",
        "inactive_split_bytes.all.current",
        "inactive_split_bytes.all.peak",
        "allocation.all.current",
        "num_alloc_retries",
        "num_ooms",
        "num_device_alloc",
        "num_device_free",
    ]
    st = gpupool.memory_stats(0)
    for k in keys:
        assert k in st and isinstance(st[k], int), k
    assert list(st) == sorted(st), "sorted like torch.cuda.memory_stats()"
    a = gpupool.alloc(100)
    b = gpupool.alloc(3 * MIB + 1)
    st = gpupool.memory_stats(0)
    # requested: the sizes asked for; allocated: rounded; reserved: held.
    assert st["requested_bytes.all.current"] == 100 + 3 * MIB + 1
    assert st["allocated_bytes.all.current"] >= 256 + 3 * MIB + 256
    assert st["requested_bytes.all.current"] < st["allocated_bytes.all.current"]
    assert st["allocated_bytes.all.current"] <= st["active_bytes.all.current"]
    assert st["active_bytes.all.current"] <= st["reserved_bytes.all.current"]
    assert st["num_device_alloc"] >= 1
    # Free slots beside the live 100-byte block are split memory.
    gpupool.free(b)
    st = gpupool.memory_stats(0)
    assert st["inactive_split_bytes.all.current"] > 0
    assert st["allocated_bytes.all.peak"] >= 3 * MIB
    # Nested stats agree.
    nested = gpupool.stats(0)
    assert nested["requested_bytes"]["current"] == 100
    assert nested["allocated_bytes"]["current"] == st["allocated_bytes.all.current"]
    gpupool.free(a)
    gpupool.trim()
    st = gpupool.memory_stats(0)
    assert st["reserved_bytes.all.current"] == 0
    assert st["inactive_split_bytes.all.current"] == 0


def test_reset_peak_memory_stats(pool):
    p = gpupool.alloc(8 * MIB)
    gpupool.free(p)
    st = gpupool.memory_stats(0)
    assert st["allocated_bytes.all.peak"] >= 8 * MIB
    gpupool.reset_peak_memory_stats(0)
    st = gpupool.memory_stats(0)
    assert st["allocated_bytes.all.peak"] == 0
    assert st["requested_bytes.all.peak"] == 0
    assert st["reserved_bytes.all.peak"] == st["reserved_bytes.all.current"]
    gpupool.reset_peak_memory_stats(-1)


def test_memory_limit_refuses_growth_and_on_oom_is_told(pool):
    seen = []
    gpupool.on_oom(lambda dev, req: seen.append((dev, req, gpupool.memory_stats(dev)["num_ooms"])))
    gpupool.set_memory_limit(32 * MIB, device=1)
    a = gpupool.alloc(20 * MIB, device=1)
    with pytest.raises(gpupool.OutOfMemoryError) as e:
        gpupool.alloc(20 * MIB, device=1)
    assert isinstance(e.value, MemoryError)
    assert "requested 20971520" in str(e.value)
    assert seen == [(1, 20 * MIB, 1)], seen
    st = gpupool.memory_stats(1)
    assert st["reserved_bytes.all.current"] <= 32 * MIB
    assert st["num_ooms"] == 1
    # Device 0 has no limit.
    b = gpupool.alloc(100 * MIB, device=0)
    gpupool.free(b, device=0)
    # Lifted: the same request fits.
    gpupool.set_memory_limit(None, device=1)
    c = gpupool.alloc(20 * MIB, device=1)
    gpupool.on_oom(None)
    gpupool.set_memory_limit(1 * MIB, device=1)
    with pytest.raises(MemoryError):
        gpupool.alloc(20 * MIB, device=1)
    assert len(seen) == 1, "the callback was removed"
    gpupool.set_memory_limit(0, device=-1)
    gpupool.free(a, device=1)
    gpupool.free(c, device=1)


def test_lowering_the_limit_gives_cached_memory_back(pool):
    p = gpupool.alloc(200 * MIB)
    gpupool.free(p)
    assert gpupool.memory_stats(0)["reserved_bytes.all.current"] >= 200 * MIB
    gpupool.set_memory_limit(64 * MIB)
    assert gpupool.memory_stats(0)["reserved_bytes.all.current"] <= 64 * MIB


def test_limits_and_initial_bytes_from_the_configuration():
    gpupool.shutdown()
    gpupool.init("backend=sim,devices=1,capacity=1GiB,maint_ms=0,max_bytes=48MiB,initial_bytes=16MiB")
    try:
        st = gpupool.memory_stats(0)
        assert st["reserved_bytes.all.current"] == 16 * MIB
        p = gpupool.alloc(10 * MIB)
        assert gpupool.memory_stats(0)["num_device_alloc"] == st["num_device_alloc"]
        with pytest.raises(gpupool.OutOfMemoryError):
            gpupool.alloc(40 * MIB)
        gpupool.free(p)
    finally:
        gpupool.shutdown()
    gpupool.init("backend=sim,devices=1,capacity=256MiB,maint_ms=0,fraction=0.25")
    try:
        with pytest.raises(gpupool.OutOfMemoryError):
            gpupool.alloc(100 * MIB)
        p = gpupool.alloc(60 * MIB)
        gpupool.free(p)
    finally:
        gpupool.shutdown()


def test_an_exception_in_on_oom_is_not_fatal(pool, capfd):
    def boom(dev, req):
        raise RuntimeError("callback failed")

    gpupool.on_oom(boom)
    gpupool.set_memory_limit(4 * MIB)
    with pytest.raises(gpupool.OutOfMemoryError):
        gpupool.alloc(8 * MIB)
    assert "callback failed" in capfd.readouterr().err
    with pytest.raises(TypeError):
        gpupool.on_oom(42)


def test_snapshots_and_history(pool, tmp_path):
    gpupool.record_history(True)
    p = gpupool.alloc(5000, device=1)
    snap = gpupool.snapshot(1)
    assert snap["device"] == 1 and snap["segments"]
    assert [s["device"] for s in gpupool.snapshot(-1)] == [0, 1]
    path = tmp_path / "snap.pickle"
    gpupool.dump_snapshot(path)
    d = pickle.loads(path.read_bytes())
    assert len(d["device_traces"]) == 2 and len(d["device_traces"][1]) == 1
    gpupool.free(p, device=1)
    gpupool.record_history(False)


def test_trim_gives_everything_back(pool):
    ptrs = [gpupool.alloc(n) for n in (100, 70000, 5 * MIB)]
    for p in ptrs:
        gpupool.free(p)
    assert gpupool.memory_stats(0)["reserved_bytes.all.current"] > 0
    gpupool.trim()
    assert gpupool.memory_stats(0)["reserved_bytes.all.current"] == 0


def test_threads_allocate_at_once(pool):
    errors = []

    def work(dev):
        try:
            live = []
            for i in range(2000):
                if live and i % 3 == 0:
                    gpupool.free(live.pop(), dev)
                else:
                    live.append(gpupool.alloc(64 + (i * 7919) % 100000, dev))
            for p in live:
                gpupool.free(p, dev)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i % 2,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for d in (0, 1):
        assert gpupool.memory_stats(d)["requested_bytes.all.current"] == 0


def test_mark_step_serves_a_repeating_step_from_its_plan(pool):
    """Three marked steps of the same large requests: the second and third
    are served from the plan of the first, at the same addresses, with no
    new device memory."""

    def step():
        a = gpupool.alloc(8 * MIB)
        b = gpupool.alloc(3 * MIB)
        gpupool.free(b)
        c = gpupool.alloc(5 * MIB)
        gpupool.free(a)
        gpupool.free(c)
        return (a, b, c)

    gpupool.mark_step()
    step()
    gpupool.mark_step()
    second = step()
    allocs = gpupool.stats()["num_device_allocs"]
    gpupool.mark_step()
    third = step()
    assert third == second
    assert gpupool.stats()["num_device_allocs"] == allocs
    plan = gpupool.stats()["plan"]
    assert plan["plans"] == 1 and plan["served"] == 6, plan
    assert plan["departures"] == 0 and plan["misses"] == 0, plan
