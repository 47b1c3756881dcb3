"""Tagged allocations, pause and resume on the simulator (2 MiB granules):
bytes survive a pause with save, device memory really goes back, and the
rules (unknown tags, repeats, frees of paused blocks, limits, segment mode)."""

import ctypes

import gpupool
import pytest

MIB = 1 << 20
GRAN = 2 * MIB


def _stat(key, device=0):
    return gpupool.memory_stats(device)[key]


def test_pause_with_save_releases_memory_and_resume_restores_bytes(pool):
    p = gpupool.alloc(3 * MIB, device=0, tag="weights")
    q = gpupool.alloc(5000, device=1, tag="weights")
    assert p % GRAN == 0 and q % GRAN == 0
    assert _stat("allocated_bytes.all.current") == 4 * MIB
    ctypes.memset(p, 0x3C, 3 * MIB)
    ctypes.memset(q, 0x7E, 5000)
    reserved = [_stat("reserved_bytes.all.current", d) for d in (0, 1)]
    assert gpupool.pause("weights", save=True) == 6 * MIB
    assert _stat("paused_bytes.all.current") == 4 * MIB
    assert _stat("paused_bytes.all.current", 1) == GRAN
    assert _stat("reserved_bytes.all.current") == reserved[0] - 4 * MIB
    assert _stat("reserved_bytes.all.current", 1) == reserved[1] - GRAN
    assert _stat("allocated_bytes.all.current") == 4 * MIB, "still live"
    assert gpupool.resume("weights") == 6 * MIB
    assert _stat("paused_bytes.all.current") == 0
    assert _stat("reserved_bytes.all.current") == reserved[0]
    assert ctypes.string_at(p, 3 * MIB) == b"\x3c" * (3 * MIB)
    assert ctypes.string_at(q, 5000) == b"\x7e" * 5000
    gpupool.free(p, device=0)
    gpupool.free(q, device=1)


def test_unknown_tags_and_repeats_do_nothing(pool):
    assert gpupool.pause(12345) == 0
    assert gpupool.resume("nothing here") == 0
    p = gpupool.alloc(MIB, tag=7)
    assert gpupool.resume(7) == 0
    assert gpupool.pause(7, save=False) == GRAN
    assert gpupool.pause(7) == 0
    assert gpupool.resume(7) == GRAN
    assert gpupool.resume(7) == 0
    ctypes.memset(p, 1, MIB)  # mapped again
    gpupool.free(p)


def test_paused_blocks_may_be_freed(pool):
    p = gpupool.alloc(MIB, tag=3)
    gpupool.pause(3)
    gpupool.free(p)
    assert _stat("paused_bytes.all.current") == 0
    assert _stat("allocated_bytes.all.current") == 0
    with pytest.raises(ValueError):
        gpupool.free(p)
    assert gpupool.resume(3) == 0


def test_tag_scope_tags_untagged_allocations_and_nests(pool):
    with gpupool.tag_scope("a"):
        a = gpupool.alloc(100)
        with gpupool.tag_scope("b"):
            b = gpupool.alloc(100)
        a2 = gpupool.alloc(100)
    plain = gpupool.alloc(100)
    assert a % GRAN == 0 and b % GRAN == 0 and a2 % GRAN == 0
    assert gpupool.pause("a") == 2 * GRAN
    assert gpupool.pause("b") == GRAN
    ctypes.memset(plain, 9, 100)  # untagged: untouched
    assert gpupool.resume("a") + gpupool.resume("b") == 3 * GRAN
    for x in (a, b, a2, plain):
        gpupool.free(x)


def test_resume_over_a_limit_raises_and_keeps_the_blocks_paused(pool):
    p = gpupool.alloc(8 * MIB, tag=1)
    ctypes.memset(p, 0x11, 8 * MIB)
    gpupool.pause(1)
    gpupool.set_memory_limit(16 * MIB)
    other = gpupool.alloc(12 * MIB)
    with pytest.raises(gpupool.OutOfMemoryError):
        gpupool.resume(1)
    assert _stat("paused_bytes.all.current") == 8 * MIB
    gpupool.free(other)
    assert gpupool.resume(1) == 8 * MIB
    assert ctypes.string_at(p, 8 * MIB) == b"\x11" * (8 * MIB)
    gpupool.free(p)


def test_bad_tags_are_refused(pool):
    with pytest.raises(ValueError):
        gpupool.pause(-1)
    with pytest.raises(ValueError):
        gpupool.alloc(64, tag=2**64)
    with pytest.raises(TypeError):
        gpupool.resume(1.5)
    with pytest.raises(TypeError):
        gpupool.alloc(64, tag=b"bytes")
    assert _stat("allocated_bytes.all.current") == 0


def test_segment_mode_is_unsupported():
    gpupool.shutdown()
    gpupool.init("backend=sim,devices=1,capacity=64MiB,vmm=false,maint_ms=0")
    try:
        with pytest.raises(gpupool.Error) as e:
            gpupool.alloc(64, tag=1)
        assert e.value.status_name == "GPUPOOL_STATUS_UNSUPPORTED"
        with pytest.raises(gpupool.Error):
            gpupool.pause(1)
    finally:
        gpupool.shutdown()
