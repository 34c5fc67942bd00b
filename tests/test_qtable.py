"""The 4-bit per-layer table: exact grid recovery, bit-exact rows, bytes, tokens, one compile.

Every ``torch.equal`` here compares data identical by construction: integer codes, packed words,
weights, rows gathered and dequantized exactly (one rounding to bf16, as the checkpoint's
values were made), or one program's output twice. Two programs are compared within a dtype's
tolerance or by the series' token verdict instead."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

from conftest import within_bf16_rounding
from helpers import decode as d
from helpers import generate as g
from helpers import int4, packed
from helpers import qtable as q
from helpers.course import e2b, hub, offline, series, verdict


@pytest.fixture(scope="module")
def loaded():
    import helpers

    backend = helpers.get_backend()
    checkpoint, model, tokenizer, ids = series.load_for_series(backend)
    return backend, model, tokenizer, ids


def _grid_table(rows=64, cols=96, dtype=torch.bfloat16):
    table = Gemma4TextScaledWordEmbedding(rows, cols, 0, embed_scale=cols**0.5)
    with torch.no_grad():
        table.weight.copy_(offline.on_grid(torch.randn(rows, cols))[0])
    return table.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_grid_is_recovered_exactly(dtype):
    table = _grid_table(dtype=dtype)
    codes, scales, found = int4.recover_grid(table.weight.detach())
    assert found.all() and codes.dtype == torch.int8 and codes.min() >= -8 and codes.max() <= 7
    assert scales.shape == (64, 3) and int4.exact_scales(scales).dtype == torch.bfloat16  # its steps are bf16
    rebuilt = (codes.float().reshape(64, 3, 32) * scales.float()[..., None]).reshape(64, 96).to(dtype)
    assert torch.equal(rebuilt, table.weight)


def test_the_peak_rounded_by_bf16_still_finds_its_scale():
    # codes (7, 1) x 1.15625: 7 x 1.15625 = 8.09375, which bf16 rounds to 8.125, and
    # bf16(8.125 / 7) is not 1.15625
    group = torch.tensor([[8.125, 1.15625] + [0.0] * 30], dtype=torch.bfloat16)
    codes, scales, found = int4.recover_grid(group)
    assert found.all() and torch.equal((codes.float() * scales.float()).to(torch.bfloat16), group)


def _bf16(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16)


grid_groups = st.tuples(
    st.lists(st.integers(-8, 7), min_size=32, max_size=32),  # the codes
    st.integers(0x0080, 0x7F00),  # the scale's bits: any positive normal bf16 short of overflow
    st.booleans(),  # centred the other way: codes -7..8
    st.booleans(),  # a negative scale
)


@settings(max_examples=300, deadline=None)
@given(st.lists(grid_groups, min_size=1, max_size=6))
def test_any_bf16_grid_table_is_recovered_bit_for_bit(groups):
    rows = []
    for codes, bits, other_way, negative in groups:
        codes = torch.tensor(codes, dtype=torch.float32) * (-1 if other_way else 1)
        scale = _bf16(bits).float() * (-1 if negative else 1)
        rows.append((codes * scale).to(torch.bfloat16))  # rounded once to bf16, as a QAT table is
    table = torch.stack(rows)
    assume(torch.isfinite(table.float()).all())
    codes, scales, found = int4.recover_grid(table)
    assert found.all()
    assert codes.min() >= -8 and codes.max() <= 7
    assert torch.equal((codes.float() * scales.float()).to(torch.bfloat16), table)


def _f32(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32)


fine_grid_groups = st.tuples(
    st.lists(st.integers(-8, 7), min_size=32, max_size=32),  # the levels
    st.integers(0x0C00_0000, 0x7000_0000),  # the step's bits: any positive normal float32 well short of overflow
    st.booleans(),  # centred the other way: levels -7..8
)


@settings(max_examples=300, deadline=None)
@given(st.lists(fine_grid_groups, min_size=1, max_size=6))
def test_a_table_of_bf16_level_times_float32_step_is_recovered_bit_for_bit(groups):
    # as Google's -ct export makes its tables: steps finer than bf16, the product rounded once
    table = torch.stack(
        [
            (torch.tensor(levels, dtype=torch.float32) * (-1 if other_way else 1) * _f32(bits)).to(torch.bfloat16)
            for levels, bits, other_way in groups
        ]
    )
    assume(torch.isfinite(table.float()).all() and (table.float().abs().amax(-1) > 1e-30).all())
    codes, steps, found = int4.recover_grid(table)
    assert found.all() and codes.min() >= -8 and codes.max() <= 7
    assert torch.equal(int4.dequantize(codes, steps, torch.bfloat16), table)


def _on_some_grid(group: torch.Tensor) -> bool:
    """Exhaustive: is there a positive float32 step and levels in [-8, 7] or [-7, 8] with
    bf16(level x step) == ``group``? Every float32 step that could give the peak is tried: for a
    peak level k in 1..8, each float32 number between the peak's bf16 neighbours' midpoints / k."""
    peak = group.float().abs().max()
    if peak == 0:
        return True
    bits = group.abs().max().view(torch.int16).int()
    below, above = ((bits + d).to(torch.int16).view(torch.bfloat16).double() for d in (-1, 1))
    for k in range(1, 9):
        lo = ((below + peak.double()) / 2 / k).float().view(torch.int32).item() - 1
        hi = ((above + peak.double()) / 2 / k).float().view(torch.int32).item() + 1
        s = torch.arange(lo, hi + 1, dtype=torch.int32).view(torch.float32)[:, None]
        levels = torch.round(group.float()[None] / s).clamp(-8, 8)
        one_range = ~((levels.amin(-1) < -7) & (levels.amax(-1) > 7))
        if bool((((levels * s).to(torch.bfloat16) == group[None]).all(-1) & one_range).any()):
            return True
    return False


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(-8, 8), min_size=4, max_size=4),
            st.integers(0x3C00_0000, 0x4200_0000),  # a float32 step
            st.integers(-3, 3),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_recover_grid_agrees_with_an_exhaustive_search_over_float32_steps(groups):
    rows = []
    for levels, bits, nudge in groups:  # on a grid, then one value nudged by a few bf16 steps
        group = (torch.tensor(levels, dtype=torch.float32) * _f32(bits)).to(torch.bfloat16)
        if group[0] != 0:
            group[0] = (group[:1].view(torch.int16) + nudge).view(torch.bfloat16)
        rows.append(group)
    table = torch.stack(rows)
    found = int4.recover_grid(table, group_size=4)[2].squeeze(1)
    assert found.tolist() == [_on_some_grid(row) for row in table]


def test_a_table_with_steps_finer_than_bf16_keeps_float32_scales_and_every_row():
    levels = torch.randint(-8, 8, (64, 256), generator=torch.Generator().manual_seed(3)).float()
    steps = torch.rand(64, 8, generator=torch.Generator().manual_seed(4)) * 0.05 + 1e-3
    table = Gemma4TextScaledWordEmbedding(64, 256, 0, embed_scale=16.0).to(torch.bfloat16)
    with torch.no_grad():
        table.weight.copy_((levels * steps.repeat_interleave(32, 1)).to(torch.bfloat16))
    module, report = q.QTable.from_embedding(table, exact_only=True)
    assert report["exact grid"] and module.scales.dtype == torch.float32
    assert report["bytes after"] == 64 * 128 * 4 == module.nbytes()  # 32 words of codes, 8 of steps: 128 a row
    every = torch.arange(64)[None]
    assert torch.equal(module(every), table(every))


def test_groups_on_no_grid_fall_back_to_compressed_tensors_and_the_report_counts_them():
    table = _grid_table()
    with torch.no_grad():
        table.weight[3, :32] = torch.randn(32)  # one group off the grid
    assert int4.recover_grid(table.weight.detach())[2].sum() == 64 * 3 - 1
    with pytest.raises(ValueError, match="1 groups of the table are on no 4-bit grid"):
        q.QTable.from_embedding(table, exact_only=True)
    module, report = q.QTable.from_embedding(table)
    assert not report["exact grid"] and report["groups off the grid"] == 1 and report["groups"] == 64 * 3
    rows = module.rows(torch.arange(64))
    assert torch.equal(rows[4:], table.weight[4:]) and torch.equal(
        rows[3, 32:], table.weight[3, 32:]
    )  # exact elsewhere
    assert 0 < report["max abs error"] == (rows[3, :32] - table.weight[3, :32]).abs().max().item()


def test_rows_equal_the_tables_bit_for_bit_for_edge_and_random_ids():
    table = _grid_table()
    module, report = q.QTable.from_embedding(table)
    assert report["exact grid"]
    for ids in (
        torch.tensor([[0]]),
        torch.tensor([[63]]),
        torch.tensor([[5, 5, 5, 0, 63]]),
        torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(1)),
    ):
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
    assert torch.equal(int4.unpack_rows(packed), unpack_from_int32(packed, 4, codes.shape).to(torch.int32))
    assert torch.equal(int4.unpack_rows(packed).to(torch.int8), codes)


def test_the_unpack_stays_in_32_bit_integers_and_never_shifts_a_negative_word():
    """A TPU has no 64-bit integers, and PyTorch/XLA's >> of a negative int32 rounds like a
    division: every word with its top bit set (a code 0..7 in the last nibble) must still unpack."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(16, 8)  # every code in every nibble
    packed = pack_to_int32(codes, 4)
    assert (packed < 0).any() and (packed >= 0).any()
    shifted = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and not out.is_floating_point():
                assert out.dtype != torch.int64, f"{func} makes int64"
            if "rshift" in str(func) or "right_shift" in str(func):
                shifted.append(bool((args[0] < 0).any()))
            return out

    with Watch():
        unpacked = int4.unpack_rows(packed)
    assert torch.equal(unpacked, codes.int()) and shifted and not any(shifted)


KERNELS = ["cpu"] + (["cuda"] if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0) else [])


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", KERNELS)
def test_each_int4_form_holds_the_checkpoints_values_exactly_and_multiplies_within_tolerance(kernel, scale_dtype):
    """Repacked for torch's int4 kernel, the codes read back through an identity are the checkpoint's values bit for
    bit (exact data: one term per output), and with scales of 1 its codes; the kernel's product, eager and compiled
    into the CPU's matvec loops, for one row and three, is within bf16's tolerance of ``F.linear`` on the dequantized
    weight; the form with no kernel (``packed_linear``) is that very ``F.linear``."""
    import helpers

    backend = helpers.get_backend(kernel)
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(-8, 8, (48, 256), dtype=torch.int8, generator=generator)
    if kernel == "cuda" and scale_dtype == torch.float32:
        pytest.skip("the CUDA kernel takes bf16 scales only (kernel_refusal)")
    # bf16 scales (a linear's: code x scale needs rounding) or float32 steps (a table's, finer than bf16)
    scales = (torch.rand(48, 256 // 32, generator=generator) / 7).to(scale_dtype)
    weight = int4.dequantize(codes, scales, torch.bfloat16)
    packed, scales_and_zeros = int4.int4pack(codes.to(backend.device), scales.to(backend.device), kernel)
    assert torch.equal(int4.int4pack_values(packed, scales_and_zeros, kernel).bfloat16().cpu(), weight)
    units = torch.stack([torch.ones_like(scales_and_zeros[..., 0]), scales_and_zeros[..., 1]], -1)
    assert torch.equal(int4.int4pack_values(packed, units, kernel).cpu(), codes.to(scales_and_zeros.dtype))
    compiled = backend.compile(int4.int4pack_linear, **(backend.use_matvec_loops() or {}))
    for rows in (1, 3):
        x = torch.randn(1, rows, 256, generator=generator).bfloat16()
        expected = torch.nn.functional.linear(x, weight)
        for fn in (int4.int4pack_linear, compiled):
            got = fn(x.to(backend.device), packed, scales_and_zeros, kernel).cpu()
            assert got.shape == (1, rows, 48) and got.dtype == torch.bfloat16
            within_bf16_rounding(got, x, weight)  # a code read from the wrong nibble is ~0.1 off
        words = helpers.qlinear.pack_words(codes)
        assert torch.equal(int4.packed_linear(x, words, scales, torch.bfloat16), expected)


def test_the_kernel_is_refused_where_it_would_not_hold_the_checkpoints_values():
    codes = torch.zeros(48, 256, dtype=torch.int8)
    scales = torch.full((48, 8), 0.01).bfloat16()
    assert int4.kernel_refusal(codes, scales, torch.bfloat16, "int4", "cpu") is None
    assert "float32" in int4.kernel_refusal(codes, scales, torch.float32, "int4", "cpu")
    finer = scales.float() * 1.001  # steps finer than bf16 (Google's tables): the CPU's kernel takes them in float32
    assert int4.kernel_refusal(codes, finer, torch.bfloat16, "int4", "cpu") is None
    assert "finer than bf16" in int4.kernel_refusal(codes, finer, torch.bfloat16, "int4", "cuda")
    assert "finer than bf16" in int4.kernel_refusal(
        codes, finer[:, :1].expand(48, 8), torch.bfloat16, "int4-bytes", "cpu"
    )
    assert "rows in 16s" in int4.kernel_refusal(codes[:40], scales[:40], torch.bfloat16, "int4", "cpu")
    assert "one scale a row" in int4.kernel_refusal(
        codes, torch.rand(48, 8).bfloat16(), torch.bfloat16, "int4-bytes", "cpu"
    )
    assert int4.kernel_refusal(codes, scales, torch.bfloat16, "int4-bytes", "cpu") is None


def test_a_head_with_steps_finer_than_bf16_takes_the_cpu_kernel_in_bf16_once_a_piece_and_a_step_counts_each_pass():
    """Google's tables step finer than bf16. The recovered steps are two bf16 pieces that sum to them exactly, so the
    head runs torch's bf16 int4 kernel once a piece (not its far slower float32 path): the pieces read
    back as code x step exactly, the product is within bf16's tolerance of the table's ``F.linear``, and a step reads
    the codes once a pass."""
    from helpers import roofline

    levels = torch.randint(-7, 8, (64, 256), generator=torch.Generator().manual_seed(3)).float()
    steps = torch.rand(64, 8, generator=torch.Generator().manual_seed(4)) * 0.05 + 1e-3
    table = Gemma4TextScaledWordEmbedding(64, 256, 0, embed_scale=16.0).to(torch.bfloat16)
    with torch.no_grad():
        table.weight.copy_((levels * steps.repeat_interleave(32, 1)).to(torch.bfloat16))
    module = q.QTable.from_embedding(table, exact_only=True)[0]
    high, low = int4.bf16_pieces(module.scales)  # two: no step here is a bf16 number
    assert module.scales.dtype == torch.float32 and torch.equal(high.float() + low.float(), module.scales)
    head = q.QHead(module, "cpu")
    assert head.kernel == "cpu" and head.passes == 2 and head.scales.dtype == torch.bfloat16
    # in float32 the kernel reads code x piece exactly (20 significant bits at most), so their sum is code x step
    values = sum(int4.int4pack_values(head.codes, s.float(), "cpu") for s in head.scales)
    codes = int4.unpack_rows(module.packed).float()
    assert torch.equal(values, codes * module.scales.repeat_interleave(32, 1))
    assert torch.equal(values.bfloat16(), table.weight)  # the table's values, bit for bit
    for rows in (1, 3):
        x = torch.randn(1, rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        within_bf16_rounding(head(x), x, table.weight, roundings=3)
    model = torch.nn.Module()  # the parts step_bytes reads: two gathered tables and the head with its own copy
    model.model, model.lm_head = torch.nn.Module(), head
    model.model.embed_tokens, model.model.embed_tokens_per_layer = module, q.QTable.from_embedding(table)[0]
    codes_bytes, scales_bytes = (
        head.codes.numel() * head.codes.element_size(),
        head.scales.numel() * head.scales.element_size(),
    )
    rows = 2 * module.table.shape[1] * module.table.element_size()
    assert roofline.step_bytes(model) == 2 * codes_bytes + scales_bytes + rows


def test_each_row_is_its_codes_then_its_float32_steps_padded_to_128_words_for_a_tpus_gather():
    module, report = q.QTable.from_embedding(_grid_table())
    assert module.table.dtype == torch.int32 and module.table.shape == (64, 128) == (64, report["row words"])
    assert report["bytes after"] == 64 * 128 * 4 == module.nbytes() and report["bytes before"] == 64 * 96 * 2
    assert module.packed.shape == (64, 12) and module.scales.shape == (64, 3)  # views: 12 + 3 words, then zeros
    assert (module.table[:, 15:] == 0).all()
    assert packed.table_row_words(8960) == 1408 and packed.table_row_words(8960) % 128 == 0  # E2B's: 1,120 + 280
    assert e2b.table_bytes(262_144, 8960) == 262_144 * 1408 * 4 == 1_476_395_008  # the padding counted


def test_e2b_saving_and_stepwise_bytes_match_the_reference_figures():
    steps = e2b.bytes_by_step()
    table = {s: parts["per-layer table"] for s, parts in steps.items()}
    # packed codes and a float32 step per group of 32 (the export's steps are finer than bf16), in
    # rows padded to 1,408 words for a TPU's gather; with bf16 steps and no padding, the source's
    # arithmetic, it would be 1,321,205,760 B, saving 3.38 GB
    assert table["05 4-bit table"] == 262_144 * 1408 * 4 == 1_476_395_008
    assert table["04 compiled decode"] - table["05 4-bit table"] == 3_221_225_472


def test_the_twins_table_is_on_its_grid_and_tokens_stay_the_same_with_one_compile(loaded):
    backend, model, tokenizer, ids = loaded
    n = backend.generation_length
    reference, _, _ = g.generate(model, tokenizer, ids, backend, n)
    with torch.no_grad():
        model(ids)
    d.strip_compressed_wrappers(model)
    report = q.keep_table_in_4bit(model)
    assert report["exact grid"] and isinstance(model.model.embed_tokens_per_layer, q.QTable)
    torch.compiler.reset()
    decoder = d.Decoder(model, backend, max_len=128)
    with backend.compile_counter() as count:
        tokens = decoder.generate(ids, n)
    independent = verdict.reference_model(
        hub.choose_checkpoint(backend), hub.series_dtype(hub.choose_checkpoint(backend))
    )
    assert verdict.compare_tokens(tokens, reference, independent, ids) and count.graphs == 2


def test_a_table_saved_packed_is_read_from_safetensors_and_gives_the_same_rows(packed_table_twin):
    import helpers

    backend = helpers.get_backend()
    source, model, _, _ = series.load_for_series(backend)
    assert q.QTable.from_checkpoint(source.path, "embed_tokens_per_layer", model.model.embed_tokens_per_layer) is None
    packed = hub.Checkpoint(str(packed_table_twin), None, True, "its per-layer table saved packed")
    table = model.model.embed_tokens_per_layer
    module, report = q.QTable.from_checkpoint(packed.path, "embed_tokens_per_layer", table)
    assert report["from"] == "packed in model.safetensors" and report["bytes after"] == module.nbytes()
    ids = torch.tensor([[0, table.num_embeddings - 1, 3, 3]], device=backend.device)
    assert torch.equal(module(ids).cpu(), table(ids).cpu())
    every = torch.arange(table.num_embeddings, device=backend.device)[None]
    assert torch.equal(module(every).cpu(), table(every).cpu())


def test_the_main_table_in_4bit_keeps_the_tied_heads_logits_and_the_tokens():
    import helpers

    backend = helpers.get_backend()
    series = helpers.course.series.prepare(backend, after=4)
    model, ids, n = series.model, series.ids, series.new_tokens
    hidden = torch.randn(1, 3, model.config.hidden_size, device=backend.device, dtype=model.lm_head.weight.dtype)
    logits = model.lm_head(hidden)
    report = q.keep_embed_in_4bit(model)
    assert report["exact grid"] and isinstance(model.lm_head, q.QHead)
    # equal: F.linear of the same values either way, the dequantized table being the bf16 one bit for bit
    assert torch.equal(model.lm_head(hidden).cpu(), logits.cpu())
    torch.compiler.reset()
    decoder = d.Decoder(model, backend, max_len=128)
    assert series.same_tokens(decoder.generate(ids, n))
