#!/usr/bin/env bash
# The GPU check, in two halves:
#
#   bash scripts/gpu-check.sh build   # here (cargo, no GPU): builds release
#                                     # test binaries, libgpupool.so and the
#                                     # CLI (tools/) into gpu-bundle/
#   bash scripts/gpu-check.sh run     # on the GPU machine (no cargo): runs them
#
# The device tool call that runs it (gpu-bundle/ is git-ignored, so carry it):
#   run(command="bash scripts/gpu-check.sh run", carry=["gpu-bundle"], timeout_s=480)
#
# `run` executes, with CUDA required (GPUPOOL_REQUIRE_CUDA=1, so a missing
# driver fails instead of skipping), each step under its own time limit and
# all of them under a 7-minute budget (steps past it are reported "skipped:
# time budget", never silently dropped):
#   0. libraries: NVRTC and NCCL are looked for where the Python wheels put
#      them (site-packages/nvidia/*/lib, found with python3's `site`), given
#      to gpupool as GPUPOOL_LIB_DIRS (its own search, not LD_LIBRARY_PATH,
#      so the check exercises what users get); the files found are listed;
#   1. the backend conformance suite against CudaBackend (and the simulator);
#   2. the compaction kernel check (NVRTC compile + moves vs sequential memmove);
#   3. the backend's first-contact checks (tests/cuda_backend.rs): a caller's
#      own current context (none, its own context, device 0's primary one
#      while device 1 is used where there are two GPUs) survives allocations
#      and frees; host copies land before a non-blocking stream's next move;
#      the kernel loads as a cubin (the PTX fallback is tried and reported);
#      NCCL (libnccl.so.2) loads and all-reduces;
#   4. `gpupool info` (with the loaded driver/NVRTC files in its log) and a
#      demo run on the real device;
#   5. GPU micro-benchmarks (`gpupool bench --gpu`): pool alloc/free pairs vs
#      cuMemAlloc and cuMemAllocAsync, compaction kernel vs cuMemcpyDtoD,
#      backing 1, 8 and 32 granules as one chunk vs a chunk per granule;
#   6. PyTorch through gpupool's C++ shim (gpupool.torch.install()):
#      torch_shim_build builds it against the machine's torch (CUDA headers
#      for torch's CUDA version come from gpu-bundle/cuda-include, fetched by
#      `build`; GPUPOOL_TORCH_SHIM_DIR keeps the build for the next steps);
#      torch_checks (python/examples/torch_checks.py) asserts record_stream,
#      empty_cache, the memory fraction, torch.OutOfMemoryError with
#      gpupool's report, torch.cuda.memory_stats, CUDA graph capture and
#      torch.cuda.MemPool private pools (reported as skipped, with the
#      reason, when the library lacks the pool functions);
#   7. torch: python/examples/train.py, a small transformer trained with
#      PyTorch's allocator, gpupool (shim; and with stitch_share=0) and
#      PyTorch's expandable_segments:True, three rounds alternated,
#      comparing the same peaks (allocated, requested, reserved, in
#      PyTorch's meanings), step times and driver calls per step;
#   8. ddp: python/examples/ddp.py, two ranks under torch.distributed.run
#      --standalone with gpupool as each rank's allocator (both on device 0,
#      so Gloo: NCCL refuses two ranks on one GPU);
#   9. cupy: python/examples/cupy_check.py, gpupool.cupy (skips, passing,
#      where CuPy is not installed);
#  10. torch_pairs: python/examples/torch_pairs.py, the host cost of a
#      torch.empty + release pair under each allocator;
# and writes logs, summary.txt and gpu-check.json (every step's pass/fail,
# seconds, test counts, the libraries loaded and each step's figures) to
# gpu-out/, and the summary, the JSON and a tarball of gpu-out/ to $OUT.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bundle="$repo/gpu-bundle"
mode=${1:-}

build() {
    set -e
    cd "$repo"
    rm -rf "$bundle"
    mkdir -p "$bundle"
    # Test binaries (the library's): cargo prints their paths as JSON artifacts.
    cargo test -p gpupool --release --no-run --message-format=json --test conformance \
        --test kernel_nvrtc --test cuda_backend \
        | python3 -c '
import json, sys, shutil, os
out = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = m["target"]["name"]
        shutil.copy(m["executable"], os.path.join(out, name))
        print("bundled test", name)
' "$bundle"
    # The C ABI's shared library (the library crate) and the CLI (the tools crate).
    cargo build --release -p gpupool --lib
    cargo build --release -p gpupool-tools --bin gpupool
    cp target/release/gpupool target/release/libgpupool.so "$bundle/"
    strip "$bundle"/* 2>/dev/null || true
    # CUDA's runtime headers, for building the torch shim on a machine
    # without a toolkit (the GPU machine has no network): CUDA 12 and 13,
    # picked at run time by torch.version.cuda.
    bash scripts/fetch-cuda-headers.sh 12.8 "$bundle/cuda-include/12"
    bash scripts/fetch-cuda-headers.sh 13.0 "$bundle/cuda-include/13"
    du -sh "$bundle"
}

run() {
    # Logs go to gpu-out/ (git-ignored); where the device tool's $OUT is
    # set, three files go back through it (it returns at most eight):
    # summary.txt, gpu-check.json and gpu-out.tgz with everything.
    out=$repo/gpu-out
    rm -rf "$out"
    mkdir -p "$out" "$out/reports"
    cd "$repo"
    export GPUPOOL_REQUIRE_CUDA=1 RUST_BACKTRACE=1 GPUPOOL_REPORT_DIR="$out/reports"
    # NVRTC from the machine's CUDA toolkit, if the loader does not find it.
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
    # Where the Python wheels (PyTorch's, CuPy's, NCCL's) put libnvrtc and
    # libnccl: site-packages/nvidia/*/lib. Handed to gpupool's own search.
    wheel_dirs=$(python3 - <<'PY' 2>/dev/null
import glob, os, site, sys
roots = []
try:
    roots += site.getsitepackages()
except Exception:
    pass
try:
    roots.append(site.getusersitepackages())
except Exception:
    pass
roots += [p for p in sys.path if p]
seen = []
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        d = os.path.realpath(d)
        if d not in seen:
            seen.append(d)
print(":".join(seen))
PY
)
    export GPUPOOL_LIB_DIRS="$wheel_dirs"
    summary="$out/summary.txt"
    steps="$out/steps.tsv"
    : > "$summary"
    : > "$steps"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$summary"
    {
        echo "GPUPOOL_LIB_DIRS=$GPUPOOL_LIB_DIRS"
        echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
        IFS=: read -r -a dirs <<< "$GPUPOOL_LIB_DIRS"
        for d in "${dirs[@]}" /usr/local/cuda/lib64; do
            [ -d "$d" ] && ls -1 "$d" | grep -E '^lib(nvrtc|nccl)' | sed "s|^|$d/|"
        done
    } > "$out/libraries.log" 2>&1
    cat "$out/libraries.log" | tee -a "$summary"
    status=0
    budget=420
    # check NAME LIMIT_S CMD...: runs CMD (stdout and stderr to NAME.log)
    # under `timeout LIMIT_S`, unless the budget is spent.
    check() {
        local name=$1 limit=$2; shift 2
        local start=$SECONDS rc
        if [ $((SECONDS + 20)) -gt "$budget" ]; then
            echo "SKIP $name: time budget" | tee -a "$summary"
            printf '%s\tskipped\t0\t%s\n' "$name" "time budget" >> "$steps"
            status=1
            return
        fi
        timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
        rc=$?
        if [ $rc -eq 0 ]; then
            echo "PASS $name ($((SECONDS - start)) s)" | tee -a "$summary"
            printf '%s\tpass\t%s\t\n' "$name" "$((SECONDS - start))" >> "$steps"
        else
            echo "FAIL $name ($((SECONDS - start)) s, rc $rc): see $name.log" | tee -a "$summary"
            printf '%s\tfail\t%s\trc %s\n' "$name" "$((SECONDS - start))" "$rc" >> "$steps"
            tail -n 30 "$out/$name.log"
            status=1
        fi
    }
    # check_json NAME LIMIT_S CMD...: as check, stdout to NAME.json.
    check_json() {
        local name=$1 limit=$2; shift 2
        check "$name" "$limit" sh -c '"$@" > "$0"' "$out/$name.json" "$@"
    }
    check conformance 120 "$bundle/conformance" --test-threads=1
    GPUPOOL_REQUIRE_NVRTC=1 check kernel 120 "$bundle/kernel_nvrtc" --test-threads=1
    GPUPOOL_REQUIRE_NVRTC=1 GPUPOOL_REQUIRE_NCCL=1 \
        check cuda_backend 120 "$bundle/cuda_backend" --test-threads=1 --nocapture
    GPUPOOL_LOG=gpupool=info check_json info 60 "$bundle/gpupool" info --backend cuda --json
    GPUPOOL_LOG=gpupool=info check_json demo 150 "$bundle/gpupool" demo --backend cuda --json
    check_json bench_gpu 150 "$bundle/gpupool" bench --gpu --json
    # PyTorch through the shim: CUDA headers matching torch's CUDA, one
    # build shared by every process below.
    torch_cuda=$(python3 -c 'import torch; print((torch.version.cuda or "").split(".")[0])' 2>/dev/null || true)
    if [ -n "$torch_cuda" ] && [ -d "$bundle/cuda-include/$torch_cuda" ]; then
        GPUPOOL_CUDA_INCLUDE=$(ls -d "$bundle/cuda-include/$torch_cuda"/nvidia/*/include | paste -sd:)
        export GPUPOOL_CUDA_INCLUDE
    fi
    export GPUPOOL_TORCH_SHIM_DIR="${TMPDIR:-/tmp}/gpupool-torch-shim.$$"
    export GPUPOOL_LIB="$bundle/libgpupool.so"
    echo "torch CUDA ${torch_cuda:-none}; GPUPOOL_CUDA_INCLUDE=${GPUPOOL_CUDA_INCLUDE:-}" | tee -a "$summary"
    USE_INSTALLED_TORCH=1 check torch_shim_build 120 bash scripts/torch-shim-check.sh
    check_json torch_checks 120 python3 python/examples/torch_checks.py
    check torch 240 python3 python/examples/train.py --steps 150 --rounds 3 \
        --allocators pytorch,gpupool,gpupool-stitch,pytorch-expandable --out "$out/torch.json"
    check ddp 120 python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
        python/examples/ddp.py --steps 30 --out "$out/ddp.json"
    check_json cupy 60 python3 python/examples/cupy_check.py
    check_json torch_pairs 90 python3 python/examples/torch_pairs.py
    unset GPUPOOL_LIB
    rm -rf "$GPUPOOL_TORCH_SHIM_DIR"
    grep -h "test result" "$out"/*.log | tee -a "$summary"
    # The JSON summary: steps, test counts, libraries and figures.
    python3 - "$out" <<'PY' || status=1
import glob, json, os, re, subprocess, sys, time
out = sys.argv[1]
def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as e:
        return {"unreadable": str(e)} if os.path.exists(path) else None
steps = []
for line in open(os.path.join(out, "steps.tsv")):
    name, result, secs, note = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
    log = os.path.join(out, name + ".log")
    text = open(log, errors="replace").read() if os.path.exists(log) else ""
    tests = [dict(zip(("passed", "failed", "ignored"), map(int, m)))
             for m in re.findall(r"test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored", text)]
    steps.append({"name": name, "result": result, "seconds": int(secs or 0), "note": note,
                  "tests": tests,
                  "libraries_logged": sorted(set(re.findall(r"(?:CUDA driver|NVRTC|NCCL) loaded.*", text)))})
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
summary = {
    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "gpus": gpu.splitlines(),
    "lib_dirs": [d for d in os.environ.get("GPUPOOL_LIB_DIRS", "").split(":") if d],
    "passed": all(s["result"] == "pass" for s in steps),
    "steps": steps,
    "first_contact": {os.path.basename(p)[:-5]: load(p)
                      for p in sorted(glob.glob(os.path.join(out, "reports", "*.json")))},
    "info": load(os.path.join(out, "info.json")),
    "demo": load(os.path.join(out, "demo.json")),
    "bench_gpu": load(os.path.join(out, "bench_gpu.json")),
    "torch": load(os.path.join(out, "torch.json")),
    "torch_checks": load(os.path.join(out, "torch_checks.json")),
    "ddp": load(os.path.join(out, "ddp.json")),
    "cupy": load(os.path.join(out, "cupy.json")),
    "torch_pairs": load(os.path.join(out, "torch_pairs.json")),
}
with open(os.path.join(out, "gpu-check.json"), "w") as f:
    json.dump(summary, f, indent=1)
print("gpu-check.json:", "PASS" if summary["passed"] else "FAIL",
      ", ".join(f"{s['name']}={s['result']}" for s in steps))
PY
    if [ -n "${OUT:-}" ]; then
        cp "$out/summary.txt" "$out/gpu-check.json" "$OUT/" 2>/dev/null
        tar czf "$OUT/gpu-out.tgz" -C "$repo" gpu-out
    fi
    exit $status
}

case "$mode" in
    build) build ;;
    run) run ;;
    *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
