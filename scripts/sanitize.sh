#!/usr/bin/env bash
# ThreadSanitizer and AddressSanitizer runs of the pool and stress tests.
#   scripts/sanitize.sh [thread|address|all]     (default: all)
# Needs nightly Rust; std is rebuilt with the sanitizer (-Zbuild-std, which
# needs nightly's rust-src component: added here if missing). Without
# nightly it prints why it skips and exits 0; without rust-src it runs
# AddressSanitizer over an uninstrumented std and skips ThreadSanitizer
# (which reports false races in an uninstrumented std). Exits non-zero on a
# finding (a sanitizer report or a failing test). Tests run in the release
# profile with debug assertions and overflow checks on: instrumented debug
# code is so slow that the stress tests' minimum-work checks fail.
# Build output goes to $SAN_TARGET_DIR (default target/san), one folder per
# sanitizer; each run's output is kept in that folder's sanitize.log. Not
# run in CI (a full instrumented build of std and the crate takes many
# minutes).
#   SAN_JOBS      build jobs (default 2)
#   SAN_TESTS     integration tests to run (default "stress stress_run pool")
#   SAN_LIB_FILTER  filter of the library's unit tests (default "pool::")
set -u
which="${1:-all}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
base="${SAN_TARGET_DIR:-$root/target/san}"
tests="${SAN_TESTS:-stress stress_run pool}"
lib_filter="${SAN_LIB_FILTER:-pool::}"
export CARGO_BUILD_JOBS="${SAN_JOBS:-2}"

if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "sanitize: SKIP (no nightly toolchain: 'cargo +nightly' failed; rustup toolchain install nightly)"
    exit 0
fi
host="$(rustc +nightly -vV | sed -n 's/^host: //p')"
build_std=1
if ! rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^rust-src'; then
    echo "sanitize: rust-src missing for nightly, adding it"
    rustup component add rust-src --toolchain nightly >/dev/null 2>&1 || build_std=0
fi

status=0
summary=""
run() { # sanitizer
    local san="$1" flags=(-Zsanitizer="$1") std_args=() t test_args=()
    if [ "$build_std" = 1 ]; then
        std_args=(-Zbuild-std)
    elif [ "$san" = thread ]; then
        summary+="thread: SKIP (no rust-src: std cannot be instrumented)\n"
        return
    fi
    for t in $tests; do test_args+=(--test "$t"); done
    export CARGO_TARGET_DIR="$base/$san"
    export RUSTFLAGS="${flags[*]} -Cdebuginfo=1"
    export RUSTDOCFLAGS="$RUSTFLAGS"
    export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
    export ASAN_OPTIONS="detect_leaks=1 detect_stack_use_after_return=1 ${ASAN_OPTIONS:-}"
    # The logs of the code under test are noise here.
    export GPUPOOL_LOG=error
    export CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true
    export CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true
    local common=(+nightly test --release --no-fail-fast "${std_args[@]}" --target "$host")
    local log="$CARGO_TARGET_DIR/sanitize.log" ok=1
    mkdir -p "$CARGO_TARGET_DIR"
    : >"$log"
    echo "sanitize: $san: RUSTFLAGS='$RUSTFLAGS' cargo ${common[*]} --lib -- $lib_filter"
    cargo "${common[@]}" --lib -- "$lib_filter" 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || ok=0
    echo "sanitize: $san: cargo ${common[*]} ${test_args[*]}"
    cargo "${common[@]}" "${test_args[@]}" 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || ok=0
    local reports passed
    reports=$(grep -c -E "^(WARNING: ThreadSanitizer|==[0-9]+==ERROR: (Address|Leak)Sanitizer)" "$log")
    passed=$(sed -n 's/^test result: .* \([0-9][0-9]*\) passed.*/\1/p' "$log" | awk '{s+=$1} END {print s+0}')
    if [ "$ok" = 1 ] && [ "$reports" = 0 ]; then
        summary+="$san: PASS ($passed tests passed, 0 sanitizer reports; library '$lib_filter', tests: $tests; build-std: $build_std)\n"
    else
        status=1
        summary+="$san: FAIL ($reports sanitizer reports, $passed tests passed; see $log)\n"
    fi
}

case "$which" in
    thread | address) run "$which" ;;
    all) run thread; run address ;;
    *) echo "usage: $0 [thread|address|all]"; exit 2 ;;
esac
printf "sanitize: summary\n$summary"
exit "$status"
