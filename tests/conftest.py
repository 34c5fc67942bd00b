import importlib.util
import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Test workers share the cores: one thread each (their notebooks' kernels inherit it), or
    # OpenMP's threads oversubscribe them and every op waits 10-100x longer.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
needs_xla = pytest.mark.skipif(not HAS_XLA, reason="torch_xla not installed (the .ci/run xla job has it)")


@pytest.fixture
def backend():
    """The backend this test run is for: $HELPERS_BACKEND (xla in CI's second job), else detected."""
    import helpers

    return helpers.get_backend()


@pytest.fixture(autouse=True)
def _run_dir(tmp_path, monkeypatch):
    # results written by a test go to its own folder, never to the user's runs/
    monkeypatch.setenv("HELPERS_RUN_DIR", str(tmp_path / "run"))
    yield
