"""Every test runs against a fresh simulator runtime: 2 devices of 1 GiB, no
maintenance threads (figures change only when a test acts)."""

import gpupool
import pytest

SIM = "backend=sim,devices=2,capacity=1GiB,maint_ms=0"


@pytest.fixture
def pool():
    gpupool.shutdown()
    gpupool.on_oom(None)
    gpupool.init(SIM)
    yield gpupool
    gpupool.on_oom(None)
    gpupool.shutdown()
