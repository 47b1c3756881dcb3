#!/usr/bin/env python3
"""Host cost of allocation+free pairs through PyTorch (``torch.empty`` then
its release), per allocator, each in its own process, printed as one JSON
report: nanoseconds per pair at fixed sizes, and per replacement in a
mixed pattern (64 tensors held, one replaced at a time, sizes 4 KiB to
24 MiB). What a framework user pays per tensor, allocator and PyTorch's
own dispatch together; compare allocators within one run.

    python3 python/examples/torch_pairs.py [--allocators gpupool,pytorch,pytorch-expandable]

Without torch or a CUDA device it prints {"skipped": true, ...} and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = (512, 1 << 16, 1 << 20, 16 << 20, 256 << 20)


def child(alloc: str) -> dict:
    if alloc == "gpupool":
        import gpupool.torch

        gpupool.torch.install()
    elif alloc == "pytorch-expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    dev = torch.device("cuda", 0)
    u8 = torch.uint8
    torch.empty(1, dtype=u8, device=dev)
    pairs = {}
    for size in SIZES:
        n = 20000 if size <= 1 << 20 else 5000
        for _ in range(200):
            torch.empty(size, dtype=u8, device=dev)
        t = time.perf_counter()
        for _ in range(n):
            torch.empty(size, dtype=u8, device=dev)
        pairs[str(size)] = 1e9 * (time.perf_counter() - t) / n
    rng = random.Random(1)
    sizes = [rng.choice((4 << 10, 256 << 10, 1 << 20, 4 << 20, 24 << 20)) for _ in range(4096)]
    held = [None] * 64
    for i, sz in enumerate(sizes):
        held[i % 64] = torch.empty(sz, dtype=u8, device=dev)
    reps = 5
    t = time.perf_counter()
    for _ in range(reps):
        for i, sz in enumerate(sizes):
            held[i % 64] = torch.empty(sz, dtype=u8, device=dev)
    mixed = 1e9 * (time.perf_counter() - t) / (reps * len(sizes))
    torch.cuda.synchronize()
    report = {"allocator": alloc, "pair_ns": pairs, "mixed_replace_ns": mixed}
    if alloc == "gpupool":
        import gpupool

        report["driver_calls"] = gpupool.stats(0)["driver_calls"]
        report["conf"] = os.environ.get("GPUPOOL_CONF", "")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--allocators", default="gpupool,pytorch,pytorch-expandable")
    ap.add_argument("--allocator", help="run this one in this process")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print(json.dumps({"skipped": True, "reason": "torch is not installed"}))
        return
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": True, "reason": "no CUDA device"}))
        return
    if args.allocator:
        print(json.dumps(child(args.allocator)))
        return
    runs = []
    for a in args.allocators.split(","):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        p = subprocess.run([sys.executable, __file__, "--allocator", a],
                           capture_output=True, text=True, timeout=300, env=env)
        if p.returncode != 0:
            runs.append({"allocator": a, "error": p.stderr[-3000:]})
        else:
            runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    print(json.dumps({"skipped": False, "runs": runs}, indent=1))
    sys.exit(0 if all("error" not in r for r in runs) else 1)


if __name__ == "__main__":
    main()
