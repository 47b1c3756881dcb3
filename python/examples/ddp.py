#!/usr/bin/env python3
"""DistributedDataParallel with gpupool as every rank's CUDA allocator:

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 \\
        python/examples/ddp.py --steps 30 --out ddp.json

(``torchrun`` is the same command.) Each rank installs gpupool (the C++
shim; ``--no-shim`` for the Python route) before CUDA starts, trains a small
MLP on its own data under DDP, and checks that the ranks' parameters are
identical at the end (DDP's all-reduce kept them in step). Rank 0 prints one
JSON report (and writes it to ``--out``): per rank the device, the backend,
the final loss and gpupool's peaks; ``passed``. The exit status is 1 when
the parameters differ.

Devices and backend: rank r uses device ``r % torch.cuda.device_count()``.
With a GPU per rank the backend is NCCL; with fewer GPUs than ranks (two
ranks on the GPU check's single device) it is Gloo, since NCCL refuses two
ranks on one device ("Duplicate GPU detected"). Gloo all-reduces CUDA
tensors through host copies on side streams, which exercises
``record_stream`` through gpupool. ``--backend`` overrides the choice.
``--standalone`` needs no network: the rendezvous is on localhost. Without
torch or a CUDA device it prints {"skipped": true, ...} and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _or_error(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    ap.add_argument("--no-shim", action="store_true", help="the Python CUDAPluggableAllocator route")
    ap.add_argument("--out", help="rank 0 writes the JSON report here too")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print(json.dumps({"skipped": True, "reason": "torch is not installed"}))
        return
    if not torch.cuda.is_available():  # does not initialize PyTorch's allocator
        print(json.dumps({"skipped": True, "reason": "no CUDA device"}))
        return

    import gpupool
    import gpupool.torch as gt

    gt.install(shim=not args.no_shim)  # before the first CUDA allocation
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    ngpu = torch.cuda.device_count()
    device_index = local % ngpu
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if ngpu >= int(os.environ.get("LOCAL_WORLD_SIZE", world)) else "gloo"
    torch.cuda.set_device(device_index)
    dev = torch.device("cuda", device_index)
    dist.init_process_group(backend)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(dev)
    ddp = DDP(model, device_ids=[device_index] if backend == "nccl" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)  # each rank its own data
    loss = torch.zeros((), device=dev)
    for _ in range(args.steps):
        x = torch.randn(64, 256, generator=gen).to(dev)
        loss = (ddp(x) - x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()

    # The ranks' parameters must be identical: compare with rank 0's.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    max_diff = float((flat - ref).abs().max().item())
    st = gpupool.memory_stats(device_index)
    mine = {
        "rank": rank,
        "device": device_index,
        "backend": backend,
        "route": gt.route(),
        "final_loss": float(loss.item()),
        "max_param_diff_vs_rank0": max_diff,
        "peak_allocated_bytes": st["allocated_bytes.all.peak"],
        "peak_reserved_bytes": st["reserved_bytes.all.peak"],
        # PyTorch's own call: answered by the shim, refused by the Python route.
        "torch_max_memory_allocated": _or_error(lambda: torch.cuda.max_memory_allocated(dev)),
    }
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    dist.destroy_process_group()
    ok = all(r["max_param_diff_vs_rank0"] == 0.0 for r in ranks)
    if rank == 0:
        report = {"skipped": False, "world_size": world, "steps": args.steps,
                  "passed": ok, "ranks": ranks}
        text = json.dumps(report, indent=1)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
