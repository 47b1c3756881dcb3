#!/usr/bin/env bash
# Soak: `gpupool stress` (release build) on 4 simulated devices x 4 streams
# x 2 threads with pattern verification, for SECONDS (default 600).
#   scripts/soak.sh [SECONDS]
# Not run in CI. Saves the JSON report under $SOAK_OUT (default
# target/soak/) and prints ops, integrity errors, leaks, peak RSS and
# whether reserved memory stayed flat. Exits non-zero when any of them is
# bad. SOAK_WORKLOAD=serving soaks the serving workload instead;
# SOAK_CAPACITY sets the memory of each simulated device (default 1GiB,
# backed by host memory).
set -euo pipefail
secs="${1:-600}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${SOAK_OUT:-$root/target/soak}"
workload="${SOAK_WORKLOAD:-training}"
capacity="${SOAK_CAPACITY:-1GiB}"
target="${CARGO_TARGET_DIR:-$root/target}"

cargo build --release --bin gpupool
mkdir -p "$out"
stamp="$(date +%Y%m%dT%H%M%S)"
json="$out/soak-$workload-$stamp.json"
log="$out/soak-$workload-$stamp.log"
echo "soak: $secs s of '$workload' stress on 4 devices x 4 streams x 2 threads, verify on"
echo "soak: report -> $json, stderr -> $log"
rc=0
GPUPOOL_LOG="${GPUPOOL_LOG:-error}" "$target/release/gpupool" stress \
    --devices 4 --streams 4 --threads 2 --duration "$secs" --verify \
    --workload "$workload" --capacity "$capacity" --json >"$json" 2>"$log" || rc=$?

if [ ! -s "$json" ]; then
    echo "soak: FAIL (no report; exit $rc; see $log)"
    tail -5 "$log" || true
    exit 1
fi
# Top-level scalars of the pretty-printed report ("  \"key\": value,").
field() { sed -n "s/^  \"$1\": \\([^,]*\\),\\{0,1\\}$/\\1/p" "$json" | head -1; }
rss=$(field peak_rss_bytes)
echo "soak: seconds               $(field seconds)"
echo "soak: ops                   $(field ops) ($(field ops_per_sec) ops/s)"
echo "soak: integrity errors      $(field integrity_errors) bytes, $(field failed_verifies) failed of $(field verify_kernels) verify kernels, $(field device_faults) device faults"
echo "soak: leaked bytes          $(field leaked_bytes)"
echo "soak: host syncs on path    $(field host_syncs_on_alloc_path)"
echo "soak: alloc latency (ns)    p50 $(field p50_ns), p99 $(field p99_ns), p99.9 $(field p999_ns)"
echo "soak: peak live / reserved  $(field peak_live_bytes) / $(field peak_reserved_bytes) bytes"
echo "soak: peak RSS              $((rss / 1048576)) MiB"
echo "soak: reserved flat         $(field reserved_flat) (reached every device's capacity: $(field reserved_hit_capacity))"
if [ "$rc" -ne 0 ] || [ "$(field reserved_flat)" = "false" ]; then
    echo "soak: FAIL (exit $rc)"
    exit 1
fi
echo "soak: PASS"
