#!/usr/bin/env bash
# The GPU check, in two halves:
#
#   bash scripts/gpu-check.sh build   # here (cargo, no GPU): builds release
#                                     # test binaries and the CLI into gpu-bundle/
#   bash scripts/gpu-check.sh run     # on the GPU machine (no cargo): runs them
#
# The device tool call that runs it (gpu-bundle/ is git-ignored, so carry it):
#   run(command="bash scripts/gpu-check.sh run", carry=["gpu-bundle"], timeout_s=420)
#
# `run` executes, with CUDA required (GPUPOOL_REQUIRE_CUDA=1, so a missing
# driver fails instead of skipping):
#   1. the backend conformance suite against CudaBackend (and the simulator);
#   2. the compaction kernel check (NVRTC compile + moves vs sequential memmove);
#   3. `gpupool info` and a demo run on the real device;
#   4. GPU micro-benchmarks (`gpupool bench --gpu`): pool alloc/free pairs vs
#      cuMemAlloc and cuMemAllocAsync, compaction kernel vs cuMemcpyDtoD;
#   5. the PyTorch pluggable-allocator run (python/examples/train.py: a small
#      transformer trained with gpupool and with PyTorch's allocator);
# and writes logs and a summary to $OUT (or gpu-out/ when $OUT is unset).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bundle="$repo/gpu-bundle"
mode=${1:-}

build() {
    set -e
    cd "$repo"
    rm -rf "$bundle"
    mkdir -p "$bundle"
    # Test binaries: cargo prints their paths as JSON artifacts.
    cargo test --release --no-run --message-format=json --test conformance --test kernel_nvrtc \
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
    cargo build --release --bin gpupool --lib
    cp target/release/gpupool target/release/libgpupool.so "$bundle/"
    strip "$bundle"/* 2>/dev/null || true
    du -sh "$bundle"
}

run() {
    out=${OUT:-$repo/gpu-out}
    mkdir -p "$out"
    cd "$repo"
    export GPUPOOL_REQUIRE_CUDA=1 RUST_BACKTRACE=1
    # NVRTC from the machine's CUDA toolkit, if the loader does not find it.
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
    summary="$out/summary.txt"
    : > "$summary"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$summary"
    status=0
    check() {
        local name=$1; shift
        local start=$SECONDS
        if "$@" > "$out/$name.log" 2>&1; then
            echo "PASS $name ($((SECONDS - start)) s)" | tee -a "$summary"
        else
            echo "FAIL $name ($((SECONDS - start)) s): see $name.log" | tee -a "$summary"
            tail -n 30 "$out/$name.log"
            status=1
        fi
    }
    check conformance "$bundle/conformance" --test-threads=1
    GPUPOOL_REQUIRE_NVRTC=1 check kernel "$bundle/kernel_nvrtc" --test-threads=1
    check info "$bundle/gpupool" info --backend cuda --json
    check demo "$bundle/gpupool" demo --backend cuda --json
    check bench_gpu "$bundle/gpupool" bench --gpu --json
    GPUPOOL_LIB="$bundle/libgpupool.so" check torch \
        python3 python/examples/train.py --steps 300 --out "$out/torch.json"
    grep -h "test result" "$out"/*.log | tee -a "$summary"
    exit $status
}

case "$mode" in
    build) build ;;
    run) run ;;
    *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
