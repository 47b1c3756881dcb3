#!/usr/bin/env python3
"""Trains a small transformer with gpupool and with PyTorch's default
allocator, each in its own process, and prints one JSON report:

    {"skipped": false, "steps": 300, "runs": [
      {"allocator": "gpupool", "step_ms": ..., "peak_reserved_bytes": ...,
       "peak_allocated_bytes": ..., "final_loss": ..., ...},
      {"allocator": "pytorch", ...}]}

Peaks compare like with like, in PyTorch's meanings on both sides:
peak_allocated_bytes is the peak of the rounded sizes of live blocks,
peak_requested_bytes that of the sizes asked for, peak_reserved_bytes that of
device memory held; for gpupool from gpupool.memory_stats(), for PyTorch from
torch.cuda.memory_stats(). Without torch or a CUDA device it prints
{"skipped": true, "reason": ...} and exits 0.

    cargo build --release
    python3 python/examples/train.py --steps 300 [--out report.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def skip(reason: str) -> None:
    print(json.dumps({"skipped": True, "reason": reason}))
    sys.exit(0)


def child(args) -> dict:
    if args.allocator == "gpupool":
        import gpupool.torch

        gpupool.torch.install(os.environ.get("GPUPOOL_CONF", "backend=cuda"))
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    vocab, d_model, seq, batch = 1000, args.d_model, args.seq, args.batch

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d_model)
            layer = nn.TransformerEncoderLayer(
                d_model, nhead=8, dim_feedforward=4 * d_model, batch_first=True
            )
            self.enc = nn.TransformerEncoder(layer, num_layers=args.layers)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, x):
            return self.head(self.enc(self.emb(x)))

    model = Model().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator(device="cpu").manual_seed(1)
    times = []
    loss_val = float("nan")
    for step in range(args.steps):
        # Variable batch shapes exercise the allocator like real data does.
        b = batch if step % 3 else batch // 2
        x = torch.randint(0, vocab, (b, seq + 1), generator=gen).to(dev, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(x[:, :-1])
        loss = loss_fn(out.reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        loss_val = loss.item()
    times.sort()
    report = {
        "allocator": args.allocator,
        "steps": args.steps,
        "step_ms": 1e3 * sum(times) / max(len(times), 1),
        "step_ms_p50": 1e3 * times[len(times) // 2] if times else None,
        "final_loss": loss_val,
        "device": torch.cuda.get_device_name(dev),
    }
    if args.allocator == "gpupool":
        import gpupool.torch as gpupool_torch

        st = gpupool_torch.stats(0)
        report.update(
            peak_reserved_bytes=st["reserved_bytes"]["peak"],
            peak_allocated_bytes=st["allocated_bytes"]["peak"],
            peak_requested_bytes=st["requested_bytes"]["peak"],
            num_allocs=st["num_allocs"],
            num_device_allocs=st["num_device_allocs"],
            num_ooms=st["num_ooms"],
            host_syncs=st["host_syncs"],
        )
        if args.snapshot:
            gpupool_torch.dump_snapshot(args.snapshot)
    else:
        report.update(
            peak_reserved_bytes=torch.cuda.max_memory_reserved(dev),
            peak_allocated_bytes=torch.cuda.max_memory_allocated(dev),
            peak_requested_bytes=torch.cuda.memory_stats(dev).get("requested_bytes.all.peak"),
        )
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--allocator", choices=["gpupool", "pytorch", "both"], default="both")
    ap.add_argument("--snapshot", help="gpupool run: write a memory_viz pickle here")
    ap.add_argument("--out", help="also write the JSON report to this file")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        skip("torch is not installed")
    if not torch.cuda.is_available():
        skip("no CUDA device")

    if args.allocator != "both":
        print(json.dumps(child(args)))
        return

    runs = []
    for which in ("gpupool", "pytorch"):
        cmd = [sys.executable, __file__, "--allocator", which]
        for k in ("steps", "warmup", "batch", "seq", "layers"):
            cmd += [f"--{k}", str(getattr(args, k))]
        cmd += ["--d-model", str(args.d_model)]
        if which == "gpupool" and args.snapshot:
            cmd += ["--snapshot", args.snapshot]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if p.returncode != 0:
            runs.append({"allocator": which, "error": p.stderr[-4000:]})
            continue
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    report = {"skipped": False, "steps": args.steps, "runs": runs}
    ok = [r for r in runs if "error" not in r]
    if len(ok) == 2:
        g, t = ok
        report["gpupool_vs_pytorch"] = {
            "step_time_ratio": g["step_ms"] / t["step_ms"],
            "peak_reserved_ratio": g["peak_reserved_bytes"] / max(t["peak_reserved_bytes"], 1),
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    sys.exit(0 if len(ok) == 2 else 1)


if __name__ == "__main__":
    main()
