#!/usr/bin/env bash
# Randomized soak: back-to-back 4-second `gpupool stress --verify` runs
# (release build), each with a random seed, workload, shape (1-3 devices
# of 512 MiB, 1-8 streams, 1-3 threads), busy-stream and record_stream
# shares, and one of several GPUPOOL_CONF variants, for SECONDS (default
# 1200). A run fails on a non-zero exit, no report, or any integrity
# error, failed verify, device fault, leaked byte, false out-of-memory
# or host sync on the allocation path; its stderr is kept.
#   scripts/soak-random.sh [SECONDS]
# Not run in CI. Prints one line per run and a summary; exits non-zero
# when any run failed. RANDOM_SEED fixes the sequence of runs.
set -uo pipefail
secs="${1:-1200}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
target="${CARGO_TARGET_DIR:-$root/target}"
out="$target/soak-random"
cargo build --release --bin gpupool || exit 1
mkdir -p "$out"
RANDOM="${RANDOM_SEED:-$$}"
confs=("" "stitch_share=0.01" "stitch_budget=0.25" "thread_cache=false"
    "handover=false" "probe_interval_us=50" "idle_ms=5" "small_max=32KiB"
    "driver_time=spent")
end=$((SECONDS + secs))
runs=0 bad=0 kernels=0
while [ "$SECONDS" -lt "$end" ]; do
    runs=$((runs + 1))
    seed=$RANDOM
    workload=$([ $((RANDOM % 2)) = 0 ] && echo training || echo serving)
    devices=$((1 + RANDOM % 3)) streams=$((1 + RANDOM % 8)) threads=$((1 + RANDOM % 3))
    kernel=$((RANDOM % 3 * 5)) cross=$((RANDOM % 4 * 15))
    conf=${confs[$((RANDOM % ${#confs[@]}))]}
    args=(--workload "$workload" --devices "$devices" --streams "$streams"
        --threads "$threads" --duration 4 --verify --seed "$seed"
        --kernel-percent "$kernel" --cross-percent "$cross" --capacity 512MiB --json)
    report=$(GPUPOOL_CONF="$conf" timeout 120 "$target/release/gpupool" stress "${args[@]}" \
        2>"$out/run.err")
    rc=$?
    # errors, failed verifies, faults, leaks, false OOMs, host syncs; kernels
    r=$(echo "$report" | python3 -c 'import json, sys
d = json.load(sys.stdin)
keys = ["integrity_errors", "failed_verifies", "device_faults", "leaked_bytes",
        "false_ooms", "host_syncs_on_alloc_path", "verify_kernels"]
print(" ".join(str(d[k]) for k in keys))' 2>/dev/null)
    echo "run $runs: rc=$rc GPUPOOL_CONF='$conf' ${args[*]} -> ${r:-no report}"
    if [ "$rc" != 0 ] || [ -z "$r" ] || [ "${r% *}" != "0 0 0 0 0 0" ]; then
        bad=$((bad + 1))
        cp "$out/run.err" "$out/failed-$runs.err"
    else
        kernels=$((kernels + ${r##* }))
    fi
done
echo "soak-random: $runs runs, $bad failed, $kernels verify kernels in the passing runs"
[ "$bad" = 0 ]
