"""The 4-bit per-layer table: exact grid recovery, bit-exact rows, bytes, tokens, one compile."""

import pytest
import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

from helpers import decode as d
from helpers import generate as g
from helpers import qtable as q
from helpers import twin


@pytest.fixture(scope="module")
def loaded():
    import helpers

    backend = helpers.get_backend()
    checkpoint, model, tokenizer, ids = g.load_for_series(backend)
    return backend, model, tokenizer, ids


def _grid_table(rows=64, cols=96, dtype=torch.bfloat16):
    table = Gemma4TextScaledWordEmbedding(rows, cols, 0, embed_scale=cols**0.5)
    with torch.no_grad():
        table.weight.copy_(twin.on_grid(torch.randn(rows, cols))[0])
    return table.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_grid_is_recovered_exactly(dtype):
    table = _grid_table(dtype=dtype)
    codes, scales = q.recover_grid(table.weight.detach())
    assert codes.dtype == torch.int8 and codes.min() >= -8 and codes.max() <= 7
    assert scales.dtype == torch.bfloat16 and scales.shape == (64, 3)
    rebuilt = (codes.float().reshape(64, 3, 32) * scales.float()[..., None]).reshape(64, 96).to(dtype)
    assert torch.equal(rebuilt, table.weight)


def test_a_table_on_no_grid_falls_back_to_compressed_tensors_with_its_error():
    table = Gemma4TextScaledWordEmbedding(64, 64, 0, embed_scale=8.0)
    assert q.recover_grid(table.weight.detach()) is None
    with pytest.raises(ValueError, match="no 4-bit grid"):
        q.QTable.from_embedding(table, exact_only=True)
    module, report = q.QTable.from_embedding(table)
    assert not report["exact grid"] and 0 < report["max abs error"] < table.weight.abs().max()


def test_rows_equal_the_tables_bit_for_bit_for_edge_and_random_ids():
    table = _grid_table()
    module, report = q.QTable.from_embedding(table)
    assert report["exact grid"]
    for ids in (torch.tensor([[0]]), torch.tensor([[63]]), torch.tensor([[5, 5, 5, 0, 63]]),
                torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(1))):
        assert torch.equal(module(ids), table(ids))


def test_the_embed_scale_is_a_device_buffer_as_in_gemma4s_embedding():
    module, _ = q.QTable.from_embedding(_grid_table())
    assert dict(module.named_buffers())["embed_scale"].device == module.packed.device
    assert "embed_scale" not in module.state_dict()  # not saved, as Gemma 4 keeps it
    module.embed_scale.fill_(2.0)  # the forward reads the buffer, not a number kept aside
    assert torch.equal(module(torch.tensor([[3]])), module.rows(torch.tensor([[3]])) * 2)


def test_the_unpack_matches_compressed_tensors_own():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    codes = torch.randint(-8, 8, (16, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    packed = pack_to_int32(codes, 4)
    assert torch.equal(q.unpack_rows(packed), unpack_from_int32(packed, 4, codes.shape).to(torch.int32))
    assert torch.equal(q.unpack_rows(packed).to(torch.int8), codes)


def test_bytes_are_packed_int4_plus_bf16_group_scales():
    module, report = q.QTable.from_embedding(_grid_table())
    assert report["bytes after"] == 64 * 96 // 2 + 64 * 96 // 32 * 2 == module.nbytes()
    assert report["bytes before"] == 64 * 96 * 2


def test_e2b_saving_and_stepwise_bytes_match_the_reference_figures():
    steps = q.e2b_bytes_by_step()
    table = {s: parts["per-layer table"] for s, parts in steps.items()}
    assert table["04 compiled step"] - table["05 4-bit table"] == 3_376_414_720
    assert table["05 4-bit table"] == 1_321_205_760


def test_the_twins_table_is_on_its_grid_and_tokens_stay_the_same_with_one_compile(loaded):
    backend, model, tokenizer, ids = loaded
    n = g.generation_length(backend)
    reference, _, _ = g.generate(model, tokenizer, ids, backend, n)
    with torch.no_grad():
        model(ids)
    d.strip_compressed_wrappers(model)
    report = q.keep_table_in_4bit(model)
    assert report["exact grid"] and isinstance(model.model.embed_tokens_per_layer, q.QTable)
    torch._dynamo.reset()
    decoder = d.Decoder(model, backend, max_len=128)
    with backend.compile_counter() as count:
        tokens = decoder.generate(ids, n)
    assert tokens == reference and count.graphs == 2


def test_a_table_saved_packed_is_read_from_safetensors_and_gives_the_same_rows(tmp_path):
    import shutil

    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file, save_file

    import helpers
    from helpers import checkpoint as ck

    backend = helpers.get_backend()
    source, model, _, _ = g.load_for_series(backend)
    assert q.QTable.from_checkpoint(source, "embed_tokens_per_layer", model.model.embed_tokens_per_layer) is None
    shutil.copytree(source.source, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    key = "model.language_model.embed_tokens_per_layer"
    codes, scales = q.recover_grid(tensors.pop(f"{key}.weight"))
    tensors |= {f"{key}.weight_packed": pack_to_int32(codes, 4), f"{key}.weight_scale": scales,
                f"{key}.weight_shape": torch.tensor(codes.shape)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    packed = ck.Checkpoint(str(tmp_path), None, True, "its per-layer table saved packed")
    table = model.model.embed_tokens_per_layer
    module, report = q.QTable.from_checkpoint(packed, "embed_tokens_per_layer", table)
    assert report["from"] == "packed in model.safetensors" and report["bytes after"] == module.nbytes()
    ids = torch.tensor([[0, table.num_embeddings - 1, 3, 3]], device=backend.device)
    assert torch.equal(module(ids).cpu(), table(ids).cpu())


def test_the_main_table_in_4bit_keeps_the_tied_heads_logits_and_the_tokens():
    import helpers

    backend = helpers.get_backend()
    checkpoint, model, tokenizer, ids = g.load_for_series(backend)
    n = g.generation_length(backend)
    reference, _, _ = g.generate(model, tokenizer, ids, backend, n)
    d.strip_compressed_wrappers(model)
    hidden = torch.randn(1, 3, model.config.hidden_size, device=backend.device, dtype=model.lm_head.weight.dtype)
    logits = model.lm_head(hidden)
    report = q.keep_embed_in_4bit(model)
    assert report["exact grid"] and isinstance(model.lm_head, q.QHead)
    assert torch.equal(model.lm_head(hidden).cpu(), logits.cpu())
    torch._dynamo.reset()
    decoder = d.Decoder(model, backend, max_len=128)
    assert decoder.generate(ids, n) == reference
