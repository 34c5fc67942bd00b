"""The install plan against Colab-like runtimes, and the notebooks' set-up cell run for real."""

import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest

import helpers
from helpers import course, setup

PINS = setup.pins()
ROOT = pathlib.Path(__file__).resolve().parent.parent
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


def test_pins_are_read_from_requirements():
    assert PINS["torch"] == "2.13.0" and "transformers" in PINS and "compressed-tensors" in PINS


def test_outside_colab_only_what_is_missing_is_listed():
    installed = {n: "0.0.1" for n in PINS if n != "tqdm"}  # every pin at a wrong version, tqdm missing
    assert setup.plan(installed, PINS, tpu=False, colab=False) == setup.Plan(install=[f"tqdm=={PINS['tqdm']}"])
    assert not setup.plan(setup.installed_versions(), PINS, tpu=False, colab=False)  # this test environment


def test_colab_cpu_runtime_keeps_its_torch_and_the_versions_that_will_do():
    todo = setup.plan({**COLAB, "torch": "2.8.0+cu126", "torchvision": "0.23.0"}, PINS, tpu=False, colab=True)
    assert todo.torch is None and todo.uninstall == []
    names = [r.split("==")[0] for r in todo.install]
    assert not {"matplotlib", "ipywidgets", "tqdm", "torch", "torchvision"} & set(names)
    assert (
        f"transformers=={PINS['transformers']}" in todo.install
        and f"compressed-tensors=={PINS['compressed-tensors']}" in todo.install
    )


def test_colab_tpu_with_an_older_torch_moves_torch_and_removes_its_companions():
    todo = setup.plan(
        {**COLAB, "torch": "2.8.0+cpu", "torchvision": "0.23.0+cpu", "torchaudio": "2.8.0+cpu"},
        PINS,
        tpu=True,
        colab=True,
    )
    assert todo.torch == f"torch=={PINS['torch']}"
    assert todo.uninstall == ["torchvision", "torchaudio"]
    assert ["torch_tpu==0.2.0", "libtpu==0.0.52"] == todo.install[-2:]


@pytest.mark.parametrize("torch", ["2.15.1", "2.16.0", "2.10.2+cpu", "2.16.0.dev20261001"])
def test_colab_tpu_with_a_torch_torchtpu_refuses_moves_it(torch):
    assert setup.plan({"torch": torch}, PINS, tpu=True, colab=True).torch == f"torch=={PINS['torch']}"


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
    todo = setup.plan({**COLAB, "ipywidgets": "7.5.0"}, PINS, tpu=False, colab=True)
    assert f"ipywidgets=={PINS['ipywidgets']}" in todo.install


def test_a_restart_is_asked_for_when_the_plan_changes_what_was_imported():
    todo = setup.plan({**COLAB, "torch": "2.8.0"}, PINS, tpu=True, colab=True)
    assert todo.stale({"os", "sys"}) == []
    assert todo.stale({"torch"}) == ["torch"]
    assert "transformers" in todo.stale({"transformers"})
    torch_tpu_only = setup.Plan(install=["torch_tpu==0.2.0"])
    assert torch_tpu_only.stale({"torch"}) == ["torch"]  # its import hook registers at `import torch`


def test_install_missing_runs_pip_in_that_order_and_raises_for_a_restart(monkeypatch, capsys):
    import torch  # noqa: F401  (the runtime has imported the torch the plan replaces)

    calls = []
    monkeypatch.setattr(setup, "_pip", lambda *args: calls.append(args))
    monkeypatch.setattr(setup, "installed_versions", lambda: {**COLAB, "torch": "2.8.0", "torchvision": "0.23.0"})
    monkeypatch.setattr(setup, "tpu_chips", lambda: ["v5e"])
    monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
    with pytest.raises(setup.RestartNeeded, match="restart"):
        setup.install_missing()
    assert [c[0] for c in calls] == ["uninstall", "install", "install"]
    assert calls[1][2:] == (f"torch=={PINS['torch']}", "--index-url", setup.TORCH_CPU_INDEX)
    assert "setting up: remove torchvision; install torch==" in capsys.readouterr().out


def test_tpu_chips_by_device_id_not_by_vendor(tmp_path):
    def pci(name, vendor, device):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "device").write_text(device + "\n")

    pci("0000:00:04.0", "0x1ae0", "0x0042")  # Google's gVNIC network card
    pci("0000:00:05.0", "0x1af4", "0x1041")  # virtio
    assert helpers.tpu_chips(str(tmp_path)) == []
    pci("0000:00:06.0", "0x1ae0", "0x0063")
    assert helpers.tpu_chips(str(tmp_path)) == ["v5e"]


def test_a_tpu_machine_without_torchtpu_raises_instead_of_running_on_cpu(monkeypatch):
    from helpers import backend

    monkeypatch.delenv("HELPERS_BACKEND", raising=False)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(backend, "tpu_chips", lambda: ["v5e"])
    with pytest.raises(backend.BackendError, match="TorchTPU did not come up.*HELPERS_BACKEND=cpu"):
        backend.get_backend()
    assert backend.get_backend("cpu").name == "cpu"


# --- the repository's name in one place, and the set-up cell -----------------------------------
def test_badges_and_set_up_cells_agree_with_helpers_course():
    assert course.mismatches() == []


def test_a_fork_rewrites_badges_and_set_up_cells_from_one_name(tmp_path, monkeypatch):
    import shutil

    (tmp_path / "notebooks").mkdir()
    for path in course.NOTEBOOKS:
        for twin in (path, path.with_suffix(".ipynb")):
            shutil.copy(twin, tmp_path / "notebooks" / twin.name)
    shutil.copy(course.README, tmp_path / "README.md")
    monkeypatch.setattr(course, "README", tmp_path / "README.md")
    monkeypatch.setattr(course, "NOTEBOOKS", sorted((tmp_path / "notebooks").glob("*.py")))
    monkeypatch.setattr(course, "GITHUB", "someone/fork")
    assert course.mismatches()  # the copy still names the original
    course.write()
    assert course.mismatches() == []
    assert "colab.research.google.com/github/someone/fork/blob/main/notebooks/" in (tmp_path / "README.md").read_text()
    assert "https://github.com/someone/fork" in (tmp_path / "notebooks" / "01_execution_modes.ipynb").read_text()


def test_every_notebook_has_the_set_up_cell_and_colab_tpu_metadata():
    import jupytext

    for path in course.NOTEBOOKS:
        assert course.notebook_setup_cell(path.read_text()) == course.setup_cell(), path.name
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
    code = "import google.colab\n" + course.setup_cell()
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
    first = _run_setup_cell(env, tmp_path)
    assert first.returncode == 0, first.stderr
    assert "fetched" in first.stdout and (tmp_path / "course" / "helpers" / "__init__.py").exists()
    second = _run_setup_cell(env, tmp_path)  # a new process: what a runtime restart leaves
    assert second.returncode == 0, second.stderr
    assert "fetched" not in second.stdout and "all requirements present" in second.stdout


def test_an_unreachable_course_repository_says_how_to_set_course_repo(tmp_path):
    env = {"COURSE_REPO": str(tmp_path / "no-such-repo"), "COURSE_DIR": str(tmp_path / "course")}
    run = _run_setup_cell(env, tmp_path)
    assert run.returncode == 1
    assert "could not fetch the course" in run.stderr and "COURSE_REPO" in run.stderr
    assert "Traceback" not in run.stderr
