"""The compiled programs as XLA builds them (the xla job, XLA's CPU compiler, the twin): the
decode step, the prefill and notebook 09's call write the KV cache in place (every cache buffer aliased input to
output, nothing copied), no 64-bit integer work over a table row or the vocabulary (the 4-bit
unpack and the sampling noise are 32-bit), and the 4-bit table dequantizes only the rows it
gathers. Elsewhere: the dump's parsing, on a program of known shape."""

import os

import pytest
import torch

import helpers
from conftest import needs_xla
from helpers import decode, qlinear, qtable, sampling
from helpers.backend import AUDIT_VAR, enable_dump
from helpers.course import audits
from helpers.ring import RingDecoder, group_query_heads

os.environ.setdefault(AUDIT_VAR, "1")  # read when the xla backend starts: this target's process only


def _audits(decoder, series, **options) -> list[dict]:
    torch.compiler.reset()
    folder = enable_dump()
    with audits.captured(folder) as compiled:
        tokens = decoder.generate(series.ids, series.new_tokens, **options)
    shapes = {audits.hlo_shape(t) for t in decode.kv_buffers(decoder.cache)}
    rows = [audits.audit(p, shapes) for p in compiled]
    return tokens, [r for r in rows if r["cache_buffers"]]  # the prefill and the step


@pytest.fixture(scope="module")
def xla_series():
    backend = helpers.get_backend()
    if not backend.lazy:
        pytest.skip("reads what XLA compiled: the xla job")
    return helpers.course.series.prepare(backend, after=5)


@needs_xla
@pytest.mark.parametrize("decoder_class", [decode.Decoder, RingDecoder])
def test_the_step_and_the_prefill_write_every_cache_buffer_in_place(xla_series, decoder_class):
    decoder = decoder_class(xla_series.model, helpers.get_backend(), max_len=64)
    tokens, rows = _audits(decoder, xla_series)
    assert xla_series.same_tokens(tokens)
    assert len(rows) == 2, rows  # the prefill (a bucket, or a chunk) and the decode step
    for row in rows:
        assert row["cache_buffers"] == len(decode.kv_buffers(decoder.cache)) == row["cache_aliased"], row
        assert row["cache_bytes_copied"] == 0


@needs_xla
@pytest.mark.parametrize("kind", ["DraftDecoder", "DraftRingDecoder"])
def test_notebook_09s_prefill_and_call_write_every_cache_buffer_in_place_and_run_no_op_on_the_host(xla_series, kind):
    """A call (a verify, then the next drafts) donates its K/V as the step does, and none of its own ops falls back to
    the host: two did (``cumprod`` in the judge, ``fill_`` with a tensor in the rewind), torch_xla split the call in
    programs around them, and the K/V it had donated were deleted before the drafts read them. The one op left on the
    host is the 4-bit table's (notebook 05): its float32 steps read from int32 bits, a dtype view torch_xla 2.9 does
    not lower, in the step's programs too."""
    import torch_xla.debug.metrics as met

    from helpers import draft
    from helpers.course import offline

    backend = helpers.get_backend()
    folder = offline.build_twin_assistant(xla_series.checkpoint.path)
    assistant = draft.load_assistant(folder, backend, torch.float32)
    decoder = getattr(draft, kind)(xla_series.model, assistant, backend, 128, 2)
    met.clear_all()
    tokens, rows = _audits(decoder, xla_series)
    assert met.executed_fallback_ops() == ["aten::view_copy.dtype"], met.executed_fallback_ops()
    assert xla_series.same_tokens(tokens)
    assert len(rows) == 2, rows  # the prefill (it drafts the first call's tokens) and the call
    for row in rows:
        assert row["cache_buffers"] == len(decode.kv_buffers(decoder.cache)) == row["cache_aliased"], row
        assert row["cache_bytes_copied"] == 0


@needs_xla
@pytest.mark.parametrize("decoder_class", [decode.Decoder, RingDecoder])
def test_prompts_of_five_more_lengths_in_one_bucket_compile_no_program_the_first_did_not(xla_series, decoder_class):
    """Each padded prompt (or chunk) and its lengths are made on the host and copied: a device op on a Python length
    would be a new program per prompt length, eager ones included, which XLA's own counters count."""
    backend = helpers.get_backend()
    decoder = decoder_class(xla_series.model, backend, max_len=64)
    long = xla_series.ids.cpu().repeat(1, 4)  # prompts made on the host, as a tokenizer makes them
    half = decode.cache_length(xla_series.ids.shape[1]) // 2
    lengths = range(half + 1, half + 8)  # one bucket, and as many of the ring's chunks, for all seven
    for n in lengths[:2]:  # the first compiles; the second, a cache the programs wrote (XLA compiles once more)
        decoder.generate(long[:, :n].to(backend.device), 3, stop_ids=())
    with backend.compile_counter() as count:
        for n in lengths[2:]:
            decoder.generate(long[:, :n].to(backend.device), 3, stop_ids=())
    assert count.graphs == 0 and count.programs == 0, count


@needs_xla
def test_no_64_bit_integer_work_over_a_table_row_or_the_vocabulary(xla_series):
    """The 4-bit table's unpack in int32 (the noise's is checked op by op in test_sampling): what
    64-bit integer work is left has no dimension as long as a row of packed table words. What
    is left: transformers' int64 positions and masks, and argmax's own index, an s64 iota as
    long as the vocabulary (torch's argmax returns int64)."""
    config = xla_series.model.config.get_text_config()
    sampled = sampling.SampledDecoder(
        xla_series.model, helpers.get_backend(), max_len=64, sampling=sampling.sampling_config(top_k=8)
    )
    _, rows = _audits(sampled, xla_series, seed=3)
    words = config.num_hidden_layers * config.hidden_size_per_layer_input // 8  # a packed row, int32 words
    for row in rows:
        dims = {int(d) for d in row["s64_largest_shape"][4:-1].split(",") if d}
        assert not dims & {words, words * 8}, row


@needs_xla
def test_the_rings_masks_over_its_full_buffer_are_32_bit(xla_series):
    """The ring's full layers see max_len positions: a [chunk, max_len] comparison per program,
    int32 (an odd max_len, so no other dimension matches it)."""
    max_len = 97
    _, rows = _audits(RingDecoder(xla_series.model, helpers.get_backend(), max_len=max_len), xla_series)
    assert len(rows) == 2
    for row in rows:
        assert str(max_len) not in row["s64_largest_shape"][4:-1].split(","), row


@needs_xla
def test_the_rings_grouped_attention_holds_no_copy_of_k_per_query_head(xla_series):
    """transformers' attention repeats a full layer's one K/V head for every query head, a
    [1, heads, max_len, head_dim] copy per call; grouped, no intermediate of the ring's
    programs is that large (a max_len long enough that the copy outweighs everything else)."""
    model, config = xla_series.model, xla_series.model.config.get_text_config()
    max_len = 1024
    head_dim = model.model.layers[config.layer_types.index("full_attention")].self_attn.head_dim
    repeated = config.num_attention_heads * max_len * head_dim * 4  # float32: the twin
    largest = {}
    for grouped in (False, True):
        before = group_query_heads(model) if grouped else None
        try:
            tokens, rows = _audits(RingDecoder(model, helpers.get_backend(), max_len=max_len), xla_series)
        finally:
            if before:
                model.set_attn_implementation(before)  # the module's other tests run transformers' own
        assert xla_series.same_tokens(tokens) and len(rows) == 2
        largest[grouped] = [r["largest_intermediate"] for r in rows]
    assert max(largest[False]) >= repeated, largest  # the copy is there without grouping: the test can fail
    assert max(largest[True]) < repeated, largest


@needs_xla
def test_the_4bit_table_dequantizes_only_the_rows_it_gathers(xla_series):
    table = xla_series.model.model.embed_tokens_per_layer
    assert isinstance(table, qtable.QTable)
    whole = table.packed.shape[0] * table.embedding_dim * 4  # the table dequantized, float32 (the twin)
    _, rows = _audits(decode.Decoder(xla_series.model, helpers.get_backend(), max_len=64), xla_series)
    for row in rows:
        assert row["largest_intermediate"] < whole / 4, row


def test_the_audit_reads_an_hlo_module_and_its_buffer_assignment():
    hlo = (
        "HloModule m, input_output_alias={ {1}: (2, {}, may-alias) }, entry_computation_layout={(s64[4]{0})->s64[4]{0}}\n"
        "\n"
        "ENTRY %m (p0: s64[4], p1: f32[8], p2: bf16[1,2,16,4]) -> (s64[4], bf16[1,2,16,4]) {\n"
        "  %p0 = s64[4]{0} parameter(0)\n"
        "  %p1 = f32[8]{0} parameter(1)\n"
        "  %p2 = bf16[1,2,16,4]{3,2,1,0} parameter(2)\n"
        "  %iota.1 = s64[4]{0} iota(), iota_dimension=0\n"
        "  %add.2 = s64[4]{0} add(%p0, %iota.1)\n"
        "  ROOT %t = (s64[4]{0}, bf16[1,2,16,4]{3,2,1,0}) tuple(%add.2, %p2)\n"
        "}\n"
    )
    buffers = (
        "BufferAssignment:\n"
        "allocation 0: size 32, parameter 0, shape |s64[4]| at ShapeIndex {}:\n"
        " value: <1 p0 @0> (size=32,offset=0): s64[4]{0}\n"
        "allocation 1: size 256, maybe-live-out:\n"
        " value: <2 add.2 @0> (size=32,offset=0): s64[4]{0}\n"
        "allocation 2: size 640, preallocated-temp:\n"
        " value: <3 fusion.1 @0> (size=512,offset=0): f32[128]{0}\n"
        " value: <4 fusion.2 @0> (size=128,offset=512): f32[32]{0}\n"
        " value: <5 convert.1 @0> (size=512,offset=0): f32[1,2,16,4]{3,2,1,0}\n"  # p2 in f32, sharing fusion.1's place
        " value: <6 convert.2 @0> (size=512,offset=256): f32[1,2,16,4]{3,2,1,0}\n"
    )
    row = audits.audit(audits.Program("m", hlo, buffers), {"bf16[1,2,16,4]", "f32[8]"})
    assert (row["s64_ops"], row["s64_largest"], row["s64_largest_shape"]) == (2, 4, "s64[4]")  # not the parameter
    assert (row["cache_buffers"], row["cache_aliased"], row["cache_bytes_copied"]) == (2, 1, 32)
    assert (row["largest_intermediate"], row["largest_is"]) == (512, "fusion.1 @0: f32[128]{0}")
    assert (row["parameters_bytes"], row["outputs_bytes"], row["temporaries_bytes"]) == (32, 256, 640)
    assert row["upcast_bytes"] == 768  # two f32 copies of the bf16 input, overlapping by 256 B
    assert audits.hlo_shape(torch.zeros(1, 2, 16, 4, dtype=torch.bfloat16)) == "bf16[1,2,16,4]"


@needs_xla
def test_notebook_07s_rows_carry_the_audit_of_what_xla_compiled(xla_series):
    """The 4-bit head (the last change before fusing) as a variant row: its programs write the
    cache in place, and the row says how large the largest intermediate is beside the whole
    main table dequantized: what a TPU reader checks before trusting its bytes per step."""
    backend = helpers.get_backend()
    series = helpers.course.series.prepare(backend, after=5)  # its own model: the variants change it in place
    (row,) = helpers.course.steps.measure_variants_in_place(backend, series, ks=(), variants=("4-bit head",))
    assert row["same_tokens"] and row["cache_in_place"] and row["cache_bytes_copied"] == 0
    # its int4 linears in the TPU form, the dequantized weight's matmul: XLA has no int4 kernel of torch's
    swapped = [m for m in series.model.modules() if isinstance(m, qlinear.QLinear)]
    assert swapped and not any(m.kernel for m in swapped) and {m.fmt for m in swapped} == {"int4"}
    config = series.model.config.get_text_config()
    whole_table = config.vocab_size * config.hidden_size * 4  # float32, the twin
    print(
        f"4-bit head: largest intermediate {row['largest_intermediate']:,} B, the table dequantized {whole_table:,} B"
    )
    assert 0 < row["largest_intermediate"] and row["program_bytes"] > 0
