"""The tiny twin has the real checkpoint's class, layout, names, packing and quirks.

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
from helpers import generate
from helpers.backend import GENERATION_TOKENS
from helpers.course import e2b, hub, offline, verdict


@pytest.fixture(scope="module")
def folder():
    return offline.build_tiny_twin()


@pytest.fixture(scope="module")
def tensors(folder):
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_config_is_the_real_class_shrunk_with_every_feature_kept(folder):
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma4" and config["architectures"] == ["Gemma4ForConditionalGeneration"]
    text = config["text_config"]
    assert text["layer_types"] == ["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(10)]
    assert text["num_kv_shared_layers"] > 0 and text["hidden_size_per_layer_input"] > 0
    full_dims = {layer["head_dim"] for layer in text["per_layer_config"].values()}  # global_head_dim, as saved
    assert len(text["per_layer_config"]) == 2 and full_dims == {2 * text["head_dim"]}
    assert text["final_logit_softcapping"] == 30.0 and config["tie_word_embeddings"] is True
    assert text["sliding_window"] == 16 and 100 <= text["vocab_size"] < 1000
    assert config["vision_config"] and config["audio_config"]  # the towers are there, beside the text decoder


def test_quantization_config_has_the_real_checkpoints_keys(folder):
    q = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    assert q["quantization_status"] == "compressed"
    (group,) = q["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["format"] == "pack-quantized"
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    assert "lm_head" in q["ignore"]


def test_tensor_names_dtypes_and_shapes_follow_the_real_layout(folder, tensors):
    model = e2b.meta_model(ck.text_config(ck.read_config(folder)))
    linears = {n: m for n, m in model.model.named_modules() if isinstance(m, torch.nn.Linear)}
    packed = {k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")}
    assert packed == {"model.language_model." + n for n in linears}  # every text linear, nothing else
    for name, module in linears.items():
        stem = f"model.language_model.{name}."
        out_f, in_f = module.weight.shape
        assert tensors[stem + "weight_packed"].dtype == torch.int32 and tensors[stem + "weight_packed"].shape == (
            out_f,
            in_f // 8,
        )
        assert tensors[stem + "weight_scale"].dtype == torch.bfloat16 and tensors[stem + "weight_scale"].shape == (
            out_f,
            in_f // 32,
        )
        assert tensors[stem + "weight_shape"].tolist() == [out_f, in_f]
    assert tensors["model.language_model.embed_tokens_per_layer.weight"].dtype == torch.bfloat16
    assert torch.equal(
        tensors["lm_head.weight"], tensors["model.language_model.embed_tokens.weight"]
    )  # the redundant copy
    first_shared = model.config.num_hidden_layers - model.config.num_kv_shared_layers
    shared_kv = [
        k
        for k in tensors
        if any(f"layers.{i}.self_attn.{p}" in k for i in range(first_shared, 10) for p in ("k_proj", "v_proj"))
    ]
    assert shared_kv == []  # KV-sharing layers have no k/v projections, as in E2B
    assert any(k.startswith("model.vision_tower.") for k in tensors) and any(
        k.startswith("model.audio_tower.") for k in tensors
    )


def test_e2b_has_the_checkpoints_276_packed_linears_by_the_same_rule():
    model = e2b.meta_model(e2b.real_config())
    assert sum(isinstance(m, torch.nn.Linear) for m in model.model.modules()) == 276


def test_tables_are_bf16_level_times_a_step_finer_than_bf16(tensors):
    from helpers import int4

    for key in ("model.language_model.embed_tokens.weight", "model.language_model.embed_tokens_per_layer.weight"):
        table = tensors[key]
        assert table.dtype == torch.bfloat16
        codes, steps, found = int4.recover_grid(table)
        assert found.all() and torch.equal(int4.dequantize(codes, steps, torch.bfloat16), table)
        # the real export's quirk: its steps are wider than bf16, so a bf16 scale per group does
        # not give every value back (published: ~74% of the real table's values), float32 ones do
        assert int4.exact_scales(steps).dtype == torch.float32
        assert not torch.equal(int4.dequantize(codes, steps.to(torch.bfloat16), torch.bfloat16), table)
        assert (steps < 0).any() and (steps > 0).any()  # both code ranges, -8..7 and -7..8


def test_linears_are_packed_int4_codes(tensors):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    stem = "model.language_model.layers.0.mlp.down_proj."
    codes = unpack_from_int32(tensors[stem + "weight_packed"], 4, torch.Size(tensors[stem + "weight_shape"].tolist()))
    assert codes.min() >= -8 and codes.max() <= 7 and codes.unique().numel() > 8


def test_the_real_repositorys_file_set(folder):
    names = {p.name for p in folder.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "processor_config.json",
    } <= names
    generation = json.loads((folder / "generation_config.json").read_text())
    tok = ck.load_tokenizer(folder)
    assert generation["eos_token_id"] == tok.convert_tokens_to_ids(["<eos>", "<turn|>"])


def test_the_download_keeps_every_file_the_series_reads(folder, tmp_path):
    import fnmatch
    import shutil

    for path in folder.iterdir():  # the folder as snapshot_download(allow_patterns=...) leaves it
        if any(fnmatch.fnmatch(path.name, p) for p in hub._PATTERNS):
            shutil.copy(path, tmp_path / path.name)
    kept = hub.Checkpoint(str(tmp_path), None, True, "filtered as the download filters")
    ids = ck.chat_ids(ck.load_tokenizer(kept.path), "cpu")  # needs chat_template.jinja
    assert ids.shape[1] > 16
    model, _ = ck.load(kept.path, helpers.get_backend("cpu"), dtype=torch.float32, dequantize=True)
    assert (
        model.generation_config.eos_token_id
        == json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    )


def test_the_twin_answers_the_series_prompt_in_words_and_ends_its_turn(folder):

    checkpoint = hub.Checkpoint(str(folder), None, True, "test")
    tok = ck.load_tokenizer(checkpoint.path)
    model, _ = ck.load(checkpoint.path, helpers.get_backend("cpu"), dtype=torch.float32, dequantize=True)
    tokens = verdict.greedy_tokens(model, ck.chat_ids(tok, "cpu"), GENERATION_TOKENS)
    assert len(tokens) < GENERATION_TOKENS and tokens[-1] == tok.convert_tokens_to_ids("<turn|>")
    assert tok.decode(tokens, skip_special_tokens=True) == dict(offline.CHATS)[offline.PROMPT]
    assert generate.until_stop(tokens, generate.stop_ids(model)) == tokens
    # thinking on: Gemma 4's template opens a system turn with <|think|>, the reply a thinking channel
    question, answer = offline.THINKING_CHATS[0]
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False, enable_thinking=True
    )
    assert text.startswith("<bos><|turn>system\n<|think|><turn|>\n<|turn>user\n") and text.endswith("<|turn>model\n")
    tokens = verdict.greedy_tokens(model, ck.encode(tok, text, "cpu"), GENERATION_TOKENS)
    assert tok.decode(tokens) == answer + "<turn|>" and tok.decode(tokens).startswith("<|channel>thought\n")


def test_the_chat_template_is_gemma_4s_turn_format(folder):
    tok = ck.load_tokenizer(folder)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello.<turn|>\n"
        "<|turn>user\nBye<turn|>\n<|turn>model\n"
    )
    special = {t.content for t in tok.added_tokens_decoder.values() if t.special}
    assert {"<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>"} <= special
    assert "<start_of_turn>" not in tok.get_vocab()


def test_on_grid_is_exact_and_idempotent():
    w = torch.randn(4, 64, dtype=torch.bfloat16)
    snapped, scale = offline.on_grid(w)
    assert scale.shape == (4, 2) and torch.equal(offline.on_grid(snapped)[0], snapped)
    codes = snapped.float().reshape(4, 2, 32) / scale[..., None]
    assert torch.equal(codes, codes.round()) and codes.abs().max() <= 8


def test_built_once_then_taken_from_the_cache(folder):
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert offline.build_tiny_twin() == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_same_seed_same_twin(tmp_path, tensors):
    other = offline.build_tiny_twin(tmp_path / "again")
    with safe_open(other / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(tensors) and all(torch.equal(f.get_tensor(k), tensors[k]) for k in f.keys())


def test_tokenizer_does_not_add_bos_but_encode_does(folder):
    c = hub.Checkpoint(str(folder), None, True, "test")
    tok = ck.load_tokenizer(c.path)
    assert tok("Paris")["input_ids"][0] != tok.bos_token_id
    ids = ck.encode(tok, "Paris", "cpu")
    assert ids[0, 0] == tok.bos_token_id and (ids == tok.bos_token_id).sum() == 1
    chat = ck.chat_ids(tok, "cpu")
    assert chat[0, 0] == tok.bos_token_id and (chat == tok.bos_token_id).sum() == 1
    assert chat.shape[1] > 16  # longer than the twin's sliding window
