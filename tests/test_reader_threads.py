"""What a reader runs, with a reader's threads: tests run one thread per worker, readers do not.
Notebook 06's grouped attention and its check, taken from the notebook itself, in a fresh Python with
two threads, where two programs sum in another order than with one."""

import os
import pathlib
import subprocess
import sys

import jupytext

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "06_ring_cache.py"


def tagged_cell(path: pathlib.Path, tag: str) -> str:
    """The source of the notebook's one code cell tagged ``tag``."""
    cells = [c for c in jupytext.read(path).cells if tag in c.metadata.get("tags", [])]
    assert len(cells) == 1 and cells[0].cell_type == "code", f"{path.name}: {len(cells)} cells tagged {tag}"
    return cells[0].source


def test_notebook_06s_grouped_attention_check_passes_with_two_threads():
    prelude = (
        "import torch, helpers\n"
        "from transformers import Gemma4ForCausalLM, Gemma4TextConfig\n"
        "from helpers.course import offline\n"
        "assert torch.get_num_threads() == 2, torch.get_num_threads()\n"
        "torch.manual_seed(0)\n"
        "model = Gemma4ForCausalLM(Gemma4TextConfig(**offline.TEXT_CONFIG)).eval()  # the twin's class and shapes\n"
        "config = model.config.get_text_config()\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            prelude
            + tagged_cell(NOTEBOOK, "grouped-attention")
            + "\n"
            + tagged_cell(NOTEBOOK, "grouped-attention-check"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("largest difference from transformers' SDPA") == 2, run.stdout
