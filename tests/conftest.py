import importlib.util

import pytest

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
