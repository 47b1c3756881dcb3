#!/usr/bin/env python3
"""Trains a small transformer under several CUDA allocators, each in its own
process, and prints one JSON report:

    {"skipped": false, "steps": 300, "runs": [
      {"allocator": "gpupool", "step_ms": ..., "peak_reserved_bytes": ...,
       "peak_allocated_bytes": ..., "peak_requested_bytes": ..., ...},
      {"allocator": "pytorch", ...}, {"allocator": "pytorch-expandable", ...}],
     "vs_pytorch": {"gpupool": {"step_time_ratio": ..., "peak_allocated_ratio": ...,
                                "peak_reserved_ratio": ..., ...}, ...}}

Allocators (``--allocators``, a comma list; default
gpupool,pytorch,pytorch-expandable):

  gpupool             gpupool.torch.install(): the C++ shim
  gpupool-stitch      the shim with stitch_share=0: stitching whenever that
                      avoids growth (install()'s default allows it 1% of
                      wall time)
  gpupool-step        the shim, with gpupool.mark_step() after each
                      optimizer step (the learned step plan)
  gpupool-python      gpupool.torch.install(shim=False): PyTorch's Python
                      CUDAPluggableAllocator over gpupool_torch_malloc/free
  pytorch             PyTorch's caching allocator, default settings
  pytorch-expandable  the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

Peaks compare like with like: every run reports the same three statistics
under the same keys, in PyTorch's meanings (gpupool keeps them so):
peak_allocated_bytes is ``allocated_bytes.all.peak`` (rounded sizes of live
blocks), peak_requested_bytes ``requested_bytes.all.peak`` (sizes asked
for), peak_reserved_bytes ``reserved_bytes.all.peak`` (device memory held);
from gpupool.memory_stats() for gpupool's runs, from
torch.cuda.memory_stats() for PyTorch's. ``vs_pytorch`` divides each run's
figures by the default PyTorch run's. Without torch or a CUDA device it
prints {"skipped": true, "reason": ...} and exits 0.

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


ALLOCATORS = ("gpupool", "gpupool-stitch", "gpupool-step", "gpupool-python", "pytorch",
              "pytorch-expandable")


def child(args) -> dict:
    if args.allocator.startswith("gpupool"):
        import gpupool.torch

        # gpupool-stitch: no time share, stitching whenever that avoids growth.
        conf = "stitch_share=0" if args.allocator == "gpupool-stitch" else None
        gpupool.torch.install(conf=conf, shim=args.allocator != "gpupool-python")
    elif args.allocator == "pytorch-expandable":
        # Read when PyTorch's allocator starts (the first CUDA allocation).
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
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
    host_times = []
    loss_val = float("nan")
    gp_stats = None
    if args.allocator.startswith("gpupool"):
        import gpupool

        gp_stats = gpupool.stats
    mark_step = args.allocator == "gpupool-step"
    calls_before = calls_late = None
    late = max(args.warmup, args.steps * 3 // 4)

    def train_step(x):
        out = model(x[:, :-1])
        loss = loss_fn(out.reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if mark_step:
            gpupool.mark_step()
        return loss

    for step in range(args.steps):
        if step == args.warmup and gp_stats:
            calls_before = gp_stats(0)["driver_calls"]
        if step == late and gp_stats:
            calls_late = gp_stats(0)["driver_calls"]
        # Variable batch shapes exercise the allocator like real data does.
        b = batch if step % 3 else batch // 2
        x = torch.randint(0, vocab, (b, seq + 1), generator=gen).to(dev, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train_step(x)
        t_host = time.perf_counter()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            host_times.append(t_host - t0)
        loss_val = loss.item()
    profile = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile):
                train_step(x)
            torch.cuda.synchronize()
        ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        profile = [{"op": e.key, "calls_per_step": e.count / args.profile,
                    "self_cpu_us_per_step": e.self_cpu_time_total / args.profile}
                   for e in ev]
    times.sort()
    report = {
        "allocator": args.allocator,
        "steps": args.steps,
        "step_ms": 1e3 * sum(times) / max(len(times), 1),
        "step_ms_p50": 1e3 * times[len(times) // 2] if times else None,
        # Host time to enqueue a step (before its synchronize): where an
        # allocator's own cost shows when the GPU is not the bottleneck.
        "host_ms": 1e3 * sum(host_times) / max(len(host_times), 1),
        "final_loss": loss_val,
        "device": torch.cuda.get_device_name(dev),
    }
    if profile is not None:
        report["profile"] = profile
    if args.allocator.startswith("gpupool"):
        import gpupool

        flat = gpupool.memory_stats(0)
        st = gpupool.stats(0)
        after = st["driver_calls"]
        # Driver calls per timed step, by name: a pool in steady state
        # makes none.
        def per_step(before, steps):
            before = before or {}
            return {k: (v - before.get(k, 0)) / max(steps, 1)
                    for k, v in sorted(after.items()) if v - before.get(k, 0)}

        report["driver_calls_per_step"] = per_step(calls_before, len(times))
        # The last quarter alone: whether the pool has settled.
        report["driver_calls_per_step_last_quarter"] = per_step(calls_late, args.steps - late)
        report.update(
            num_allocs=st["num_allocs"],
            num_device_allocs=st["num_device_allocs"],
            num_ooms=st["num_ooms"],
            host_syncs=st["host_syncs"],
        )
        if args.snapshot:
            gpupool.dump_snapshot(args.snapshot)
        if args.allocator != "gpupool-python":
            # Through the shim PyTorch's own call reports gpupool's figure.
            report["torch_max_memory_allocated"] = torch.cuda.max_memory_allocated(dev)
            report["torch_agrees"] = (
                report["torch_max_memory_allocated"] == flat["allocated_bytes.all.peak"]
            )
    else:
        flat = torch.cuda.memory_stats(dev)
        report["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    report.update(
        peak_reserved_bytes=flat["reserved_bytes.all.peak"],
        peak_allocated_bytes=flat["allocated_bytes.all.peak"],
        peak_requested_bytes=flat.get("requested_bytes.all.peak"),
        num_alloc_retries=flat.get("num_alloc_retries"),
        num_device_alloc=flat.get("num_device_alloc"),
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
    ap.add_argument("--allocators", default="gpupool,pytorch,pytorch-expandable",
                    help="comma list of " + ", ".join(ALLOCATORS) + " (each its own process)")
    ap.add_argument("--allocator", choices=ALLOCATORS + ("both",),
                    help="run this one in this process (both: gpupool,pytorch, as before)")
    ap.add_argument("--snapshot", help="gpupool's run: write a memory_viz pickle here")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then profile N more steps (torch.profiler, host side): the "
                    "ops with the most self CPU time go in each run's report")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the allocators this many times, alternated (the machine "
                    "drifts: compare within a round); ratios are the rounds' medians")
    ap.add_argument("--out", help="also write the JSON report to this file")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        skip("torch is not installed")
    if not torch.cuda.is_available():
        skip("no CUDA device")

    if args.allocator == "both":
        args.allocators, args.allocator = "gpupool,pytorch", None
    if args.allocator:
        print(json.dumps(child(args)))
        return
    which_all = [a.strip() for a in args.allocators.split(",") if a.strip()]
    for a in which_all:
        if a not in ALLOCATORS:
            ap.error(f"unknown allocator {a!r}: expected {', '.join(ALLOCATORS)}")

    runs = []
    for rnd in range(args.rounds):
        for which in which_all:
            cmd = [sys.executable, __file__, "--allocator", which]
            for k in ("steps", "warmup", "batch", "seq", "layers", "profile"):
                cmd += [f"--{k}", str(getattr(args, k))]
            cmd += ["--d-model", str(args.d_model)]
            if which == "gpupool" and args.snapshot:
                cmd += ["--snapshot", args.snapshot]
            env = dict(os.environ)
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # each run its own allocator settings
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                               env=env)
            if p.returncode != 0:
                runs.append({"allocator": which, "round": rnd, "error": p.stderr[-4000:]})
                continue
            runs.append(dict(json.loads(p.stdout.strip().splitlines()[-1]), round=rnd))
    report = {"skipped": False, "steps": args.steps, "rounds": args.rounds, "runs": runs}
    by_round = {}
    for r in runs:
        if "error" not in r:
            by_round.setdefault(r["round"], {})[r["allocator"]] = r

    def ratio(r, base, key):
        return r[key] / base[key] if r.get(key) is not None and base.get(key) else None

    def median(vals):
        vals = sorted(v for v in vals if v is not None)
        return vals[len(vals) // 2] if vals else None

    vs = {}
    for name in which_all:
        pairs = [(rd[name], rd["pytorch"]) for rd in by_round.values()
                 if name != "pytorch" and name in rd and "pytorch" in rd]
        if pairs:
            vs[name] = {
                f"{what}_ratio": median(ratio(r, b, key) for r, b in pairs)
                for what, key in (("step_time", "step_ms"), ("host_time", "host_ms"),
                                  ("peak_allocated", "peak_allocated_bytes"),
                                  ("peak_requested", "peak_requested_bytes"),
                                  ("peak_reserved", "peak_reserved_bytes"))
            }
            vs[name]["step_time_ratios"] = [ratio(r, b, "step_ms") for r, b in pairs]
    if vs:
        report["vs_pytorch"] = vs
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    sys.exit(0 if all("error" not in r for r in runs) else 1)


if __name__ == "__main__":
    main()
