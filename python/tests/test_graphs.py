"""Private (CUDA graph) pools through the Python package on the simulator:
routing a stream to a pool, reuse inside the pool only, release, and bad
input that changes nothing."""

import ctypes

import gpupool
import pytest

MIB = 1 << 20


def _allocated(device=0):
    return gpupool.memory_stats(device)["allocated_bytes.all.current"]


def test_routed_allocations_stay_in_their_pool_until_release(pool):
    s = gpupool.stream_create(0)
    gpupool.begin_allocate_to_pool(11, stream=s)
    a = gpupool.alloc(MIB, stream=s)
    ctypes.memset(a, 0x5A, MIB)
    assert ctypes.string_at(a, MIB) == b"\x5a" * MIB
    gpupool.free(a, stream=s)
    # Reused inside the pool, on its stream.
    b = gpupool.alloc(MIB, stream=s)
    assert b == a
    gpupool.end_allocate_to_pool(11)
    # Not routed any more: the pool's free memory is not handed out.
    gpupool.free(b, stream=s)
    c = gpupool.alloc(MIB, stream=s)
    assert not (a <= c < a + 2 * MIB), "private memory handed outside its pool"
    d = gpupool.alloc_in_pool(4096, 11, stream=s)
    assert a <= d < a + 2 * MIB, "explicit allocation in the pool"
    gpupool.release_pool(11)
    with pytest.raises(ValueError, match="released already"):
        gpupool.release_pool(11)
    gpupool.free(d, stream=s)
    with pytest.raises(ValueError, match="unknown private pool"):
        gpupool.release_pool(11)
    gpupool.free(c, stream=s)
    gpupool.stream_destroy(s)
    assert _allocated() == 0


def test_graph_pool_bad_input_changes_nothing(pool):
    before = gpupool.memory_stats(0)
    with pytest.raises(ValueError):
        gpupool.begin_allocate_to_pool(0)
    with pytest.raises(ValueError, match="unknown private pool"):
        gpupool.end_allocate_to_pool(12)
    with pytest.raises(ValueError, match="unknown private pool"):
        gpupool.release_pool(12)
    with pytest.raises(ValueError):
        gpupool.release_pool(12, device=7)
    with pytest.raises(ValueError):
        gpupool.alloc_in_pool(0, 12)
    with pytest.raises(TypeError):
        gpupool.begin_allocate_to_pool("x")
    assert gpupool.memory_stats(0) == before
