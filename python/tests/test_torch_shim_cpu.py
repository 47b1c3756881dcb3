"""The torch shim, built and driven without a GPU (gpupool on the
simulator): runs _torch_shim_cpu.py in its own process where a torch with
CUDA support (libtorch_cuda), CUDA's runtime headers and a C++ compiler are
present; skipped otherwise (CI compiles the shim in
scripts/torch-shim-check.sh instead)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _torch_with_cuda_libs():
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return False
    return (Path(spec.origin).parent / "lib" / "libtorch_cuda.so").exists()


@pytest.mark.skipif(not _torch_with_cuda_libs(), reason="needs a torch with libtorch_cuda.so")
@pytest.mark.parametrize("library", ["gpupool", "with-pool-functions"])
def test_torch_shim_on_the_simulator(library):
    """"gpupool": the library as it is (private pools reported unavailable
    until it has the pool functions); "with-pool-functions": a stand-in
    (fake_pool_lib.c) that has them, so the shim's routing is checked call
    by call."""
    env = dict(os.environ)
    env.pop("GPUPOOL_CONF", None)
    cmd = [sys.executable, str(HERE / "_torch_shim_cpu.py")]
    if library == "with-pool-functions":
        cmd.append("--fake-pools")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if p.returncode != 0 and "building the shim needs CUDA's runtime headers" in p.stderr:
        pytest.skip("CUDA runtime headers not found")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    assert "torch shim cpu: OK" in p.stdout, p.stdout
    print(p.stdout)
