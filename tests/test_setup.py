"""The install plan against Colab's published TPU runtime and older ones, pip shown, TPU
detection as TorchTPU's wheel does it, and the notebooks' set-up cell run for real."""

import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import urllib.parse

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import helpers
from helpers.course import setup
from tools import publish

PINS = setup.pins()
ROOT = pathlib.Path(__file__).resolve().parent.parent
TEST_ONLY = setup.pins(ROOT / "requirements.txt").keys() - PINS.keys()
XLA_PINS = setup.pins(setup.XLA_REQUIREMENTS)
# what a Colab runtime brings (versions of the kind it has), less what the course pins
COLAB = {
    "matplotlib": "3.10.0",
    "ipywidgets": "7.7.1",
    "tqdm": "4.67.1",
    "transformers": "4.57.1",
    "accelerate": "1.10.1",
    "safetensors": "0.6.2",
    "tokenizers": "0.22.1",
}
# Imported by Colab's kernel before the first cell runs: replacing one asks for a restart.
IMPORTED_AT_START = {"ipywidgets", "matplotlib", "tqdm", "ipykernel", "ipython", "pyzmq", "traitlets", "tornado"}


def freeze(path: pathlib.Path) -> dict[str, str]:
    """``pip freeze``'s lines as name: version; a ``name @ URL`` line's version is read from
    the wheel's or the sdist's file name (Colab installs torch and its companions that way)."""
    out = {}
    for line in path.read_text().splitlines():
        if "==" in line:
            name, version = line.split("==")
        elif " @ " in line:
            name, url = line.split(" @ ")
            file = urllib.parse.unquote(url.split("#")[0].rsplit("/", 1)[1])
            found = re.match(r"[^-]+-([^-]+?)(?:-|\.tar\.gz$|\.zip$)", file)
            if found is None:  # a git checkout names no version
                continue
            version = found.group(1)
        else:
            continue
        out[name.strip()] = version.strip()
    return out


COLAB_TPU_2026_08_19 = freeze(ROOT / "tests" / "colab_tpu_runtime" / "pip-freeze.tpu.txt")
PY313 = (3, 13)  # os-info-tpu.txt: Python 3.13.15


def test_pins_are_read_from_the_notebooks_requirements_and_the_test_tools_are_apart():
    assert PINS["torch"] == "2.13.0" and "transformers" in PINS and "compressed-tensors" in PINS
    assert {"pytest", "pytest-xdist", "nbclient", "jupytext", "hypothesis", "ruff"} <= TEST_ONLY


def test_the_published_set_reads_as_colab_says():
    have = COLAB_TPU_2026_08_19
    assert have["torch"] == "2.9.0+cpu" and have["torch-xla"] == "2.9.0" and have["torchcodec"] == "0.8.0"
    assert have["libtpu"] == "0.0.21.1" and have["ipywidgets"] == "7.7.1" and have["google-colab"] == "1.0.0"


def test_on_colabs_published_tpu_runtime_the_plan_moves_only_what_it_must():
    todo = setup.plan(COLAB_TPU_2026_08_19, PINS, tpu=True, colab=True, python=PY313, ranged=setup.ranges())
    assert todo.torch == f"torch=={PINS['torch']}+cpu"
    assert setup.TORCH_TPU_TORCH.contains(PINS["torch"])  # a torch TorchTPU accepts
    assert todo.uninstall == ["torchvision", "torchaudio", "torchcodec", "torch_xla"]  # companions, then PyTorch/XLA
    names = {setup._norm(r.split("==")[0]) for r in todo.install}
    assert {"torch-tpu", "libtpu"} <= names
    assert not names & {setup._norm(n) for n in TEST_ONLY}  # nothing only tests use
    assert not names & IMPORTED_AT_START  # nothing the runtime imported at start
    # nothing else: the model path at the tested versions (tokenizers moves with transformers anyway;
    # huggingface_hub would move to 2.x with it, where the runtime's datasets takes <2.0)
    assert names == {
        "transformers",
        "compressed-tensors",
        "accelerate",
        "tokenizers",
        "huggingface-hub",
        "torch-tpu",
        "libtpu",
    }
    assert "filelock" not in names  # 3.32.3 will do: only FileLock is used
    assert todo.constraints == ["setuptools<82,>=77.0.3"]  # held on every pip call


def _installed_requirement(distribution: str, on: str) -> SpecifierSet:
    """What the installed ``distribution`` (here at the version the course pins) asks of ``on``."""
    import importlib.metadata

    for line in importlib.metadata.requires(distribution):
        req = Requirement(line)
        if setup._norm(req.name) == on and req.marker is None:
            return req.specifier
    raise AssertionError(f"{distribution} asks nothing of {on}")


def test_on_the_freeze_setuptools_keeps_pkg_resources_and_meets_the_new_torch():
    todo = setup.plan(COLAB_TPU_2026_08_19, PINS, tpu=True, colab=True, python=PY313, ranged=setup.ranges())
    assert todo.torch and COLAB_TPU_2026_08_19["setuptools"] == "75.2.0"
    held = SpecifierSet(setup.ranges()["setuptools"])
    torch_needs = _installed_requirement("torch", "setuptools")  # torch 2.13.0: >=77.0.3, above the runtime's
    assert not torch_needs.contains(COLAB_TPU_2026_08_19["setuptools"])  # so pip moves it, inside `held`
    assert not held.contains("82.0.0") and not held.contains("84.2.1")  # 82 dropped pkg_resources
    assert any(held.contains(v) and torch_needs.contains(v) for v in ("77.0.3", "80.9.0", "81.0.0"))


def _runtime_requires() -> list[tuple[str, Requirement]]:
    """The freeze's packages' requirements on what the plan moves, recorded from their wheels."""
    lines = (ROOT / "tests" / "colab_tpu_runtime" / "requires-dist.txt").read_text().splitlines()
    return [(ln.split(": ")[0], Requirement(ln.split(": ")[1])) for ln in lines if ln and not ln.startswith("#")]


def test_on_the_freeze_huggingface_hub_meets_the_runtimes_datasets_and_the_pinned_transformers():
    todo = setup.plan(COLAB_TPU_2026_08_19, PINS, tpu=True, colab=True, python=PY313, ranged=setup.ranges())
    planned = {setup._norm(Requirement(r).name): Requirement(r) for r in todo.install}
    hub = next(iter(planned["huggingface-hub"].specifier)).version
    recorded = _runtime_requires()
    assert ("datasets==4.8.5", Requirement("huggingface-hub<2.0,>=0.25.0")) in recorded
    for who, req in recorded:
        name, version = who.split("==")
        assert COLAB_TPU_2026_08_19[name] == version and setup._norm(name) not in planned  # left as it is
        assert req.specifier.contains(hub), f"{who} asks {req}, the plan installs {hub}"
    assert _installed_requirement("transformers", "huggingface-hub").contains(hub)  # transformers 5.24.0


def test_without_a_tpu_colabs_runtime_keeps_its_torch_and_gets_a_compressed_tensors_for_it():
    todo = setup.plan(COLAB_TPU_2026_08_19, PINS, tpu=False, colab=True, python=PY313)
    assert todo.torch is None and todo.uninstall == []
    assert f"compressed-tensors=={XLA_PINS['compressed-tensors']}" in todo.install  # 0.16+ need torch >= 2.10


@pytest.mark.parametrize("python", [(3, 11), (3, 12)])
@pytest.mark.parametrize("torch", ["2.6.0+cu124", "2.7.1", "2.8.0+cpu", "2.9.0"])
def test_older_runtimes_get_a_consistent_plan(python, torch):
    runtime = {**COLAB, "torch": torch, "torchvision": "0.2x", "torchaudio": "2.x"}
    on_tpu = setup.plan(runtime, PINS, tpu=True, colab=True, python=python)
    assert on_tpu.torch == f"torch=={PINS['torch']}+cpu" and on_tpu.uninstall == ["torchvision", "torchaudio"]
    assert f"compressed-tensors=={PINS['compressed-tensors']}" in on_tpu.install  # beside the new torch
    elsewhere = setup.plan(runtime, PINS, tpu=False, colab=True, python=python)
    assert elsewhere.torch is None and elsewhere.uninstall == []
    assert f"compressed-tensors=={XLA_PINS['compressed-tensors']}" in elsewhere.install


def test_a_python_torchtpu_has_no_wheel_for_is_refused_with_the_versions():
    with pytest.raises(setup.SetupError, match="Python 3.11 to 3.14.*Python 3.10"):
        setup.plan(COLAB, PINS, tpu=True, colab=True, python=(3, 10))


def test_outside_colab_only_what_is_missing_is_listed():
    installed = {n: "0.0.1" for n in PINS if n != "tqdm"}  # every pin at a wrong version, tqdm missing
    assert setup.plan(installed, PINS, tpu=False, colab=False) == setup.Plan(install=[f"tqdm=={PINS['tqdm']}"])
    assert not setup.plan(setup.installed_versions(), PINS, tpu=False, colab=False)  # this test environment


def test_colab_cpu_runtime_keeps_its_torch_and_the_versions_that_will_do():
    todo = setup.plan({**COLAB, "torch": "2.10.0+cu126", "torchvision": "0.25.0"}, PINS, tpu=False, colab=True)
    assert todo.torch is None and todo.uninstall == []
    names = [r.split("==")[0] for r in todo.install]
    assert not {"matplotlib", "ipywidgets", "tqdm", "torch", "torchvision"} & set(names)
    assert (
        f"transformers=={PINS['transformers']}" in todo.install
        and f"compressed-tensors=={PINS['compressed-tensors']}" in todo.install
    )


@pytest.mark.parametrize("torch", ["2.15.1", "2.16.0", "2.10.2+cpu", "2.16.0.dev20261001"])
def test_colab_tpu_with_a_torch_torchtpu_refuses_moves_it(torch):
    assert setup.plan({"torch": torch}, PINS, tpu=True, colab=True).torch == f"torch=={PINS['torch']}+cpu"


@pytest.mark.parametrize("torch", ["2.11.0", "2.13.0+cpu", "2.15.0"])
def test_colab_tpu_with_a_supported_torch_keeps_it_and_its_companions(torch):
    todo = setup.plan({"torch": torch, "torchvision": "0.2x", "torchaudio": "2.x"}, PINS, tpu=True, colab=True)
    assert todo.torch is None and todo.uninstall == []


def test_torch_xla_is_removed_beside_torchtpu_and_a_present_torchtpu_is_kept():
    installed = {**{n: v for n, v in PINS.items()}, "torch_xla": "2.9.0", "torch-tpu": "0.2.0", "libtpu": "0.0.52"}
    todo = setup.plan(installed, PINS, tpu=True, colab=True)
    assert todo == setup.Plan(uninstall=["torch_xla"])
    assert setup.plan({**installed, "libtpu": "0.0.53"}, PINS, tpu=True, colab=True).install == ["libtpu==0.0.52"]


def test_a_runtime_version_that_will_not_do_is_replaced():
    todo = setup.plan({**COLAB, "ipywidgets": "7.5.0", "filelock": "2.0.0"}, PINS, tpu=False, colab=True)
    assert f"ipywidgets=={PINS['ipywidgets']}" in todo.install and f"filelock=={PINS['filelock']}" in todo.install


def test_a_restart_is_asked_for_when_the_plan_changes_what_was_imported():
    todo = setup.plan({**COLAB, "torch": "2.8.0"}, PINS, tpu=True, colab=True)
    names = setup.import_names()  # this environment's: transformers is imported as transformers

    def stale(plan, modules):
        return setup.stale_imports(set(plan.changed()), modules, names)

    assert stale(todo, {"os", "sys"}) == []
    assert stale(todo, {"torch", "torch.nn"}) == ["torch"]
    assert "transformers" in stale(todo, {"transformers.models"})
    torch_tpu_only = setup.Plan(install=["torch_tpu==0.2.0"])
    assert stale(torch_tpu_only, {"torch"}) == ["torch"]  # its import hook registers at `import torch`


def test_the_restart_is_decided_from_real_import_names():
    names = setup.import_names()
    assert "zmq" in names["pyzmq"] and "yaml" in names["pyyaml"]  # a distribution's name is not its module's
    assert setup.stale_imports({"pyzmq"}, {"zmq", "zmq.sugar"}, names) == ["pyzmq"]
    assert setup.stale_imports({"pyzmq"}, {"pyzmq"}, names) == []  # no module of that name exists
    assert setup.stale_imports({"new-package"}, {"new_package"}, {}) == []  # never installed: never imported


def test_install_missing_runs_pip_in_order_says_what_else_moved_and_raises_for_a_restart(monkeypatch, capsys):
    import torch  # noqa: F401  (the runtime has imported the torch the plan replaces)

    calls = []
    before = {**COLAB, "torch": "2.8.0", "torchvision": "0.23.0", "pyzmq": "26.2.1"}
    after = {**before, "torch": "2.13.0+cpu", "pyzmq": "27.1.0", "tensorboard": "2.20.0"}
    after.pop("torchvision")
    versions = iter([before, before, after])
    monkeypatch.setattr(setup, "_pip", lambda *args: calls.append(args))
    monkeypatch.setattr(setup, "installed_versions", lambda: next(versions))
    monkeypatch.setattr(setup, "import_names", lambda: {"pyzmq": {"zmq"}, "torch": {"torch"}})
    monkeypatch.setattr(setup, "pip_check", lambda changed: (["datasets 4.8.5 has requirement x"], 2))
    monkeypatch.setattr(setup, "unmatched_extras", lambda changed: [])
    monkeypatch.setattr(setup, "tpu_chips", lambda: ["v5e"])
    monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
    monkeypatch.setitem(sys.modules, "zmq", type(sys)("zmq"))  # the kernel's own, which pip moved below
    with pytest.raises(setup.RestartNeeded, match=r"already imported \(pyzmq, torch\)"):
        setup.install_missing()
    assert [c[0] for c in calls] == ["uninstall", "install", "install"]
    assert calls[1][1:4] == (f"torch=={PINS['torch']}+cpu", "--extra-index-url", setup.TORCH_CPU_INDEX)
    assert calls[1][4] == calls[2][-2] == "-c"  # the tested ranges held on every install
    assert pathlib.Path(calls[1][5]).read_text().split() == [f"setuptools{setup.ranges()['setuptools']}"]
    out = capsys.readouterr().out
    assert "setting up: remove torchvision; install torch==" in out
    assert "also moved (pip, for what was installed): pyzmq 26.2.1 -> 27.1.0, +tensorboard 2.20.0" in out
    assert "no longer matches in this runtime: datasets 4.8.5 has requirement x (2 mismatch(es)" in out


def test_pip_is_shown_as_it_runs_and_a_failure_raises_with_its_last_lines(capsys):
    setup._pip("--version")
    assert re.search(r"^  pip \d", capsys.readouterr().out, re.M)
    with pytest.raises(setup.SetupError, match=r"(?s)pip install .* failed \(exit 1\); its last lines:\n.*no-such-pkg"):
        setup._pip("install", "--no-index", "--no-deps", "no-such-pkg-for-the-course==1.0")


def test_what_else_moved_leaves_out_what_the_plan_named():
    todo = setup.Plan(torch="torch==2.13.0+cpu", install=["transformers==5.24.0"], uninstall=["torchvision"])
    before = {"torch": "2.9.0", "torchvision": "0.24", "transformers": "5.15.0", "absl-py": "1.4.0", "x": "1"}
    after = {"torch": "2.13.0", "transformers": "5.24.0", "absl-py": "2.3.1", "tensorboard": "2.20.0"}
    assert setup.moved(before, after, todo) == ["absl-py 1.4.0 -> 2.3.1", "+tensorboard 2.20.0", "-x"]


def test_an_extra_that_pins_a_moved_package_is_named(monkeypatch):
    jax = type("Dist", (), {"metadata": {"Name": "jax"}, "version": "0.7.2"})()
    jax.requires = ['libtpu==0.0.23; extra == "tpu"', "numpy>=2.0", 'pytest; extra == "ci"']
    monkeypatch.setattr(setup.importlib.metadata, "distributions", lambda: [jax])
    monkeypatch.setattr(setup, "installed_versions", lambda: {"libtpu": "0.0.52", "numpy": "1.0", "pytest": "1"})
    assert setup.unmatched_extras({"libtpu", "numpy"}) == ["jax 0.7.2 [tpu] wants libtpu==0.0.23, now 0.0.52"]
    assert setup.unmatched_extras({"numpy"}) == []  # not an extra: pip check's to report


def test_the_restart_stop_is_one_line_in_ipython(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        setup._one_line_in_ipython(setup.RestartNeeded)
        shell.user_ns["setup"] = setup
        result = shell.run_cell("raise setup.RestartNeeded('restart it (Runtime > Restart session)')")
    finally:
        shell.set_custom_exc((), None)
        InteractiveShell.clear_instance()
    assert isinstance(result.error_in_exec, setup.RestartNeeded)  # the cell failed: Run all stops there
    err = capsys.readouterr()
    assert err.err == "restart it (Runtime > Restart session)\n" and "Traceback" not in err.out + err.err
    assert "To exit" not in err.out + err.err


def _sysfs(tmp_path, name, vendor, device, group=None):
    path = tmp_path / "pci" / name
    path.mkdir(parents=True)
    (path / "vendor").write_text(vendor + "\n")
    (path / "device").write_text(device + "\n")
    if group:
        (tmp_path / "iommu" / group).mkdir(parents=True, exist_ok=True)
        (path / "iommu_group").symlink_to(tmp_path / "iommu" / group)


def test_tpu_chips_as_torchtpu_finds_them_by_device_id_and_vfio(tmp_path):
    (tmp_path / "vfio").mkdir()
    scan = lambda: helpers.tpu_scan(str(tmp_path / "pci"), str(tmp_path / "vfio"))  # noqa: E731
    _sysfs(tmp_path, "0000:00:04.0", "0x1ae0", "0x0042")  # Google's gVNIC network card
    _sysfs(tmp_path, "0000:00:05.0", "0x1af4", "0x1041")  # virtio
    assert scan() == ([], [])
    _sysfs(tmp_path, "0000:00:06.0", "0x1ae0", "0x0063", group="12")
    chips, not_driven = scan()
    assert chips == [] and not_driven == ["0000:00:06.0: TPU v5e without /dev/vfio/12, which TorchTPU needs"]
    (tmp_path / "vfio" / "12").touch()
    assert scan() == (["v5e"], [])
    _sysfs(tmp_path, "0000:00:07.0", "0x1ae0", "0x0027", group="13")  # not in TorchTPU 0.2.0's table
    (tmp_path / "vfio" / "13").touch()
    chips, not_driven = scan()
    assert chips == ["v5e"] and "TorchTPU 0.2.0 does not drive" in not_driven[0]
    assert set(helpers.TPU_PCI_DEVICES) == {"0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}  # the wheel's table


def test_a_tpu_torchtpu_cannot_drive_is_named_when_the_backend_is_picked(monkeypatch):
    from helpers import backend

    monkeypatch.delenv("HELPERS_BACKEND", raising=False)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(backend, "tpu_scan", lambda: ([], ["0000:00:06.0: TPU v5e without /dev/vfio/12"]))
    with pytest.warns(UserWarning, match="TorchTPU cannot drive.*without /dev/vfio/12"):
        assert backend.get_backend().name in ("cpu", "cuda")


def test_a_tpu_machine_without_torchtpu_raises_instead_of_running_on_cpu(monkeypatch):
    from helpers import backend

    monkeypatch.delenv("HELPERS_BACKEND", raising=False)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(backend, "tpu_scan", lambda: (["v5e"], []))
    with pytest.raises(backend.BackendError, match="TorchTPU did not come up.*HELPERS_BACKEND=cpu"):
        backend.get_backend()
    assert backend.get_backend("cpu").name == "cpu"


# --- the repository's name in one place, and the set-up cell -----------------------------------
def test_badges_and_set_up_cells_agree_with_tools_publish():
    assert publish.mismatches() == []


def test_a_fork_rewrites_badges_and_set_up_cells_from_one_name(tmp_path, monkeypatch):
    import shutil

    (tmp_path / "notebooks").mkdir()
    for path in publish.NOTEBOOKS:
        for twin in (path, path.with_suffix(".ipynb")):
            shutil.copy(twin, tmp_path / "notebooks" / twin.name)
    shutil.copy(publish.README, tmp_path / "README.md")
    monkeypatch.setattr(publish, "README", tmp_path / "README.md")
    monkeypatch.setattr(publish, "NOTEBOOKS", sorted((tmp_path / "notebooks").glob("*.py")))
    monkeypatch.setattr(publish, "GITHUB", "someone/fork")
    assert publish.mismatches()  # the copy still names the original
    publish.write()
    assert publish.mismatches() == []
    assert "colab.research.google.com/github/someone/fork/blob/main/notebooks/" in (tmp_path / "README.md").read_text()
    assert "https://github.com/someone/fork" in (tmp_path / "notebooks" / "01_execution_modes.ipynb").read_text()


def test_every_notebook_has_the_set_up_cell_and_colab_tpu_metadata():
    import jupytext

    for path in publish.NOTEBOOKS:
        assert publish.notebook_setup_cell(path.read_text()) == publish.setup_cell(), path.name
        for twin in (path, path.with_suffix(".ipynb")):  # the source keeps it through jupytext --sync
            metadata = jupytext.read(twin).metadata
            assert metadata.get("accelerator") == "TPU" and metadata.get("colab", {}).get("gpuType") == "V5E1", (
                twin.name
            )


def _run_setup_cell(env_extra: dict, tmp_path) -> subprocess.CompletedProcess:
    """The set-up cell in a fresh Python that has the course's requirements but not `helpers`
    (no site hooks, so the editable install is not seen) and a stub `google.colab`."""
    stub = tmp_path / "stub"
    (stub / "google" / "colab").mkdir(parents=True, exist_ok=True)
    (stub / "google" / "__init__.py").write_text("")
    (stub / "google" / "colab" / "__init__.py").write_text("")
    site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub), *site]), "PIP_NO_INDEX": "1", **env_extra}
    env.pop("HELPERS_BACKEND", None)
    code = "import google.colab\n" + publish.setup_cell()
    return subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )


def test_the_set_up_cell_runs_twice_as_after_a_restart(tmp_path):
    origin = tmp_path / "origin"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(origin)], check=True)
    branch = subprocess.run(
        ["git", "-C", str(origin), "branch", "--show-current"], capture_output=True, text=True, check=True
    ).stdout.strip()
    env = {"COURSE_REPO": str(origin), "COURSE_REF": branch, "COURSE_DIR": str(tmp_path / "course")}
    # a reader's own helpers.py in the working folder, first on the path as /content is in Colab
    (tmp_path / "helpers.py").write_text("raise SystemExit('the stray helpers.py was imported')\n")
    first = _run_setup_cell(env, tmp_path)
    assert first.returncode == 0, first.stderr
    assert "fetched" in first.stdout and (tmp_path / "course" / "helpers" / "__init__.py").exists()
    assert f"the course: {tmp_path / 'course'}\n" in first.stdout
    second = _run_setup_cell(env, tmp_path)  # a new process: what a runtime restart leaves
    assert second.returncode == 0, second.stderr
    assert "fetched" not in second.stdout and "all requirements present" in second.stdout
    assert "Plan(" not in first.stdout + second.stdout


def test_an_unreachable_course_repository_says_how_to_set_course_repo(tmp_path):
    env = {"COURSE_REPO": str(tmp_path / "no-such-repo"), "COURSE_DIR": str(tmp_path / "course")}
    run = _run_setup_cell(env, tmp_path)
    assert run.returncode == 1
    assert "could not fetch the course" in run.stderr and "COURSE_REPO" in run.stderr
    assert "Traceback" not in run.stderr
