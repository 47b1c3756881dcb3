#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for SECONDS each (default 60).
#   scripts/fuzz.sh [SECONDS]
# Needs nightly Rust and cargo-fuzz (installed here if missing). Without
# them it prints why it skips and exits 0. Exits non-zero on a finding
# (crash artifacts land in fuzz/artifacts/<target>/).
# FUZZ_TARGETS="pool_ops conf_parse" limits the targets; FUZZ_JOBS sets
# the build jobs (default 2).
set -u
secs="${1:-60}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root/fuzz" || { echo "fuzz: SKIP (no fuzz/ directory)"; exit 0; }
targets="${FUZZ_TARGETS:-pool_ops trace_readers conf_parse}"
export CARGO_BUILD_JOBS="${FUZZ_JOBS:-2}"

if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz: SKIP (no nightly toolchain: 'cargo +nightly' failed; rustup toolchain install nightly)"
    exit 0
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz: cargo-fuzz missing, installing it"
    if ! cargo install cargo-fuzz --locked >/dev/null 2>&1 && ! cargo install cargo-fuzz >/dev/null 2>&1; then
        echo "fuzz: SKIP (cargo-fuzz is missing and 'cargo install cargo-fuzz' failed)"
        exit 0
    fi
fi

status=0
summary=""
for t in $targets; do
    mkdir -p "corpus/$t"
    log="$(mktemp)"
    echo "fuzz: $t for ${secs}s"
    # Seeds in fuzz/corpus/<t>/; -rss_limit_mb guards the simulator's memory.
    cargo +nightly fuzz run "$t" "corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=4096 -print_final_stats=1 >"$log" 2>&1
    rc=$?
    done_line="$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1)"
    if [ -z "$done_line" ]; then done_line="$(grep -E '^#[0-9]+[[:space:]]' "$log" | tail -1)"; fi
    execs="$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}')"
    if [ $rc -ne 0 ]; then
        status=1
        echo "fuzz: $t FINDING (rc $rc); last lines:"
        tail -40 "$log"
        ls -1 "artifacts/$t" 2>/dev/null | sed 's/^/  artifact: /'
        summary+="$t: FINDING rc=$rc execs=${execs:-?} | $done_line"$'\n'
    else
        summary+="$t: ok execs=${execs:-?} | $done_line"$'\n'
    fi
    rm -f "$log"
done
echo "---- fuzz summary (${secs}s per target)"
printf '%s' "$summary"
exit $status
