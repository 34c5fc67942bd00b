"""The notebooks checked end to end by nbval (``pytest -m reader --nbval-lax notebooks tests``): each runs in a kernel
of its own, in order, with the machine's default threads, as a reader runs it; the cells marked
``# NBVAL_CHECK_OUTPUT`` must print what the committed notebook shows. Their rows go to a fresh run folder,
``runs/nbval``, where ``tests/test_tour.py`` makes the table and the charts of them."""

import os
import pathlib
import shutil

import pytest

from helpers.course.results import RUN_DIR_VAR

RUN_DIR = pathlib.Path(__file__).resolve().parent / "runs" / "nbval"


def pytest_configure(config):
    if getattr(config.option, "nbval_lax", False) and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.option.nbval_current_env = True  # this environment's kernel, whatever kernels the machine lists
        shutil.rmtree(RUN_DIR, ignore_errors=True)  # this run's rows only
        RUN_DIR.mkdir(parents=True)
        os.environ[RUN_DIR_VAR] = str(RUN_DIR)  # the kernels inherit it: every notebook appends its rows here


def pytest_collection_modifyitems(config, items):
    for item in items:
        if type(item).__module__.startswith("nbval"):
            item.add_marker(pytest.mark.reader)  # a reader's run: what `-m reader` selects
