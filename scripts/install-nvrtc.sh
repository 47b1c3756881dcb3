#!/usr/bin/env bash
# Installs NVRTC (libnvrtc) from PyPI into a folder, no GPU or CUDA needed,
# and prints the folder that holds libnvrtc.so.* (for LD_LIBRARY_PATH) as
# the only line on stdout. Logs go to stderr. Idempotent.
#
#   export LD_LIBRARY_PATH="$(bash scripts/install-nvrtc.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
#   GPUPOOL_REQUIRE_NVRTC=1 cargo test --test kernel_nvrtc
#
# gpupool also finds it without LD_LIBRARY_PATH: its own search reads
# GPUPOOL_LIB_DIRS (`export GPUPOOL_LIB_DIRS="$(bash scripts/install-nvrtc.sh)"`)
# and every site-packages/nvidia/*/lib of the machine's Python installs, and
# logs the file it loaded (src/backend/cuda/libs.rs).
#
# Usage: scripts/install-nvrtc.sh [DIR]
#   DIR                 where to install (default: $GPUPOOL_NVRTC_DIR, else
#                       target/nvrtc in the repository)
#   GPUPOOL_NVRTC_PKG   pip requirement (default nvidia-cuda-nvrtc-cu12==12.9.86:
#                       libnvrtc.so.12, whose PTX (ISA 8.8) loads on CUDA 12.9
#                       and 13.x drivers; nvidia-cuda-nvrtc (13.x) emits PTX
#                       only 13.x drivers accept). cudarc's loader tries
#                       libnvrtc.so.13 before libnvrtc.so.12.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-${GPUPOOL_NVRTC_DIR:-$repo/target/nvrtc}}
pkg=${GPUPOOL_NVRTC_PKG:-nvidia-cuda-nvrtc-cu12==12.9.86}
stamp="$dir/.gpupool-nvrtc-pkg"

find_lib() {
    find "$dir" -name 'libnvrtc.so.*' ! -name '*builtins*' ! -name '*.alt.*' \
        -printf '%h\n' 2>/dev/null | head -n 1
}

if [ "$(cat "$stamp" 2>/dev/null)" != "$pkg" ] || [ -z "$(find_lib)" ]; then
    echo "install-nvrtc: installing $pkg into $dir" >&2
    rm -rf "$dir"
    mkdir -p "$dir"
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
        --no-deps --target "$dir" "$pkg" >&2
    printf '%s\n' "$pkg" > "$stamp"
fi

lib=$(find_lib)
if [ -z "$lib" ]; then
    echo "install-nvrtc: $pkg installed no libnvrtc.so.* under $dir" >&2
    exit 1
fi
echo "install-nvrtc: $(basename "$(ls "$lib"/libnvrtc.so.* | grep -v -e builtins -e '\.alt\.' | head -n 1)") in $lib" >&2
printf '%s\n' "$lib"
