#!/usr/bin/env python3
"""CuPy with gpupool as its allocator (gpupool.cupy), on a CUDA device:
arrays come from gpupool, compute correctly on CuPy's current stream and on
a second stream, go back to gpupool when CuPy drops them, and a memory limit
raises gpupool.OutOfMemoryError (a MemoryError). Prints one JSON report;
exit status 1 when a check failed. Without CuPy or a CUDA device it prints
{"skipped": true, "reason": ...} and exits 0.

    python3 python/examples/cupy_check.py [--out report.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    try:
        import cupy
    except ImportError:
        print(json.dumps({"skipped": True, "reason": "cupy is not installed"}))
        return
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"skipped": True, "reason": f"no CUDA device ({e})"}))
        return

    import gpupool
    import gpupool.cupy as gc_

    report = {"skipped": False, "cupy": cupy.__version__}
    try:
        gc_.install()
        base = gpupool.memory_stats(0)["requested_bytes.all.current"]
        n = 4 * MIB
        a = cupy.arange(n, dtype=cupy.int64)
        st = gpupool.memory_stats(0)
        assert st["requested_bytes.all.current"] - base >= 8 * n, st
        assert int((a * 2).sum()) == n * (n - 1)
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            b = cupy.ones(MIB, dtype=cupy.float32) * 3
        s.synchronize()
        assert float(b.sum()) == 3.0 * MIB
        del a, b
        gc.collect()
        cupy.cuda.Device().synchronize()
        after = gpupool.memory_stats(0)["requested_bytes.all.current"]
        assert after <= base, (base, after)
        gpupool.set_memory_limit(256 * MIB, device=0)
        try:
            cupy.empty(512 * MIB, dtype=cupy.uint8)
            raise AssertionError("no MemoryError above the limit")
        except MemoryError as e:
            report["oom_message"] = str(e)[:300]
        finally:
            gpupool.set_memory_limit(None, device=0)
        report["peak_allocated_bytes"] = gpupool.memory_stats(0)["allocated_bytes.all.peak"]
        gc_.uninstall()
        report["passed"] = True
    except BaseException as e:  # noqa: BLE001
        report["passed"] = False
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()[-3000:]
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
