#!/usr/bin/env bash
# Runs the README's main command (`gpupool demo`) N times in a row while
# every core is kept busy by other work, and counts the runs that failed.
# The demo's exit status must not depend on thread timing: any failure here
# is a bug.
#
#   bash scripts/demo-repeat.sh [N]      # default N=50
#
#   GPUPOOL_BUSY   busy loops started beside the runs (default: one per
#                  core, `nproc`; 0 runs on an idle machine)
#
# Each busy loop is `yes > /dev/null`, started before the first run and
# killed (by its own pid) when the script ends. Each run's JSON report is
# kept under target/demo-repeat/; failed runs also keep their stderr. The
# timing-dependent figure `no_growth_after_step2` is tallied, not judged.
# Exits non-zero when any run failed.
set -euo pipefail
cd "$(dirname "$0")/.."

n=${1:-50}
busy=${GPUPOOL_BUSY:-$(nproc)}
out=target/demo-repeat
cargo build --release --quiet
bin=target/release/gpupool
rm -rf "$out"
mkdir -p "$out"

pids=()
cleanup() {
    for p in "${pids[@]}"; do
        kill "$p" 2>/dev/null || true
    done
}
trap cleanup EXIT
for _ in $(seq 1 "$busy"); do
    yes > /dev/null &
    pids+=("$!")
done

echo "demo-repeat: $n runs of '$bin demo --json' beside $busy busy loop(s) (yes > /dev/null) on $(nproc) core(s)"
fail=0
grew=0
start=$(date +%s)
for i in $(seq 1 "$n"); do
    json="$out/run-$i.json"
    if "$bin" demo --json --plot "$out/run-$i.svg" > "$json" 2> "$out/run-$i.err"; then
        rm -f "$out/run-$i.err"
        status=ok
    else
        fail=$((fail + 1))
        status="FAILED (see $out/run-$i.err)"
    fi
    if python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["no_growth_after_step2"] else 1)' "$json" 2>/dev/null; then
        fig="no growth after step 2"
    else
        grew=$((grew + 1))
        fig="grew after step 2 (a figure)"
    fi
    echo "run $i: $status; $fig"
done
load=$(cut -d' ' -f1-3 /proc/loadavg)
echo "demo-repeat: $fail of $n runs failed; $grew of $n grew after a phase's second step (figure only); $(( $(date +%s) - start )) s; load average $load"
[ "$fail" -eq 0 ]
