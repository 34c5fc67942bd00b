"""The synthetic E2B checkpoint: built by the same code at a slice of the size (the twin's
shapes), it has the export's layout and file set, loads, decodes without collapsing onto one
token, and keeps its tables on a grid finer than bf16; at full size, its layout on the meta
device has the export's 2,504 tensors and 7.75 GiB.

Every ``torch.equal`` here compares data identical by construction: integer codes, packed words,
weights, rows gathered and dequantized exactly (one rounding to bf16, as the checkpoint's
values were made), or one program's output twice. Two programs are compared within a dtype's
tolerance or by the series' token verdict instead."""

import json

import pytest
import torch
from safetensors import safe_open

import helpers
from helpers import checkpoint as ck
from helpers import generate, int4
from helpers.course import e2b, hub, offline


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from transformers import Gemma4AudioConfig, Gemma4TextConfig, Gemma4VisionConfig

    towers = (
        Gemma4VisionConfig(**offline.VISION_CONFIG, use_clipped_linears=True),
        Gemma4AudioConfig(**offline.AUDIO_CONFIG),
    )
    folder = tmp_path_factory.mktemp("synthetic") / "small"
    return offline.build_synthetic_e2b(folder, text_config=Gemma4TextConfig(**offline.TEXT_CONFIG), towers=towers)


def test_the_exports_file_set_names_dtypes_and_shapes(small):
    names = {p.name for p in small.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
    } <= names
    assert [p.name for p in small.glob("*.safetensors")] == ["model.safetensors"]
    assert json.loads((small / "generation_config.json").read_text())["eos_token_id"] == [1, 106]
    model = e2b.meta_model(ck.text_config(ck.read_config(small)))
    linears = {n for n, m in model.model.named_modules() if isinstance(m, torch.nn.Linear)}
    with safe_open(small / "model.safetensors", "pt") as f:  # written by hand: safetensors reads it
        keys = set(f.keys())
        stem = f"model.language_model.{sorted(linears)[0]}."
        packed, scale = f.get_tensor(stem + "weight_packed"), f.get_tensor(stem + "weight_scale")
        shape = f.get_tensor(stem + "weight_shape").tolist()
        assert packed.dtype == torch.int32 and list(packed.shape) == [shape[0], shape[1] // 8]
        assert scale.dtype == torch.bfloat16 and list(scale.shape) == [shape[0], shape[1] // 32]
        table = f.get_tensor("model.language_model.embed_tokens.weight")
        assert torch.equal(f.get_tensor("lm_head.weight"), table)  # the redundant copy
    assert {k[: -len(".weight_packed")] for k in keys if k.endswith(".weight_packed")} == {
        f"model.language_model.{n}" for n in linears
    }
    assert any(k.startswith("model.vision_tower.") for k in keys) and any(
        k.startswith("model.audio_tower.") for k in keys
    )


def test_it_loads_through_the_series_code_and_decodes_without_collapsing(small):
    checkpoint = hub.Checkpoint(str(small), None, False, "synthetic, small")
    model, _ = ck.load(checkpoint.path, helpers.get_backend("cpu"))
    tokenizer = ck.load_tokenizer(checkpoint.path)
    assert tokenizer.convert_tokens_to_ids(["<|turn>", "<turn|>"]) == [105, 106] and len(tokenizer) == 512
    ids = ck.chat_ids(tokenizer, "cpu")
    with torch.no_grad():
        out = model.generate(ids, generation_config=generate.greedy_config(model, 16, stop=False))
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    assert len(set(tokens)) >= 4, tokens  # random weights that do not answer one token forever
    assert tokenizer.decode(tokens)  # every id the model makes decodes


def test_its_tables_are_on_a_grid_finer_than_bf16(small):
    with safe_open(small / "model.safetensors", "pt") as f:
        table = f.get_tensor("model.language_model.embed_tokens_per_layer.weight")
    codes, steps, found = int4.recover_grid(table)
    assert found.all() and int4.exact_scales(steps).dtype == torch.float32
    assert torch.equal(int4.dequantize(codes, steps, torch.bfloat16), table)


def test_at_full_size_the_layout_has_the_exports_tensors_and_bytes():
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    text = e2b.real_config()
    vision, audio = Gemma4VisionConfig(use_clipped_linears=True), Gemma4AudioConfig()
    config = Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=audio.to_dict())
    with torch.device("meta"):
        towers = {
            k: t.shape
            for k, t in Gemma4ForConditionalGeneration(config).state_dict().items()
            if k.startswith("model.") and not k.startswith("model.language_model.")
        }
    entries = list(offline._entries(e2b.meta_model(text), towers, 0))  # names and sizes: nothing made
    size = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, d, s, _ in entries)
    assert len(entries) == 2504 and round(size / 2**30, 2) == 7.74  # the export: 2,504 tensors, 7.75 GiB
    assert sum(k.startswith("model.vision_tower.") for k in towers) == 658
    assert sum(k.startswith("model.audio_tower.") for k in towers) == 751
