#!/usr/bin/env bash
# Fetches CUDA's runtime headers (enough for host code that includes
# cuda_runtime.h, such as PyTorch's c10/cuda headers) from PyPI into DEST,
# without a CUDA toolkit:
#
#   bash scripts/fetch-cuda-headers.sh 13.0 DEST   # nvidia-cuda-runtime + nvidia-cuda-crt 13.0.*
#   bash scripts/fetch-cuda-headers.sh 12.8 DEST   # nvidia-cuda-runtime-cu12 + nvidia-cuda-nvcc-cu12 12.*
#
# Only the wheels' include/ folders are kept, under DEST/nvidia/*/include
# (the layout gpupool.torch looks for; GPUPOOL_CUDA_INCLUDE can name them).
# cuda_runtime.h needs crt/host_config.h and crt/host_defines.h, which the
# runtime wheel lacks: CUDA 13 ships them in nvidia-cuda-crt, CUDA 12 in
# nvidia-cuda-nvcc-cu12. $PYTHON (default python3) runs pip.
set -euo pipefail
ver=${1:?usage: $0 CUDA_VERSION DEST}
dest=${2:?usage: $0 CUDA_VERSION DEST}
py=${PYTHON:-python3}
major=${ver%%.*}
minor=${ver#*.}; minor=${minor%%.*}
case "$major" in
    12) pkgs=("nvidia-cuda-runtime-cu12==12.*" "nvidia-cuda-nvcc-cu12==12.*") ;;
    13) pkgs=("nvidia-cuda-runtime==13.$minor.*" "nvidia-cuda-crt==13.$minor.*") ;;
    *) echo "$0: no header source for CUDA $ver" >&2; exit 2 ;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "${pkgs[@]}"
mkdir -p "$dest"
"$py" - "$tmp" "$dest" <<'PY'
import glob, sys, zipfile
for whl in glob.glob(sys.argv[1] + "/*.whl"):
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            if "/include/" in n and not n.endswith("/"):
                z.extract(n, sys.argv[2])
PY
ls -d "$dest"/nvidia/*/include
