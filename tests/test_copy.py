"""Each lesson module copied alone, with the earlier lessons it imports, into an empty folder
under another package name, runs a small example in a fresh interpreter: what a reader does who
copies one into an experiment. Only the lesson libraries and the twin's folder are at hand; the
course's own package must not be imported on the way."""

import ast
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
from test_layout import LESSONS, _helpers_imports

from helpers.course import offline

ROOT = pathlib.Path(__file__).parent.parent / "helpers"
# A model of the twin's class and shapes (random weights) and the twin's tokenizer, by transformers
# alone: no lesson needed for them
TWIN = """
from transformers import AutoTokenizer, Gemma4ForCausalLM, Gemma4TextConfig
torch.manual_seed(0)
model = Gemma4ForCausalLM(Gemma4TextConfig(**CONFIG)).eval()
tok = AutoTokenizer.from_pretrained(FOLDER)
ids = torch.tensor([[tok.bos_token_id] + tok.encode("Explain why compilation matters", add_special_tokens=False)])
"""
EXAMPLES = {
    "chips": "assert lessons.chips.tpu_scan('/no/sysfs', '/no/vfio') == ([], [])  # no TPU: nothing found",
    "backend": "b = lessons.backend.get_backend('cpu')\nassert b.compile(lambda x: x * 2)(torch.ones(2)).tolist() == [2, 2]",
    "packed": "assert lessons.packed.table_row_words(8960) == 1408  # codes, steps, padded to 128 words",
    "int4": "codes = lessons.int4.unpack_rows(torch.tensor([[0x76543210]], dtype=torch.int32))\n"
    "assert codes.tolist() == [[-8, -7, -6, -5, -4, -3, -2, -1]]",
    "sampling": "s = lessons.sampling.Sampler(None)\n"
    "assert s(torch.tensor([[0.0, 3.0, 1.0]]), torch.tensor([0]), torch.tensor([0])).item() == 1",
    "modes": "x = torch.ones(4)\nassert torch.equal(lessons.modes.op_stack(x), lessons.modes.op_stack(x))",
    "checkpoint": "model, _ = lessons.checkpoint.load(FOLDER, lessons.backend.get_backend('cpu'), dtype=torch.float32)\n"
    "assert model.lm_head.weight is model.model.embed_tokens.weight",
    "generate": TWIN
    + "tokens, _, _ = lessons.generate.generate(model, tok, ids, lessons.backend.get_backend('cpu'), 3)\n"
    "assert len(tokens) == 3",
    "decode": TWIN + "cache = lessons.decode.static_cache(model, 64)\n"
    "with torch.no_grad():\n"
    "    token, position = lessons.decode.greedy_step(model, cache, ids, torch.arange(ids.shape[1])[None])\n"
    "assert token.shape == (1, 1) and lessons.decode.cache_bytes(cache) > 0",
    "qtable": "grid = torch.randint(-8, 8, (16, 64)).to(torch.bfloat16) / 64  # values on a 4-bit grid\n"
    "from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding\n"
    "table = Gemma4TextScaledWordEmbedding(16, 64, 0, embed_scale=8.0)\n"
    "table.weight.data = grid.clone()\n"
    "q, report = lessons.qtable.QTable.from_embedding(table)\n"
    "assert report['exact grid'] and torch.equal(q.rows(torch.tensor([3, 5])), grid[[3, 5]])",
    "ring": "q, k, v = torch.randn(1, 8, 3, 16), torch.randn(1, 1, 10, 16), torch.randn(1, 1, 10, 16)\n"
    "module = torch.nn.Module()\n"
    "out, _ = lessons.ring.grouped_attention(module, q, k, v, None, scaling=0.25)\n"
    "assert out.shape == (1, 3, 8, 16)",
    "roofline": "assert lessons.roofline.columns(2_000, 10.0, 40_000)['pct_of_bw'] == 50",
    "draft": "keys = {'sliding_attention': torch.tensor([0, 1, 2, 3, -1]), 'full_attention': torch.arange(5)}\n"
    "masks = lessons.draft.draft_masks(keys, torch.tensor(3), 2)  # a query at 3 sees 1 and 2 in a window of 2\n"
    "assert masks['sliding_attention'].tolist() == [False, True, True, False, False]\n"
    "assert masks['full_attention'].tolist() == [True, True, True, False, False]",
    "qlinear": TWIN + "import types\n"
    "report = lessons.qlinear.keep_linears_compressed(model, FOLDER, 'int4')\n"
    "assert report and model(ids).logits.shape[1] == ids.shape[1]",
    "fused": TWIN + "with torch.no_grad():\n"
    "    before = model(ids).logits\n"
    "    lessons.fused.fuse_projections(model)\n"
    "    torch.testing.assert_close(model(ids).logits, before)",
    "timing": "t = lessons.timing.time_fn(lambda x: x + 1, torch.ones(2), sync=lambda: None, warmup=1, repeats=3)\n"
    "assert len(t.times) == 3 and t.min <= t.median <= t.max and t.last.tolist() == [2, 2]",
    "chat": TWIN + "ring = lessons.ring.RingDecoder(model, lessons.backend.get_backend('cpu'), max_len=256)\n"
    "turn = lessons.chat.Chat(ring, tok, max_new_tokens=4).turn_ids('Hello')\n"
    "assert turn[0] == tok.bos_token_id and 'Hello' in tok.decode(turn)",
}


def _with_earlier_lessons(module: str) -> set[str]:
    found, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += sorted(_helpers_imports(ast.parse((ROOT / f"{name}.py").read_text())) & LESSONS)
    return found


def test_every_lesson_module_has_an_example():
    assert set(EXAMPLES) == LESSONS


@pytest.mark.parametrize("module", sorted(LESSONS))
def test_a_lesson_module_copied_alone_runs(module, tmp_path):
    package = tmp_path / "lessons"
    package.mkdir()
    (package / "__init__.py").write_text("")
    copied = _with_earlier_lessons(module)
    for name in copied:
        shutil.copy(ROOT / f"{name}.py", package)
    imports = "".join(f"import lessons.{name}\n" for name in sorted(copied))
    script = (
        f"import sys, torch\n{imports}FOLDER = {str(offline.build_tiny_twin())!r}\nCONFIG = {offline.TEXT_CONFIG!r}\n"
    )
    script += EXAMPLES[module] + "\n"
    script += "assert not [m for m in sys.modules if m.split('.')[0] == 'helpers'], 'the course was imported'\n"
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, f"{sorted(copied)}\n{run.stderr[-3000:]}"
