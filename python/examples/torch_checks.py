#!/usr/bin/env python3
"""Checks, on a CUDA device, that what gpupool.torch's C++ shim wires into
PyTorch reaches gpupool, and prints one JSON report:

    {"skipped": false, "route": "shim", "private_pools": true, "passed": true,
     "checks": [{"name": "record_stream", "result": "pass", "seconds": 0.6,
                 "detail": {...}}, ...]}

Each check asserts; a failing one is reported ("fail" with its traceback)
and the rest still run; the exit status is 1 when any failed. Checks:
allocations reach gpupool; torch.cuda.memory_stats / max_memory_allocated /
reset_peak_memory_stats give gpupool's figures; Tensor.record_stream keeps
a block from another stream's reuse while that stream still runs;
torch.cuda.empty_cache gives cached memory back; the per-process memory
fraction becomes gpupool's limit and exceeding it raises
torch.OutOfMemoryError carrying gpupool's report (and calls gpupool.on_oom);
a request larger than the device is torch.OutOfMemoryError too; CUDA graph
capture into a private pool (and a second graph sharing it) replays
correctly; torch.cuda.MemPool + use_mem_pool route allocations to a pool;
gpupool.torch.patch_torch_stats. Without torch or a CUDA device it prints
{"skipped": true, "reason": ...} and exits 0.

    python3 python/examples/torch_checks.py [--out report.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MIB = 1 << 20


def skip(reason: str) -> None:
    print(json.dumps({"skipped": True, "reason": reason}))
    sys.exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="also write the JSON report to this file")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        skip("torch is not installed")
    if not torch.cuda.is_available():  # does not initialize PyTorch's allocator
        skip("no CUDA device")

    import gpupool
    import gpupool.torch as gt

    t0 = time.perf_counter()
    gt.install(verbose=True)
    install_s = time.perf_counter() - t0
    dev = torch.device("cuda", 0)
    checks = []

    def check(fn):
        start = time.perf_counter()
        entry = {"name": fn.__name__}
        try:
            detail = fn()
            entry["result"] = "skip" if isinstance(detail, dict) and detail.get("skip") else "pass"
            entry["detail"] = detail
        except BaseException as e:  # noqa: BLE001  (a report, not a crash)
            entry["result"] = "fail"
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-3000:]
        entry["seconds"] = round(time.perf_counter() - start, 3)
        checks.append(entry)
        print(f"{entry['result'].upper()} {entry['name']}", file=sys.stderr)
        return fn

    def gstats():
        return gpupool.memory_stats(0)

    @check
    def allocations_reach_gpupool():
        before = gstats()["requested_bytes.all.current"]
        x = torch.empty(8 * MIB, dtype=torch.uint8, device=dev)
        after = gstats()["requested_bytes.all.current"]
        assert after - before >= 8 * MIB, (before, after)
        x.fill_(3)
        assert int(x.sum().item()) == 3 * 8 * MIB
        del x
        torch.cuda.synchronize()
        return {"requested_delta": after - before}

    @check
    def memory_stats_are_gpupools():
        x = torch.empty(16 * MIB, dtype=torch.uint8, device=dev)
        t = torch.cuda.memory_stats(0)
        g = gstats()
        for key in ("allocated_bytes.all.current", "reserved_bytes.all.current",
                    "requested_bytes.all.current", "allocated_bytes.all.peak"):
            assert t[key] == g[key], (key, t[key], g[key])
        assert torch.cuda.memory_allocated(0) == g["allocated_bytes.all.current"]
        assert torch.cuda.max_memory_allocated(0) == g["allocated_bytes.all.peak"]
        assert torch.cuda.memory_reserved(0) == g["reserved_bytes.all.current"]
        del x
        torch.cuda.reset_peak_memory_stats(0)
        g = gstats()
        assert g["allocated_bytes.all.peak"] == g["allocated_bytes.all.current"], g
        assert torch.cuda.max_memory_allocated(0) == g["allocated_bytes.all.peak"]
        return {"allocated_peak_after_reset": g["allocated_bytes.all.peak"]}

    @check
    def record_stream():
        side = torch.cuda.Stream()
        n = 64 * MIB
        x = torch.empty(n, dtype=torch.uint8, device=dev)
        xp = x.data_ptr()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000_000)  # keeps the side stream busy (~0.5 s)
            x.fill_(1)
        x.record_stream(side)
        del x  # freed on the default stream, still in use on `side`
        y = torch.empty(n, dtype=torch.uint8, device=dev)
        reused_early = y.data_ptr() == xp
        side_busy = not side.query()
        torch.cuda.synchronize()
        assert not reused_early, "the block was handed out again while the recorded stream used it"
        del y
        return {"side_stream_still_busy_at_realloc": side_busy}

    @check
    def empty_cache():
        torch.cuda.synchronize()
        big = torch.empty(512 * MIB, dtype=torch.uint8, device=dev)
        del big
        torch.cuda.synchronize()
        r0 = gstats()["reserved_bytes.all.current"]
        torch.cuda.empty_cache()
        g = gstats()
        assert r0 - g["reserved_bytes.all.current"] >= 256 * MIB, (r0, g)
        return {"reserved_before": r0, "reserved_after": g["reserved_bytes.all.current"],
                "cached_after": g.get("cached_bytes.all.current")}

    @check
    def memory_fraction_and_out_of_memory():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.empty_cache()
        frac = 0.05
        torch.cuda.set_per_process_memory_fraction(frac, 0)
        got = None
        if hasattr(torch.cuda, "get_per_process_memory_fraction"):
            got = torch.cuda.get_per_process_memory_fraction(0)
            assert abs(got - frac) < 1e-9, got
        ooms = []
        gpupool.on_oom(lambda d, n: ooms.append((d, n)))
        message = None
        try:
            try:
                t = torch.empty(int(total * 0.1), dtype=torch.uint8, device=dev)
                del t
                raise AssertionError("no torch.OutOfMemoryError above the memory fraction")
            except torch.OutOfMemoryError as e:
                message = str(e)
            assert "gpupool" in message and "out of memory" in message.lower(), message
            assert ooms and ooms[0][0] == 0, ooms
            t = torch.empty(int(total * 0.02), dtype=torch.uint8, device=dev)  # within it
            del t
        finally:
            gpupool.on_oom(None)
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
        t = torch.empty(int(total * 0.1), dtype=torch.uint8, device=dev)  # limit lifted
        del t
        torch.cuda.empty_cache()
        return {"fraction_read_back": got, "oom_message": message[:400], "on_oom_calls": len(ooms)}

    @check
    def larger_than_the_device_is_out_of_memory():
        total = torch.cuda.get_device_properties(0).total_memory
        try:
            torch.empty(2 * total, dtype=torch.uint8, device=dev)
        except torch.OutOfMemoryError as e:
            return {"message": str(e)[:300]}
        raise AssertionError("no torch.OutOfMemoryError for twice the device")

    @check
    def graph_capture_private_pool():
        if not gt.has_private_pools():
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    pass
            except RuntimeError as e:
                assert "unavailable" in str(e), str(e)
                return {"skip": True, "reason": str(e)[:400]}
            raise AssertionError("graph capture without gpupool's pool functions did not raise")
        static_x = torch.randn(1 << 20, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                _ = static_x * 2 + 1
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_y = static_x * 2 + 1
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2, pool=g.pool()):  # a second graph sharing the pool
            static_z = static_y - 1
        for v in (1.0, 3.0):
            static_x.fill_(v)
            g.replay()
            g2.replay()
            torch.cuda.synchronize()
            assert bool(torch.all(static_y == v * 2 + 1)), v
            assert bool(torch.all(static_z == v * 2)), v
        del g2, static_z, g, static_y
        gc.collect()
        torch.cuda.synchronize()
        return {"replays": 2}

    @check
    def mempool_use_mem_pool():
        if not gt.has_private_pools():
            try:
                torch.cuda.MemPool()
            except RuntimeError as e:
                assert "unavailable" in str(e), str(e)
                return {"skip": True, "reason": str(e)[:400]}
            raise AssertionError("MemPool without gpupool's pool functions did not raise")
        pool = torch.cuda.MemPool()
        assert pool.use_count() == 1, pool.use_count()
        with torch.cuda.use_mem_pool(pool):
            t = torch.full((1 << 20,), 7.0, device=dev)
        assert pool.use_count() == 1, pool.use_count()
        outside = torch.ones(1 << 20, device=dev)
        assert float(t.sum().item()) == 7.0 * (1 << 20)
        assert float(outside.sum().item()) == float(1 << 20)
        del t, outside, pool
        gc.collect()
        torch.cuda.synchronize()
        return {"pool_id_ok": True}

    @check
    def patch_torch_stats():
        gt.patch_torch_stats()
        try:
            st = torch.cuda.memory_stats(0)
            assert "cached_bytes.all.current" in st, sorted(st)  # gpupool's own key
            assert torch.cuda.max_memory_allocated(0) == gstats()["allocated_bytes.all.peak"]
        finally:
            gt.unpatch_torch_stats()
        assert "cached_bytes.all.current" not in torch.cuda.memory_stats(0)
        return {}

    failed = [c["name"] for c in checks if c["result"] == "fail"]
    report = {
        "skipped": False,
        "route": gt.route(),
        "private_pools": gt.has_private_pools(),
        "install_seconds": round(install_s, 2),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev),
        "passed": not failed,
        "failed": failed,
        "checks": checks,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
