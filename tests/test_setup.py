from helpers import setup


def test_pins_are_read_from_requirements():
    pins = setup._pins()
    assert pins["torch"] == "2.13.0" and "transformers" in pins and "compressed-tensors" in pins


def test_outside_colab_nothing_required_is_missing_and_nothing_is_installed(capsys, monkeypatch):
    monkeypatch.setattr(setup.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("pip ran")))
    setup.install_missing()
    out = capsys.readouterr().out
    assert out.startswith("all requirements present") or out.startswith("missing")
    assert setup.missing(colab=False) == []
