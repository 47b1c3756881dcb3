#!/usr/bin/env bash
# Instructions per small (4 KiB) alloc + free pair through each door, by
# callgrind: the Rust API and raw pointers (`door_pairs`), the C ABI and
# PyTorch's hooks linked statically into a Rust binary (`door_pairs`), and
# the same two through libgpupool.so from C (`door_pairs.c`), the way
# PyTorch loads them. Each figure is (I(2N) - I(N)) / N, so set-up and
# teardown cancel. Needs valgrind and a C compiler.
#
#   bash scripts/abi-pairs.sh [N]        # N = 100000 by default
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-100000}
cargo build --release --lib --example door_pairs -q
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
lib=$PWD/target/release
cc -O2 -Iinclude tools/examples/door_pairs.c -L"$lib" -lgpupool -Wl,-rpath,"$lib" \
    -o "$out/door_pairs_c"
instr() {
    valgrind --tool=callgrind --callgrind-out-file=/dev/null "$@" 2>&1 |
        awk '/refs:/ { gsub(",", "", $4); print $4 }'
}
per_pair() {
    local a b
    a=$(instr "$@" "$n")
    b=$(instr "$@" $((2 * n)))
    echo $(((b - a) / n))
}
for door in rust_api rust_raw c_abi torch_hook; do
    printf '%-22s %s\n' "$door (static)" "$(per_pair target/release/examples/door_pairs "$door")"
done
for door in c_abi torch_hook; do
    printf '%-22s %s\n' "$door (.so)" "$(per_pair "$out/door_pairs_c" "$door")"
done
