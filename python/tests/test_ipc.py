"""Sharing memory between processes on the simulator: a child Python
process receives the descriptors over a unix socket (socket.send_fds),
imports the block, reads this process's bytes and writes its own."""

import ctypes
import json
import os
import socket
import subprocess
import sys
import textwrap

import gpupool
import pytest

MIB = 1 << 20

CHILD = textwrap.dedent(
    """
    import ctypes, json, socket, sys
    import gpupool
    sock = socket.socket(fileno=int(sys.argv[1]))
    data, fds, _, _ = socket.recv_fds(sock, 65536, 64)
    meta = json.loads(data)
    gpupool.init("backend=sim,devices=1,capacity=64MiB,maint_ms=0")
    with gpupool.IpcHandle.from_meta(meta, fds) as h:
        q = gpupool.import_handle(h)
    size = meta["size"]
    ok = ctypes.string_at(q, size) == bytes([0x21]) * size
    ctypes.memset(q, 0x43, size)
    held = gpupool.memory_stats()["reserved_bytes.all.current"]
    gpupool.close_import(q)
    gpupool.shutdown()
    sock.sendall(json.dumps({"ok": ok, "held": held}).encode())
    """
)


def test_a_child_process_reads_and_writes_an_exported_block(pool):
    size = 5 * MIB + 99
    p = gpupool.alloc(size, device=1)
    ctypes.memset(p, 0x21, size)
    h = gpupool.export(p, device=1)
    assert h.size == size and h.chunk_bytes == 2 * MIB
    assert len(h.fds) == (h.offset + size + h.chunk_bytes - 1) // h.chunk_bytes
    parent, child = socket.socketpair()
    with parent, child:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(child.fileno())],
            pass_fds=[child.fileno()],
            env=os.environ.copy(),
        )
        child.close()
        socket.send_fds(parent, [json.dumps(h.meta()).encode()], h.fds)
        h.close()
        reply = json.loads(parent.recv(4096))
        assert proc.wait(timeout=60) == 0
    assert reply == {"ok": True, "held": 0}
    assert ctypes.string_at(p, size) == bytes([0x43]) * size
    gpupool.free(p, device=1)


def test_import_in_this_process_and_bad_input(pool):
    p = gpupool.alloc(3 * MIB, device=0)
    ctypes.memset(p, 0x0F, 3 * MIB)
    with gpupool.export(p, device=0) as h:
        q = gpupool.import_handle(h, device=1)
        assert ctypes.string_at(q, 3 * MIB) == b"\x0f" * (3 * MIB)
        bad = gpupool.IpcHandle(h.fds, h.fd_offsets, h.chunk_bytes, h.offset, 0)
        with pytest.raises(ValueError):
            gpupool.import_handle(bad, device=1)
        with pytest.raises(TypeError):
            gpupool.import_handle(h.meta())
    gpupool.close_import(q, device=1)
    with pytest.raises(ValueError):
        gpupool.close_import(q, device=1)
    with pytest.raises(ValueError):
        gpupool.export(p + 256, device=0)
    gpupool.free(p, device=0)
    with pytest.raises(ValueError):
        gpupool.export(p, device=0)
