#!/usr/bin/env bash
# Compiles gpupool's PyTorch shim (python/gpupool/csrc/torch_shim.cpp) on a
# machine without a GPU or a CUDA toolkit, against the headers of a pinned
# PyTorch release, and checks that every torch/c10 symbol the object needs
# is exported by that release's libraries:
#
#   bash scripts/torch-shim-check.sh            # TORCH_VERSION=2.11.0 by default
#
# Where it gets what it needs (all from PyPI, cached under
# ${TORCH_SHIM_CHECK_CACHE:-~/.cache/gpupool/torch-shim-check}):
#   - torch's headers and libtorch_cuda/libc10_cuda/libc10: the torch wheel
#     (no dependencies). The Linux aarch64 wheel is used on every machine:
#     it is the smallest Linux wheel built with CUDA, and headers and C++
#     symbol names do not depend on the architecture. Only the headers and
#     the names the three libraries export are kept (about 60 MB).
#   - CUDA's runtime headers of the CUDA version that wheel was built for
#     (13.0 for torch 2.11 on PyPI), by scripts/fetch-cuda-headers.sh.
#
# With USE_INSTALLED_TORCH=1 and a torch importable by $PYTHON (the GPU
# machine), it instead builds the shim exactly as gpupool.torch.install()
# does (gpupool.torch.build_shim, linked) into $GPUPOOL_TORCH_SHIM_DIR or a
# temporary cache.
#
# Prints each phase's seconds and "torch shim check: PASS" or fails.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
ver=${TORCH_VERSION:-2.11.0}
cache=${TORCH_SHIM_CHECK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpupool/torch-shim-check}
t0=$SECONDS
phase() { echo "[$((SECONDS - t0)) s] $*"; }

if [ "${USE_INSTALLED_TORCH:-0}" = 1 ]; then
    phase "building with the installed torch (gpupool.torch.build_shim)"
    # Into $GPUPOOL_TORCH_SHIM_DIR when set (kept: later processes reuse it),
    # else a temporary folder.
    dir=${GPUPOOL_TORCH_SHIM_DIR:-}
    [ -n "$dir" ] || { tmp=$(mktemp -d); dir=$tmp; }
    GPUPOOL_TORCH_SHIM_DIR="$dir" PYTHONPATH="$repo/python${PYTHONPATH:+:$PYTHONPATH}" \
        "$py" -c 'import gpupool.torch as gt; print(gt.build_shim(verbose=True))'
    [ -z "${tmp:-}" ] || rm -rf "$tmp"
    phase "torch shim check: PASS (installed torch, linked)"
    exit 0
fi

mkdir -p "$cache"
torch_dir="$cache/torch-$ver"
if [ ! -f "$torch_dir/.done" ]; then
    phase "downloading torch==$ver (no dependencies)"
    rm -rf "$torch_dir" "$cache/wheels"
    "$py" -m pip download --quiet --no-deps --only-binary=:all: \
        --platform manylinux_2_28_aarch64 --python-version 3.11 \
        -d "$cache/wheels" "torch==$ver"
    phase "unpacking torch's headers and CUDA libraries"
    "$py" - "$cache/wheels" "$torch_dir" <<'PY'
import glob, sys, zipfile
whl, = glob.glob(sys.argv[1] + "/torch-*.whl")
keep = ("torch/lib/libtorch_cuda.so", "torch/lib/libc10_cuda.so", "torch/lib/libc10.so")
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith("torch/include/") or n in keep or n == "torch/version.py":
            z.extract(n, sys.argv[2])
PY
    rm -rf "$cache/wheels"
    # Only the libraries' exported names are kept (the .so files are 400 MB).
    for l in libtorch_cuda libc10_cuda libc10; do
        nm -D --defined-only "$torch_dir/torch/lib/$l.so" | awk '{print $3}'
    done | sort -u > "$torch_dir/exports.txt"
    rm -rf "$torch_dir/torch/lib"
    touch "$torch_dir/.done"
fi
cuda_ver=$(sed -n "s/^cuda: Optional\[str\] = '\(.*\)'/\1/p" "$torch_dir/torch/version.py")
cuda_ver=${cuda_ver:-12.8}
cuda_dir="$cache/cuda-headers-$cuda_ver"
if [ ! -f "$cuda_dir/.done" ]; then
    phase "downloading CUDA $cuda_ver's runtime headers (scripts/fetch-cuda-headers.sh)"
    rm -rf "$cuda_dir"
    PYTHON="$py" bash "$repo/scripts/fetch-cuda-headers.sh" "$cuda_ver" "$cuda_dir"
    touch "$cuda_dir/.done"
fi
grep -h "__version__ =\|^cuda" "$torch_dir/torch/version.py" | tr '\n' ' '; echo

inc="$torch_dir/torch/include"
obj=$(mktemp --suffix=.o)
trap 'rm -f "$obj"' EXIT
phase "compiling the shim (-O2 -Wall -Wextra -Werror, to an object)"
mapfile -t cmd < <(PYTHONPATH="$repo/python" "$py" - "$inc" "$cuda_dir" "$obj" <<'PY'
import glob, sys
import gpupool.torch as gt
inc, cuda, obj = sys.argv[1:]
cuda_incs = sorted(glob.glob(cuda + "/nvidia/*/include"))
cmd = gt.shim_compile_args([inc, inc + "/torch/csrc/api/include"], cuda_incs, True, obj,
                           syntax_only=True)
cmd[-1:] = ["-c", "-o", obj]   # an object: code generation too, not only the syntax
print("\n".join(cmd))
PY
)
"${cmd[@]}"
phase "checking the object's torch/c10 symbols against libtorch_cuda, libc10_cuda, libc10"
need=$(nm -u "$obj" | awk '{print $2}' | grep -E '^_Z(N|T[IVS]N)K?(3c10|5torch)' | sort -u)
missing=$(comm -23 <(echo "$need") "$torch_dir/exports.txt")
echo "$(echo "$need" | grep -c .) torch/c10 symbols needed"
if [ -n "$missing" ]; then
    echo "not exported by torch $ver:" >&2
    echo "$missing" | c++filt >&2
    exit 1
fi
phase "torch shim check: PASS (torch $ver headers, object compiled, symbols resolved)"
