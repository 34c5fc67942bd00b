import os
import subprocess
import sys

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

import helpers
from conftest import needs_xla
from helpers.backend import BACKENDS, MODES, BackendError, get_backend


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and len(text) < 300, text
    return text


def test_unknown_backend_is_one_actionable_line():
    with pytest.raises(BackendError) as err:
        get_backend("gpu")
    assert all(name in _one_line(err) for name in BACKENDS)


def test_tpu_without_a_tpu_is_one_clear_line():
    with pytest.raises(BackendError) as err:
        get_backend("tpu")
    assert "no TPU" in _one_line(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_is_one_clear_line():
    with pytest.raises(BackendError) as err:
        get_backend("cuda")
    assert "no CUDA GPU" in _one_line(err)


def test_environment_variable_overrides_detection(monkeypatch):
    monkeypatch.setenv("HELPERS_BACKEND", "cpu")
    assert get_backend().name == "cpu"
    monkeypatch.setenv("HELPERS_BACKEND", "nonsense")
    with pytest.raises(BackendError):
        get_backend()
    assert get_backend("cpu").name == "cpu"  # an argument wins over the variable


def test_defer_and_fuse_on_cpu_names_the_backends_that_have_it():
    cpu = get_backend("cpu")
    assert cpu.modes == ("eager", "compile")
    with pytest.raises(BackendError) as err:
        cpu.in_mode(helpers.op_stack, "defer_and_fuse")
    text = _one_line(err)
    assert "tpu" in text and "xla" in text
    with pytest.raises(BackendError) as err:
        cpu.in_mode(helpers.op_stack, "warp_speed")
    assert all(mode in _one_line(err) for mode in MODES)


def test_compile_counter_counts_new_shapes_only(backend):
    torch.compiler.reset()
    fn = backend.compile(helpers.op_stack)
    counts = []
    for size in (8, 8, 16, 8, 12):
        x = torch.ones(size, size).to(backend.device)
        with backend.compile_counter() as count:
            out = fn(x)
        del out
        counts.append(count.graphs)
    assert counts == [1, 0, 1, 0, 1]


def test_a_cpu_kernel_compiled_under_one_thread_count_serves_another():
    """The cpu backend's inductor kernels read the thread count when they run, so a program
    compiled with a test worker's one thread is found in the compile cache by a reader's default."""
    cpu = get_backend("cpu")
    assert inductor_config.cpp.dynamic_threads
    x, threads, outputs = torch.ones(64, 64), torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.compiler.reset()  # dynamo forgets; inductor's cache on disk stays
            counters.clear()
            outputs.append(cpu.compile(helpers.op_stack)(x))
    finally:
        torch.set_num_threads(threads)
    assert counters["inductor"]["fxgraph_cache_hit"] == 1, dict(counters["inductor"])
    torch.testing.assert_close(*outputs)  # two thread counts: summed in another order, within float32's tolerance


def test_every_mode_computes_the_same_numbers(backend):
    x = torch.randn(32, 32)
    expected = helpers.op_stack(x)
    for mode in backend.modes:
        out = backend.in_mode(helpers.op_stack, mode)(x.to(backend.device)).cpu()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_import_is_light_and_never_loads_tpu_or_xla_stacks():
    code = (
        "import sys, time; t = time.perf_counter(); import helpers; dt = time.perf_counter() - t\n"
        "assert 'torch' not in sys.modules, 'import helpers imported torch'\n"
        "b = helpers.get_backend()\n"
        "loaded = [m for m in ('torch_tpu', 'torch_xla') if m in sys.modules]\n"
        "print(dt, b.name, loaded)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HELPERS_BACKEND", "PJRT_DEVICE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seconds, name, loaded = out.stdout.split(maxsplit=2)
    assert float(seconds) < 2.0
    assert name in ("cpu", "cuda") and loaded.strip() == "[]"


def test_sync_and_memory_do_not_fail(backend):
    backend.sync()
    memory = backend.memory()
    assert memory is None or memory["peak"] >= memory["in_use"] >= 0
    assert backend.name in helpers.course.hub.describe(backend)


@needs_xla
def test_xla_counts_one_program_per_op_in_eager_and_one_per_call_fused():
    xla = get_backend("xla")
    x = torch.randn(20, 20).to(xla.device)  # a shape no other test uses: XLA's program cache is per process
    xla.flush()
    executions = {}
    for mode in xla.modes:
        fn = xla.in_mode(helpers.op_stack, mode)
        for _ in range(2):  # warm: compile outside the count
            out = fn(x)
        with xla.compile_counter() as count:
            out = fn(x)
        del out
        executions[mode] = count.executions
    assert executions == {"eager": 30, "defer_and_fuse": 1, "compile": 1}


@needs_xla
def test_xla_lazy_mode_compiles_per_new_shape():
    rows = helpers.shape_demo(get_backend("xla"), "defer_and_fuse", sizes=(24, 24, 40))
    assert [r["new_compilations"] for r in rows] == [1, 0, 1]


def _policy_of(name: str) -> dict:
    """A backend's policy, read without its hardware: the properties decide from the name."""
    from helpers.backend import Backend
    from helpers.course import hub, measure

    backend = object.__new__(Backend)
    backend.name, backend.device = name, torch.device("cuda" if name == "cuda" else "cpu")
    keys = ("defers_ops", "lazy", "on_tpu", "generation_length", "timed_length")
    keys += ("runs_compiled_generate", "load_device_map")
    policy = {k: getattr(backend, k) for k in keys}
    policy["default_model"] = hub.default_model(backend)  # the course's, from what the backend says it is
    if backend.on_tpu:  # no probe runs on a TPU: its bandwidth is Google's published figure
        policy["bandwidth"] = measure.read_bandwidth(backend)[1]
    if name != "cpu":  # on a CPU it sets inductor's pass for the process: its own test, test_roofline
        policy["matvec loops"] = backend.use_matvec_loops()
    return policy


def test_each_backend_s_policy_is_one_table(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    tpu, xla, cuda, cpu = (_policy_of(n) for n in ("tpu", "xla", "cuda", "cpu"))
    assert [p["default_model"] for p in (tpu, xla, cuda, cpu)] == ["e2b", "twin", "e2b if it fits", "twin"]
    assert [p["defers_ops"] for p in (tpu, xla, cuda, cpu)] == [True, True, False, False]
    assert [p["lazy"] for p in (tpu, xla, cuda, cpu)] == [False, True, False, False]
    assert [p["generation_length"] for p in (tpu, xla, cuda, cpu)] == [32, 8, 32, 32]
    assert [p["timed_length"] for p in (tpu, xla, cuda, cpu)] == [128, 8, 128, 128]
    assert [p["runs_compiled_generate"] for p in (tpu, xla, cuda, cpu)] == [True, False, True, True]
    assert xla["load_device_map"] == {"": "cpu"}  # accelerate cannot place onto an XLA device
    assert [p["matvec loops"] for p in (tpu, xla, cuda)] == [None, None, None]  # a CPU compiler's pass
    monkeypatch.setenv("PJRT_DEVICE", "TPU")  # PyTorch/XLA on a real TPU: a TPU's figures apply
    assert _policy_of("xla")["on_tpu"] and _policy_of("xla")["default_model"] == "e2b"
    assert tpu["bandwidth"] == _policy_of("xla")["bandwidth"] == "published: TPU v5e, 819 GB/s"


def test_no_module_notebook_benchmark_or_test_branches_on_the_backend_s_name():
    """Backend policy is decided in backend.py: elsewhere a backend is asked what it does
    (``backend.lazy``, ``backend.on_tpu``...), never compared by name."""
    import pathlib
    import re

    root = pathlib.Path(__file__).parent.parent
    branch = re.compile(r"\bbackend\.name\s*(==|!=|in\b|not\s+in\b)")
    files = [*root.glob("helpers/**/*.py"), *root.glob("notebooks/*.py"), *root.glob("benchmarks/*.py")]
    files += [*root.glob("tests/*.py")]  # tests ask a backend too; test_backend.py tests the backend itself
    found = [
        f"{f.relative_to(root)}:{i}"
        for f in files
        if f.name not in ("backend.py", "test_backend.py")
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if branch.search(line)
    ]
    assert len(files) > 30 and not found, found


def test_the_int4_kernel_is_torchs_where_it_has_one(monkeypatch):
    """torch's CPU int4 kernel on a CPU, its CUDA one from sm80 (an A100, an L4) and none on a T4 (sm75), a TPU or
    PyTorch/XLA: there the 4-bit linears are dequantized in the step."""
    from helpers.backend import Backend

    def kernel(name):
        backend = object.__new__(Backend)
        backend.name, backend.device = name, torch.device("cpu")
        return backend.int4_kernel

    assert [kernel(n) for n in ("tpu", "xla", "cpu")] == [None, None, "cpu"]
    for capability, expected in (((7, 5), None), ((8, 0), "cuda"), ((8, 9), "cuda")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert kernel("cuda") == expected, capability


def test_torchtpus_eager_mode_as_0_2_0_scopes_it_and_as_an_earlier_setter_it_is_put_back(monkeypatch):
    """Read in TorchTPU's sources: 0.2.0's ``set_eager_mode`` is a context manager, an earlier one a setter with
    ``get_eager_mode`` beside it. No TPU here: a stand-in ``torch.tpu`` of each kind (``raising=False``: torch has none)."""
    import contextlib
    import types

    from helpers.backend import Backend

    def backend():
        made = object.__new__(Backend)
        made.name = "tpu"
        return made

    seen = []
    modes = types.SimpleNamespace(DEFER_AND_FUSE="fuse", DEFER_NEVER="never")

    @contextlib.contextmanager
    def scoped(mode):
        seen.append(("enter", mode))
        yield
        seen.append(("exit", mode))

    monkeypatch.setattr(torch, "tpu", types.SimpleNamespace(EagerMode=modes, set_eager_mode=scoped), raising=False)
    with backend().mode("defer_and_fuse"):
        seen.append("block")
    assert seen == [("enter", "fuse"), "block", ("exit", "fuse")]

    current = ["never"]
    setter = types.SimpleNamespace(
        EagerMode=modes, get_eager_mode=lambda: current[0], set_eager_mode=lambda mode: current.__setitem__(0, mode)
    )
    monkeypatch.setattr(torch, "tpu", setter, raising=False)
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.1.1")
    with pytest.warns(UserWarning, match="torch_tpu 0.1.1: set_eager_mode is a setter there"):
        with backend().mode("defer_and_fuse"):
            assert current == ["fuse"]
    assert current == ["never"]


def test_torchtpus_eager_mode_is_set_once_for_the_process_where_the_backend_is_made(monkeypatch):
    """Strict eager, set by the backend itself: through 0.2.0's ``eager_mode`` property (its ``set_eager_mode`` is a
    scope, a bare call of which sets nothing), or an earlier wheel's setter. Stand-ins of each, as above."""
    import types

    from helpers.backend import Backend

    modes = types.SimpleNamespace(DEFER_AND_FUSE="fuse", DEFER_NEVER="never")
    wheel = types.SimpleNamespace(EagerMode=modes, eager_mode="fuse", set_eager_mode=lambda mode: None)
    monkeypatch.setattr(torch, "tpu", wheel, raising=False)
    with pytest.raises(RuntimeError, match="tpu"):  # torch here has no "tpu" device: the mode is set before it is made
        Backend("tpu")
    assert wheel.eager_mode == "never"
    current = ["fuse"]
    earlier = types.SimpleNamespace(
        EagerMode=modes, get_eager_mode=lambda: current[0], set_eager_mode=lambda mode: current.__setitem__(0, mode)
    )
    monkeypatch.setattr(torch, "tpu", earlier, raising=False)
    with pytest.raises(RuntimeError, match="tpu"):
        Backend("tpu")
    assert current == ["never"]
