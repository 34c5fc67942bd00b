import importlib.util
import os
import pathlib
import shutil

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Test workers share the cores: one thread each (their notebooks' kernels inherit it), or
    # OpenMP's threads oversubscribe them and every op waits 10-100x longer.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

from helpers.course.report import RUN_DIR_VAR  # after the thread limit: it loads torch and its BLAS

# The notebooks checked end to end by nbval (``pytest -m reader --nbval-lax notebooks tests``): each runs in a kernel of
# its own, in order, with the machine's default threads, as a reader runs it; the cells marked ``# NBVAL_CHECK_OUTPUT``
# must print what the committed notebook shows. Their rows go to a fresh run folder, where test_tour.py makes the table
# and the charts of them.
NBVAL_RUN_DIR = pathlib.Path(__file__).resolve().parent.parent / "runs" / "nbval"


def pytest_configure(config):
    if getattr(config.option, "nbval_lax", False) and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.option.nbval_current_env = True  # this environment's kernel, whatever kernels the machine lists
        shutil.rmtree(NBVAL_RUN_DIR, ignore_errors=True)  # this run's rows only
        NBVAL_RUN_DIR.mkdir(parents=True)
        os.environ[RUN_DIR_VAR] = str(NBVAL_RUN_DIR)  # the kernels inherit it: every notebook appends its rows here
        # The kernels draw as Colab's do (ipykernel's inline backend): a backend named by the caller (MPLBACKEND=Agg)
        # would show no chart, and the charts' committed outputs are facts nbval checks.
        os.environ.pop("MPLBACKEND", None)


def pytest_collection_modifyitems(config, items):
    """A reader's run (every notebook under nbval, default threads) is not for a one-thread test worker: there it is
    skipped, and the README's test command runs it on its own after them."""
    for item in items:
        if type(item).__module__.startswith("nbval"):
            item.add_marker(pytest.mark.reader)  # a notebook's cell: what `-m reader` selects
    if os.environ.get("PYTEST_XDIST_WORKER"):
        alone = pytest.mark.skip(reason="a reader's run, with default threads: pytest -m reader, after the workers")
        for item in items:
            if "reader" in item.keywords:
                item.add_marker(alone)


def within_bf16_rounding(got, x, weight, roundings: int = 2) -> None:
    """A kernel's product against ``F.linear`` on the checkpoint's bf16 ``weight``: the kernel multiplies code x scale
    unrounded where the weight rounds each to bf16 (half an ulp, 2**-9 of each term), and each output is rounded
    ``roundings`` times in all (once each; three where a kernel's two passes are rounded, then their sum). The bound,
    from the terms' magnitudes, not a tolerance picked to pass."""
    import torch

    got, dense = got.float(), torch.nn.functional.linear(x.to(weight.dtype), weight).float()
    bound = 2**-9 * (x.abs().float() @ weight.abs().float().T) + 2**-9 * roundings * got.abs().maximum(dense.abs())
    assert ((got - dense).abs() <= bound).all(), (got - dense).abs().max()


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


@pytest.fixture(scope="session")
def packed_table_twin(tmp_path_factory):
    """The twin as a checkpoint that saved its per-layer table packed (``weight_packed``,
    ``weight_scale``, ``weight_shape``, as its linears) instead of bf16: the path
    ``QTable.from_checkpoint`` reads. Packed from the twin's own table by ``QTable``, exactly."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from helpers.course import offline
    from helpers.qtable import QTable

    source, folder = offline.build_tiny_twin(), tmp_path_factory.mktemp("twin") / "packed-table"
    shutil.copytree(source, folder)
    tensors = load_file(folder / "model.safetensors")
    key = "model.language_model.embed_tokens_per_layer"
    table = torch.nn.Embedding.from_pretrained(tensors.pop(f"{key}.weight"))
    table.scalar_embed_scale = 1.0
    packed, report = QTable.from_embedding(table, exact_only=True)
    tensors |= {
        f"{key}.weight_packed": packed.packed.contiguous(),  # views of the table's laid-out rows
        f"{key}.weight_scale": packed.scales.contiguous(),
        f"{key}.weight_shape": torch.tensor(table.weight.shape),
    }
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def linear_rows(fn, *args, within=(), **kwargs) -> list[tuple[int, bool]]:
    """Each matmul with a weight (``F.linear``) that ``fn(*args, **kwargs)`` runs, eagerly, in order: its rows, and
    whether it ran inside one of the modules ``within``."""
    import torch

    rows, inside = [], []
    hooks = [m.register_forward_pre_hook(lambda *_: inside.append(True) and None) for m in within]
    hooks += [m.register_forward_hook(lambda *_: inside.pop() and None) for m in within]  # None: outputs kept

    class Record(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.linear:
                rows.append((args[0].reshape(-1, args[0].shape[-1]).shape[0], bool(inside)))
            return func(*args, **(kwargs or {}))

    try:
        with torch.no_grad(), Record():
            fn(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return rows
